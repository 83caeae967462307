"""The sampling proof's own checks: the enumerated reference against a one-prefix-at-a-time walk,
and the stated power of the chi-square against simulated errors of that size."""

import numpy as np
import pytest
from exactness import ALPHA, chi_square_counts, detectable_tv, exact_joint, vocab6_models

from jaxspec.sampling import SamplingConfig, probabilities


def test_the_enumerated_joint_equals_a_walk_over_single_prefixes():
    model, prompt = vocab6_models()[0], [1, 4, 2]
    sampling = SamplingConfig(temperature=1.0, top_p=0.8)
    want = {}

    def walk(prefix, prob):
        if len(prefix) == 3:
            want[tuple(prefix)] = prob
            return
        p = np.asarray(probabilities(np.asarray(model.logits([prompt + prefix]))[0, -1], sampling), np.float64)
        for token in np.nonzero(p > 0)[0]:
            walk(prefix + [int(token)], prob * p[token])

    walk([], 1.0)
    got = exact_joint(model, prompt, 3, sampling)
    assert set(got) == set(want) and sum(got.values()) == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose([got[key] for key in want], list(want.values()), rtol=1e-5)


def _worst_case_error(p, tv):
    """p with mass `tv` moved, in proportion, from the cells holding half the probability to the
    others: the error of that size with the least chi-square noncentrality."""
    order = np.argsort(p)
    half = np.cumsum(p[order]) <= 0.5
    gain, lose = order[half], order[~half]
    q = p.copy()
    q[gain] += tv * p[gain] / p[gain].sum()
    q[lose] -= tv * p[lose] / p[lose].sum()
    return q


@pytest.mark.parametrize("cells, rows", [(30, 4000), (150, 8000)])
def test_the_stated_power_is_the_rejection_rate_of_a_worst_case_error(cells, rows):
    """At `detectable_tv`, simulated samples from the least visible error of that size are rejected
    about 90% of the time; at half that error, mostly not; with no error, at about ALPHA."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(cells, 20.0))   # every cell expected >= 5 times: no pooling
    assert (p * rows).min() >= 5
    table = {(i,): float(x) for i, x in enumerate(p)}
    tv = detectable_tv(rows, cells)
    trials = 400

    def rejected(q):
        counts = rng.multinomial(rows, q, size=trials)
        return np.mean([chi_square_counts(dict(zip(table, row)), table)["pvalue"] <= ALPHA for row in counts])

    assert 0.86 <= rejected(_worst_case_error(p, tv)) <= 0.94
    assert rejected(_worst_case_error(p, tv / 2)) < 0.3
    assert rejected(p) < 0.02
