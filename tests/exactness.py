"""The sampling proof every decoding path shares: a chi-square test of sampled token sequences
against the target's exact distribution, enumerated on a tiny vocabulary, with its power.

`exact_joint` is the independent reference: P(first `depth` tokens) by enumeration over the
uncached `model.logits` with the same float32 transforms (temperature, top-k, top-p).

Power: for an error moving total-variation mass `tv` between the test's cells, the chi-square
statistic's noncentrality is rows * sum(d_i**2 / p_i) >= 4 * rows * tv**2 (Cauchy-Schwarz over
the cells gaining and the cells losing mass; equality when each half holds probability 1/2 and
the error is proportional to p). So `detectable_tv(rows, cells)` is the smallest error of any
shape the test rejects with probability >= 90% at the suite's level ALPHA. Rare cells are pooled
so the chi-square approximation holds; an error confined to the pool is seen only through its
net change of the pool's mass (`pooled_mass` says how much probability that is).

Set JAXSPEC_CHI_SQUARE_LOG=FILE to append one JSON line per test (its name, rows, cells, power):
the table in docs/exactness.md comes from such a run.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter

import numpy as np
from scipy import optimize, stats

from jaxspec.sampling import probabilities

ALPHA = 1e-3      # the suite's level: a correct path fails one chi-square test in a thousand
MIN_EXPECTED = 5  # cells expected fewer times than this are pooled
VOCAB6_PROMPT = [1, 4, 2]   # the prompt of the 6-token-vocabulary tests


@functools.cache
def vocab6_models():
    """The 6-token-vocabulary target, a 1-layer draft that agrees with it about half the time, and
    a narrower draft for the draft (a chain's lowest level)."""
    import jaxspec
    cfg = jaxspec.ModelConfig.preset("tiny").replace(vocab_size=6, name="tiny-v6")
    return (jaxspec.Model.random(cfg, seed=3), jaxspec.Model.random(cfg.replace(num_layers=1), seed=4),
            jaxspec.Model.random(cfg.replace(num_layers=1, hidden_size=32, intermediate_size=64), seed=5))


def exact_joint(model, prompt, depth, sampling) -> dict[tuple, float]:
    """P(first `depth` tokens after `prompt`) for every sequence the transforms allow."""
    prefixes, probs = [()], np.ones(1)
    for _ in range(depth):
        logits = np.asarray(model.logits([list(prompt) + list(p) for p in prefixes]))[:, -1]
        p = np.asarray(probabilities(logits, sampling), np.float64)
        rows, tokens = np.nonzero(p > 0)
        prefixes = [prefixes[r] + (int(t),) for r, t in zip(rows, tokens)]
        probs = probs[rows] * p[rows, tokens]
    return dict(zip(prefixes, probs))


@functools.lru_cache(maxsize=None)
def detectable_tv(rows: int, cells: int, alpha: float = ALPHA, power: float = 0.9) -> float:
    """Smallest total-variation error a chi-square over `cells` cells of `rows` samples rejects
    with probability `power` at level `alpha`, whatever the error's shape."""
    df = cells - 1
    critical = stats.chi2.isf(alpha, df)
    noncentrality = optimize.brentq(lambda lam: stats.ncx2.sf(critical, df, lam) - power, 1e-9, 1e7)
    return float(np.sqrt(noncentrality / (4 * rows)))


def chi_square(tokens, table) -> dict:
    """The test of `tokens` (sequences, one per sample) against `table` (exact_joint's output)."""
    return chi_square_counts(Counter(tuple(t) for t in tokens), table)


def chi_square_counts(counts: dict, table) -> dict:
    """The test of {sequence: times sampled} against `table`."""
    outside = {key for key, n in counts.items() if n} - set(table)
    assert not outside, f"sampled sequences the transforms exclude: {sorted(outside)[:5]}"
    keys = sorted(table)
    observed = np.array([counts.get(key, 0) for key in keys], float)
    probs = np.array([table[key] for key in keys])
    rows = int(observed.sum())
    expected = probs / probs.sum() * rows
    small = expected < MIN_EXPECTED
    if small.any():
        observed = np.r_[observed[~small], observed[small].sum()]
        expected = np.r_[expected[~small], expected[small].sum()]
    result = stats.chisquare(observed, expected)
    return dict(rows=rows, cells=len(expected), pooled_mass=float(probs[small].sum() / probs.sum()),
                tv90=detectable_tv(rows, len(expected)), statistic=float(result.statistic),
                pvalue=float(result.pvalue))


def assert_matches_distribution(tokens, table, rows=None):
    """Sampled sequences follow `table`: chi-square p-value above ALPHA (`rows`: expected count)."""
    result = chi_square(tokens, table)
    assert rows is None or result["rows"] == rows, (result["rows"], rows)
    log = os.environ.get("JAXSPEC_CHI_SQUARE_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(log, "a") as f:
            f.write(json.dumps(dict(test=test, depth=len(next(iter(table))), **result)) + "\n")
    assert result["pvalue"] > ALPHA, result
