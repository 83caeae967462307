"""Drafters: what proposes draft tokens each step (never how many are verified).

  base.py        the `Drafter` protocol, `Proposal`, and what the model drafters share
  model.py       `ModelDrafter`: a smaller model on its own KV cache
  ngram.py       `NgramDrafter`: prompt lookup in the row's own context
  suffix.py      `SuffixDrafter`: suffix decoding from earlier requests and the row's context
  hybrid.py      `HybridDrafter`: per row, the proposal of whichever drafter expects more
  eagle.py       `EagleDrafter`: an EAGLE-3 head fed the target's features
  crossvocab.py  `CrossVocabDrafter`, `VocabMap`: a draft model with another tokenizer
  trees.py       `TreeShape`, `Tree`, and growing a tree from a draft model's logits (EAGLE-2)
"""

from jaxspec.drafting.base import Drafter, Proposal
from jaxspec.drafting.crossvocab import CrossVocabDrafter, VocabMap
from jaxspec.drafting.eagle import EagleDrafter
from jaxspec.drafting.hybrid import HybridDrafter
from jaxspec.drafting.model import ModelDrafter
from jaxspec.drafting.ngram import NgramDrafter
from jaxspec.drafting.suffix import SuffixDrafter

__all__ = ["CrossVocabDrafter", "Drafter", "EagleDrafter", "HybridDrafter", "ModelDrafter", "NgramDrafter", "Proposal",
           "SuffixDrafter", "VocabMap"]
