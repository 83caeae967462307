"""Analytic throughput models of speculative chains (after Benoit, Marchal and Obrecht, 2026).

A chain M_1 -> M_2 -> ... -> M_t: M_1 drafts autoregressively, each M_n (n >= 2) verifies windows
of k_n tokens produced by the level below, and M_t is the target. A call of M_n costs C_n seconds;
each drafted token is accepted by the level above with probability alpha (independently: the
standard model of the speculative decoding literature).

Two models (draft, target):
- accepted tokens per verification, bonus included: P(X = i) = alpha^(i-1) (1 - alpha) for i <= k,
  P(X = k + 1) = alpha^k; E[X] = (1 - alpha^(k+1)) / (1 - alpha);
- one verification costs k C_1 + C_2, so throughput = E[X] / (k C_1 + C_2).

Chains: a level that must hand r tokens upwards runs verification steps until it has them; the
expected number of its steps is R(r) = 1 + sum_{i=1}^{min(r, k+1)} P(X = i) R(r - i), R(0) = 0.
One step of level n costs the time the level below needs to produce k_n tokens plus C_n, so
T_1(r) = r C_1 and T_n(r) = R_n(r) (T_{n-1}(k_n) + C_n); the chain's throughput is
E[X_t] / (T_{t-1}(k_t) + C_t).

Threshold drafting: instead of a fixed k, the draft stops when the cumulative confidence of its
window falls below p; with confidence density f on (0, 1] and acceptance probability equal to
the (calibrated) confidence, the expected accepted tokens per verification is
V(p) = int_p^1 f(s) s (1 + V(p / s)) ds and the expected draft calls D(p) = 1 + int_p^1 f(s) D(p / s) ds,
solved here by discretising p on a log grid (V(p / s) is needed only at larger thresholds).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np


def accepted_distribution(alpha: float, k: int) -> np.ndarray:
    """P(X = i) for i = 1..k+1: tokens a verification of k drafts yields, bonus included."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    i = np.arange(1, k + 2)
    probs = alpha ** (i - 1) * (1.0 - alpha)
    probs[-1] = alpha ** k
    return probs


def expected_accepted(alpha: float, k: int) -> float:
    """E[X] = (1 - alpha^(k+1)) / (1 - alpha) (k + 1 at alpha = 1)."""
    return float(np.dot(np.arange(1, k + 2), accepted_distribution(alpha, k)))


def expected_steps(alpha: float, k: int, r: int) -> float:
    """R(r): expected verification steps of a level to produce r tokens."""
    probs = accepted_distribution(alpha, k)

    @functools.lru_cache(maxsize=None)
    def steps(n: int) -> float:
        if n <= 0:
            return 0.0
        return 1.0 + sum(probs[i - 1] * steps(n - i) for i in range(1, min(n, k + 1) + 1))

    return steps(r)


def two_model_throughput(alpha: float, k: int, draft_cost: float, target_cost: float) -> float:
    """Tokens per second of draft + target with k drafts per verification (k = 0: target alone)."""
    return expected_accepted(alpha, k) / (k * draft_cost + target_cost)


def optimal_k(alpha: float, draft_cost: float, target_cost: float, max_k: int = 32) -> tuple[int, float]:
    """(k, throughput) maximising two-model throughput over k = 0..max_k."""
    rates = [two_model_throughput(alpha, k, draft_cost, target_cost) for k in range(max_k + 1)]
    best = int(np.argmax(rates))
    return best, rates[best]


def chain_step_cost(costs: Sequence[float], alphas: Sequence[float], ks: Sequence[int]) -> float:
    """Expected seconds of one verification step of the top model.

    Args:
      costs: C_1..C_t, seconds per call of each model, smallest first.
      alphas: alpha_2..alpha_t, acceptance of level n-1's tokens by level n (t - 1 values).
      ks: k_2..k_t, the window each level verifies (t - 1 values).
    """
    _check_chain(costs, alphas, ks)

    def produce(level: int, r: int) -> float:  # seconds for level `level` (0-based) to hand up r tokens
        if level == 0:
            return r * costs[0]
        step = produce(level - 1, ks[level - 1]) + costs[level]
        return expected_steps(alphas[level - 1], ks[level - 1], r) * step

    top = len(costs) - 1
    return produce(top - 1, ks[top - 1]) + costs[top]


def chain_throughput(costs: Sequence[float], alphas: Sequence[float], ks: Sequence[int]) -> float:
    """Tokens per second of the whole chain (the top model's accepted tokens per step over its cost)."""
    return expected_accepted(alphas[-1], ks[-1]) / chain_step_cost(costs, alphas, ks)


def optimal_chain(costs: Sequence[float], alphas: Sequence[float], max_k: int = 12) -> tuple[tuple[int, ...], float]:
    """The k_n of every level maximising chain throughput, by exhaustive search over 1..max_k."""
    best, best_rate = None, -1.0
    for ks in itertools.product(range(1, max_k + 1), repeat=len(costs) - 1):
        rate = chain_throughput(costs, alphas, ks)
        if rate > best_rate:
            best, best_rate = ks, rate
    return best, best_rate


def _check_chain(costs, alphas, ks):
    if len(costs) < 2:
        raise ValueError(f"a chain needs at least 2 models, got {len(costs)} costs")
    if len(alphas) != len(costs) - 1 or len(ks) != len(costs) - 1:
        raise ValueError(f"{len(costs)} models need {len(costs) - 1} alphas and ks, got {len(alphas)} and {len(ks)}")
    if any(k < 1 for k in ks):
        raise ValueError(f"every k_n must be >= 1 in a chain, got {list(ks)}")


# --- threshold drafting ---

class ConfidenceDensity:
    """A density f of per-token draft confidence on (0, 1], as a histogram.

    Build it from observed confidences (`from_samples`), or from a function on a grid.
    """

    def __init__(self, edges: np.ndarray, mass: np.ndarray):
        edges, mass = np.asarray(edges, float), np.asarray(mass, float)
        if edges[0] < 0 or edges[-1] > 1 or np.any(np.diff(edges) <= 0) or len(mass) != len(edges) - 1:
            raise ValueError("edges must increase within [0, 1] with one mass per bin")
        self.edges = edges
        self.mass = mass / mass.sum()
        self.centres = 0.5 * (edges[1:] + edges[:-1])

    @classmethod
    def from_samples(cls, confidences, bins: int = 50) -> ConfidenceDensity:
        counts, edges = np.histogram(np.clip(confidences, 1e-9, 1.0), bins=bins, range=(0.0, 1.0))
        return cls(edges, counts + 1e-12)

    def sample(self, rng: np.random.Generator, size) -> np.ndarray:
        which = rng.choice(len(self.mass), size=size, p=self.mass)
        return rng.uniform(self.edges[which], self.edges[which + 1])


def threshold_values(density: ConfidenceDensity, threshold: float, grid: int = 400, max_tokens: int | None = None
                     ) -> tuple[float, float]:
    """(V(p), D(p)): expected accepted drafts and draft calls per verification with threshold p.

    Solved on a log grid of thresholds from p up to 1; `max_tokens` caps the window (a static K).
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    s, w = density.centres, density.mass
    log_p = np.linspace(np.log(threshold), 0.0, grid)  # V and D on p_i = exp(log_p[i])
    depth = max_tokens if max_tokens is not None else 10_000
    # Iterate the recursion depth-wise: window lengths are bounded, so this converges exactly.
    v = np.zeros(grid)
    d = np.zeros(grid)
    for _ in range(min(depth, 200)):
        p = np.exp(log_p)[:, None]
        keep = s[None, :] >= p                                        # the token stays in the window
        nxt = np.clip(np.log(np.maximum(p / s[None, :], 1e-300)), log_p[0], 0.0)
        v_next = np.interp(nxt, log_p, v)
        d_next = np.interp(nxt, log_p, d)
        above = p / s[None, :] > 1.0                                  # next threshold above 1: stops
        v_next = np.where(above, 0.0, v_next)
        d_next = np.where(above, 0.0, d_next)
        v_new = np.sum(np.where(keep, w * s * (1.0 + v_next), 0.0), axis=1)
        d_new = 1.0 + np.sum(np.where(keep, w * d_next, 0.0), axis=1)
        converged = np.allclose(v_new, v, atol=1e-10) and np.allclose(d_new, d, atol=1e-10)
        v, d = v_new, d_new
        if converged:
            break
    return float(v[0]), float(d[0])


def threshold_throughput(density: ConfidenceDensity, threshold: float, draft_cost: float, target_cost: float,
                         max_tokens: int | None = None) -> float:
    """Tokens per second with threshold drafting: (1 + V(p)) / (D(p) C_1 + C_2)."""
    v, d = threshold_values(density, threshold, max_tokens=max_tokens)
    return (1.0 + v) / (d * draft_cost + target_cost)


def optimal_threshold(density: ConfidenceDensity, draft_cost: float, target_cost: float,
                      candidates: Sequence[float] | None = None, max_tokens: int | None = None) -> tuple[float, float]:
    """(p, throughput) maximising threshold-drafting throughput over candidate thresholds."""
    candidates = candidates if candidates is not None else np.geomspace(0.01, 0.95, 40)
    rates = [threshold_throughput(density, p, draft_cost, target_cost, max_tokens) for p in candidates]
    best = int(np.argmax(rates))
    return float(candidates[best]), rates[best]
