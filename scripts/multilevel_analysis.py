"""The analytic models of `jaxspec.tools.multilevel`, evaluated: optimal k and speedup against acceptance
and cost ratio (two models), chain examples, and threshold against fixed-length drafting.

No model runs; numbers follow from the formulas. Writes docs/results/multilevel.{json,md,png}.

    python scripts/multilevel_analysis.py
"""

from __future__ import annotations

import numpy as np
from checkout import RESULTS, pyplot

from jaxspec.tools import multilevel as ml
from jaxspec.tools.benchmarking import table, write_results

ALPHAS = np.round(np.arange(0.30, 0.991, 0.01), 2)
RATIOS = (0.01, 0.05, 0.1, 0.2, 0.4)   # draft cost / target cost


def two_models():
    rows, curves = [], {}
    for ratio in RATIOS:
        ks, speedups = [], []
        for alpha in ALPHAS:
            k, rate = ml.optimal_k(float(alpha), ratio, 1.0)
            ks.append(k)
            speedups.append(rate)  # target alone: 1 token per unit time
        curves[ratio] = (ks, speedups)
        for alpha in (0.5, 0.7, 0.8, 0.9, 0.95):
            i = int(np.argmin(np.abs(ALPHAS - alpha)))
            rows.append({"cost_ratio": ratio, "alpha": alpha, "optimal_k": ks[i], "speedup": speedups[i]})
    return rows, curves


def chains():
    """Three-model chains against the best two-model choices they contain."""
    rows = []
    for costs, alphas, direct in [((0.01, 0.1, 1.0), (0.7, 0.85), 0.6),
                                  ((0.005, 0.05, 1.0), (0.8, 0.8), 0.65),
                                  ((0.02, 0.2, 1.0), (0.6, 0.9), 0.55)]:
        ks, rate = ml.optimal_chain(costs, alphas, max_k=10)
        k_mid, rate_mid = ml.optimal_k(alphas[1], costs[1], costs[2])
        k_small, rate_small = ml.optimal_k(direct, costs[0], costs[2])
        rows.append({"costs": str(costs), "alphas": str(alphas), "alpha_small_to_target": direct,
                     "chain_ks": str(ks), "chain_speedup": rate, "mid_only_k": k_mid, "mid_only_speedup": rate_mid,
                     "small_only_k": k_small, "small_only_speedup": rate_small,
                     "chain_gain": rate / max(rate_mid, rate_small) - 1})
    return rows


def thresholds():
    rng = np.random.default_rng(0)
    rows = []
    for label, (a, b) in {"confident draft (Beta(5, 1.5))": (5, 1.5), "mixed draft (Beta(2, 1))": (2, 1)}.items():
        density = ml.ConfidenceDensity.from_samples(rng.beta(a, b, 200_000))
        alpha = float(np.sum(density.mass * density.centres))  # mean acceptance
        for ratio in (0.02, 0.1, 0.3):
            p, rate = ml.optimal_threshold(density, ratio, 1.0, max_tokens=16)
            k, fixed = ml.optimal_k(alpha, ratio, 1.0, max_k=16)
            rows.append({"density": label, "mean_alpha": alpha, "cost_ratio": ratio, "best_threshold": p,
                         "threshold_speedup": rate, "best_fixed_k": k, "fixed_k_speedup": fixed,
                         "threshold_gain": rate / fixed - 1})
    return rows


def plot(curves, path):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for ratio, (ks, speedups) in curves.items():
        left.step(ALPHAS, ks, where="mid", label=f"C1/C2 = {ratio}")
        right.plot(ALPHAS, speedups, label=f"C1/C2 = {ratio}")
    left.set(xlabel="acceptance rate alpha", ylabel="optimal k", title="Optimal draft length (two models)")
    right.set(xlabel="acceptance rate alpha", ylabel="throughput / target alone", title="Best speedup")
    right.axhline(1.0, color="grey", lw=0.8)
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    two, curves = two_models()
    chain_rows = chains()
    threshold_rows = thresholds()
    md = "\n".join([
        "Analytic models of `jaxspec.tools.multilevel` (no model runs). Throughput is relative to the target "
        "alone (one token per target call).", "",
        "### Two models: optimal k and speedup", "", table(two), "",
        "![optimal k and speedup](multilevel.png)", "",
        "### Three-model chains against the two-model choices they contain", "", table(chain_rows), "",
        "### Threshold drafting against the best fixed k (same mean acceptance)", "", table(threshold_rows)])
    print(md)
    write_results(RESULTS / "multilevel", {"two_models": two, "chains": chain_rows, "thresholds": threshold_rows}, md)
    plot(curves, RESULTS / "multilevel.png")


if __name__ == "__main__":
    main()
