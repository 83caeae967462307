"""How much a goodput decoder's result depends on its own warm-up: many decoders, one batch size.

A goodput decoder times its plans once, at its first call for a shape (`GoodputControl.warm_up`),
and ranks draft lengths by those times from then on. Where the timing is noisy, decoders built the
same way settle on different draft lengths. This script builds `--decoders` goodput decoders
(each its own warm-up) and times them round-robin with fixed k configurations, in shuffled order
each round, on prompt sets that change every round. Per decoder it reports the median over rounds
of its ratio to the best fixed configuration (the one with the best median time), the draft
length it ran most and how often; then the spread over decoders. Writes
docs/results/<name>.{json,md}.

    python scripts/goodput_warmups.py [--batch 1] [--decoders 8] [--rounds 20] [--ks 3 4 5 6]
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

import jaxspec
from jaxspec.benchmarking import PAIRS, build_pair, machine, median_interval, prompt_sets, table, write_results
from jaxspec.cost import CostModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="tiny-8L", choices=sorted(PAIRS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 4, 5, 6], help="fixed draft lengths timed beside them")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--cost-model", default="docs/results/bench_goodput_sets_warmacc_cost_model.json")
    parser.add_argument("--name", default="goodput_warmups")
    args = parser.parse_args()
    for name, value, low in (("--batch", args.batch, 1), ("--decoders", args.decoders, 1),
                             ("--rounds", args.rounds, 1), ("--new-tokens", args.new_tokens, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")

    target, draft, pair_text = build_pair(args.pair)
    cost = CostModel.load(args.cost_model)
    sets = prompt_sets(target.config.vocab_size, args.batch, args.rounds)
    kmax = max(args.ks)
    decoders = {f"fixed k={k}": jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=k))
                for k in args.ks}
    goodput = [f"goodput {i}" for i in range(args.decoders)]
    decoders.update({label: jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(
        k=kmax, policy="goodput", cost_model=cost)) for label in goodput})
    start = time.perf_counter()
    for decoder in decoders.values():   # compiles, and each goodput decoder's warm-up
        decoder.generate(sets[0], max_new_tokens=args.new_tokens)
    print(f"warmed up {len(decoders)} decoders in {time.perf_counter() - start:.0f} s", flush=True)

    seconds = collections.defaultdict(list)
    lengths = collections.defaultdict(list)   # per goodput decoder and round: the draft length run most
    labels = list(decoders)
    order = np.random.default_rng(0)
    for r in range(args.rounds):
        for i in order.permutation(len(labels)):
            label = labels[i]
            begin = time.perf_counter()
            result = decoders[label].generate(sets[r], max_new_tokens=args.new_tokens)
            seconds[label].append(time.perf_counter() - begin)
            if label in goodput:
                lengths[label].append(collections.Counter(result.stats.extra["k_trace"]).most_common(1)[0][0])
    secs = {label: np.asarray(v) for label, v in seconds.items()}
    fixed = [f"fixed k={k}" for k in args.ks]
    best = min(fixed, key=lambda label: float(np.median(secs[label])))
    rows = []
    for label in labels:
        ratios = secs[best] / secs[label]
        low, high = median_interval(ratios)
        row = {"decoder": label, "vs_best_fixed": float(np.median(ratios)), "vs_best_fixed_90": f"{low:.3f}-{high:.3f}"}
        if label in goodput:
            common, count = collections.Counter(lengths[label]).most_common(1)[0]
            row.update(k_most=common, calls_at_k_most=f"{count} of {args.rounds}",
                       k_per_round="".join(map(str, lengths[label])))
        rows.append(row)
    ratios = np.array([row["vs_best_fixed"] for row in rows if row["decoder"] in goodput])
    summary = {"best_fixed": best, "mean": float(ratios.mean()), "min": float(ratios.min()),
               "max": float(ratios.max()), "below_0.97": int(np.sum(ratios < 0.97))}
    text = (f"{pair_text}. Batch {args.batch}, greedy, {args.new_tokens} new tokens. "
            f"{args.decoders} goodput decoders (k <= {kmax}, each its own warm-up) and fixed k = "
            f"{', '.join(map(str, args.ks))}, all warmed up, then timed once per round for {args.rounds} rounds in "
            f"a shuffled order, round i on prompt set i; `vs_best_fixed`: the median over rounds of the "
            f"ratio within a round to the best fixed configuration (`{best}`, the best median time), with a "
            f"90% bootstrap interval; `k_per_round`: each round's most-run draft length. Cost model "
            f"`{args.cost_model}`. Machine: {machine()['processor']}, {machine()['cpu_count']} cores, "
            f"{machine()['device_kind']}, jax {machine()['jax']}.\n\n"
            f"Goodput decoders against the best fixed: mean {summary['mean']:.3f}, range "
            f"{summary['min']:.3f}-{summary['max']:.3f}, {summary['below_0.97']} of {args.decoders} below 0.97.\n\n")
    markdown = text + table(rows, ["decoder", "vs_best_fixed", "vs_best_fixed_90", "k_most", "calls_at_k_most",
                                   "k_per_round"])
    print(markdown, flush=True)
    write_results(args.name, {"args": vars(args), "rows": rows, "summary": summary,
                              "round_seconds": {label: v.tolist() for label, v in secs.items()}}, markdown)


if __name__ == "__main__":
    main()
