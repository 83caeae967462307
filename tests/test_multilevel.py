"""Analytic chain and threshold models against Monte-Carlo simulation of their assumptions."""

import numpy as np
import pytest

from jaxspec.tools import multilevel as ml


def simulate_accepted(rng, alpha, k, trials):
    accepts = rng.random((trials, k)) < alpha
    return np.cumprod(accepts, axis=1).sum(axis=1) + 1


@pytest.mark.parametrize("alpha, k", [(0.0, 3), (0.5, 1), (0.7, 4), (0.9, 6), (1.0, 2)])
def test_accepted_distribution_matches_simulation(alpha, k):
    rng = np.random.default_rng(k)
    x = simulate_accepted(rng, alpha, k, 200_000)
    probs = ml.accepted_distribution(alpha, k)
    assert probs.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(np.bincount(x, minlength=k + 2)[1:] / len(x), probs, atol=0.005)
    assert ml.expected_accepted(alpha, k) == pytest.approx(x.mean(), rel=0.01, abs=1e-9)


def simulate_steps(rng, alpha, k, r, trials):
    steps = np.zeros(trials)
    for t in range(trials):
        produced = 0
        while produced < r:
            produced += simulate_accepted(rng, alpha, k, 1)[0]
            steps[t] += 1
    return steps.mean()


@pytest.mark.parametrize("alpha, k, r", [(0.6, 2, 5), (0.8, 4, 4), (0.3, 3, 7), (0.95, 1, 3)])
def test_expected_steps_matches_simulation(alpha, k, r):
    rng = np.random.default_rng(r)
    assert ml.expected_steps(alpha, k, r) == pytest.approx(simulate_steps(rng, alpha, k, r, 20_000), rel=0.02)


def simulate_chain_step(rng, costs, alphas, ks):
    """Seconds of one top-level verification, simulating every level's steps."""

    def produce(level, r):
        if level == 0:
            return r * costs[0]
        seconds, produced = 0.0, 0
        while produced < r:
            seconds += produce(level - 1, ks[level - 1]) + costs[level]
            produced += simulate_accepted(rng, alphas[level - 1], ks[level - 1], 1)[0]
        return seconds

    top = len(costs) - 1
    return produce(top - 1, ks[top - 1]) + costs[top]


def test_chain_step_cost_matches_simulation():
    rng = np.random.default_rng(0)
    costs, alphas, ks = (0.01, 0.1, 1.0), (0.6, 0.8), (3, 4)
    simulated = np.mean([simulate_chain_step(rng, costs, alphas, ks) for _ in range(20_000)])
    assert ml.chain_step_cost(costs, alphas, ks) == pytest.approx(simulated, rel=0.02)
    # A two-model chain is the two-model formula.
    assert ml.chain_throughput((0.1, 1.0), (0.7,), (4,)) == pytest.approx(ml.two_model_throughput(0.7, 4, 0.1, 1.0))


def test_optimal_k_is_the_brute_force_best_and_moves_the_expected_way():
    for alpha in (0.5, 0.8, 0.95):
        k, rate = ml.optimal_k(alpha, 0.05, 1.0)
        assert rate == max(ml.two_model_throughput(alpha, j, 0.05, 1.0) for j in range(33))
    # Better acceptance or a cheaper draft never shortens the optimal window.
    ks = [ml.optimal_k(a, 0.05, 1.0)[0] for a in (0.5, 0.7, 0.9, 0.97)]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    assert ml.optimal_k(0.8, 0.2, 1.0)[0] <= ml.optimal_k(0.8, 0.02, 1.0)[0]
    assert ml.optimal_k(0.5, 2.0, 1.0)[0] == 0  # a draft dearer than the target: do not speculate


def test_optimal_chain_beats_every_two_level_choice_it_contains():
    costs, alphas = (0.005, 0.08, 1.0), (0.7, 0.85)
    ks, rate = ml.optimal_chain(costs, alphas, max_k=8)
    assert rate >= max(ml.chain_throughput(costs, alphas, (a, b)) for a in range(1, 9) for b in range(1, 9)) - 1e-12


def simulate_threshold(rng, density, p, trials, cap):
    accepted, calls = np.zeros(trials), np.zeros(trials)
    for t in range(trials):
        cum, alive = 1.0, True
        for _ in range(cap):
            s = density.sample(rng, 1)[0]
            calls[t] += 1
            if cum * s < p:
                break
            cum *= s
            if alive and rng.random() < s:
                accepted[t] += 1
            else:
                alive = False
    return accepted.mean(), calls.mean()


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7])
def test_threshold_values_match_simulation(p):
    rng = np.random.default_rng(int(p * 100))
    density = ml.ConfidenceDensity.from_samples(rng.beta(5, 1.5, 100_000), bins=50)
    v, d = ml.threshold_values(density, p, max_tokens=12)
    v_sim, d_sim = simulate_threshold(rng, density, p, 20_000, 12)
    assert v == pytest.approx(v_sim, rel=0.03, abs=0.01)
    assert d == pytest.approx(d_sim, rel=0.03, abs=0.01)


def test_optimal_threshold_is_the_best_candidate():
    rng = np.random.default_rng(1)
    density = ml.ConfidenceDensity.from_samples(rng.beta(4, 1.5, 50_000))
    candidates = [0.05, 0.1, 0.2, 0.4, 0.8]
    p, rate = ml.optimal_threshold(density, 0.05, 1.0, candidates, max_tokens=8)
    assert rate == pytest.approx(max(ml.threshold_throughput(density, c, 0.05, 1.0, 8) for c in candidates))
    # A dearer draft wants a higher threshold (shorter windows).
    assert ml.optimal_threshold(density, 0.3, 1.0, candidates, 8)[0] >= p


def test_bad_inputs():
    with pytest.raises(ValueError, match="alpha must be in"):
        ml.accepted_distribution(1.5, 2)
    with pytest.raises(ValueError, match="need 2 alphas and ks"):
        ml.chain_step_cost((1, 2, 3), (0.5,), (2, 2))
    with pytest.raises(ValueError, match="threshold must be in"):
        ml.threshold_values(ml.ConfidenceDensity.from_samples([0.5]), 0.0)
