"""Training drafts: the shared optimizer / data order / checkpoint loop (`loop.py`), distillation of
a draft model (`distill.py`), EAGLE-3 heads (`eagle.py`) and the target features they train on
(`feature_cache.py`). Nothing runs at import."""
