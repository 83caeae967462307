"""Goodput policy on two device slices (draft on its own slice, sequential or pipelined) against fixed k.

For each mode and batch size, on 8 virtual CPU devices (target on device 0, draft on device 1):
fixed k = 1..K, the goodput policy (k chosen per lane step among 0..K) and goodput + TETRIS, each
as a two-slice `SpeculativeDecoder`. Configurations are warmed up and
timed round-robin on a different prompt set each round; ratios are medians over rounds of ratios
within a round, with 90% bootstrap intervals (`benchmarking.median_interval`) and the held-out
pick (`benchmarking.heldout_best_ratios`). Greedy outputs are checked against the target's own.
For the goodput rows: which draft lengths ran, and the measured seconds per verification.

    python scripts/bench_goodput_sliced.py [--batches 8 32] [--ks 1 2 3 4] [--threads single]

`--threads single` runs each device's programs on one thread (XLA's
`--xla_cpu_multi_thread_eigen=false`), so on a 2-core host the two slices can run at once (the
setting in which pipelining can overlap, `scripts/mesh_sweep.py`). Writes docs/results/<name>.{json,md}
(or --out DIR).
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__" and "jax" not in sys.modules:   # XLA reads its flags once, at backend start
    threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "single"
    flags = ["--xla_force_host_platform_device_count=8"]
    if threads == "single":
        flags.append("--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + flags).strip()

import numpy as np  # noqa: E402
from checkout import REPO, RESULTS, add_out_argument, out_dir  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec.tools.benchmarking import (  # noqa: E402
    PAIRS,
    build_pair,
    heldout_best_ratios,
    machine,
    median_interval,
    prompt_sets,
    round_robin,
    table,
    write_results,
)

MODES = {"draft slice": False, "pipelined": True}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="tiny-8L", choices=sorted(PAIRS))
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", choices=["single", "multi"], default="single")
    parser.add_argument("--no-tetris", action="store_true", help="skip goodput + TETRIS (k = K - 1, extra = 1)")
    parser.add_argument("--cost-model", default=str(RESULTS / "bench_goodput_sets_warmacc_cost_model.json"),
                        help="a CostModel JSON of the pair on this machine (one device)")
    parser.add_argument("--name", default="bench_goodput_sliced")
    add_out_argument(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    target, draft, pair_text = build_pair(args.pair)
    cost = jaxspec.CostModel.load(args.cost_model)
    mesh = jaxspec.MeshConfig(target_tp=1, draft_tp=1)
    rows, details = [], {}
    for batch in args.batches:
        sets = prompt_sets(target.config.vocab_size, batch, args.rounds + 1)
        references = [jaxspec.generate(target, ids, max_new_tokens=args.new_tokens).tokens for ids in sets]
        for mode, pipeline in MODES.items():
            decoders = {f"fixed k={k}": jaxspec.SpeculativeDecoder(
                target, draft, spec=jaxspec.SpecConfig(k=k, pipeline=pipeline), mesh=mesh) for k in args.ks}
            decoders["goodput"] = jaxspec.SpeculativeDecoder(target, draft, mesh=mesh, spec=jaxspec.SpecConfig(
                k=max(args.ks), policy="goodput", cost_model=cost, pipeline=pipeline))
            if not args.no_tetris:   # the same longest window: standard k < K, or TETRIS's K drafts a row
                decoders["goodput + tetris"] = jaxspec.SpeculativeDecoder(
                    target, draft, mesh=mesh, spec=jaxspec.SpecConfig(k=max(args.ks) - 1, extra=1, selection="tetris",
                                                                      policy="goodput", cost_model=cost,
                                                                      pipeline=pipeline))
            calls = {label: 0 for label in decoders}
            checks: dict[str, bool] = {label: True for label in decoders}
            extras: dict[str, list] = {label: [] for label in decoders}

            def run(label, decoder):
                def call(on_finish):
                    index = calls[label] % len(sets)
                    calls[label] += 1
                    result = decoder.generate(sets[index], max_new_tokens=args.new_tokens, on_finish=on_finish)
                    checks[label] &= result.tokens == references[index]
                    extras[label].append(result.stats)
                    return result
                return call

            print(f"batch {batch}, {mode}: warm-up and {args.rounds} rounds", flush=True)
            _, seconds, _ = round_robin({label: run(label, d) for label, d in decoders.items()}, args.rounds)
            fixed = [label for label in decoders if not label.startswith("goodput")]
            best = min(fixed, key=lambda label: float(np.median(seconds[label])))
            for label in decoders:
                ratio = seconds[best] / seconds[label]
                held = heldout_best_ratios(seconds, fixed, label)
                stats = extras[label][-args.rounds:]
                trace = [k for s in stats for k in s.extra["k_trace"]]
                row = dict(batch=batch, mode=mode, method=label, best_fixed="yes" if label == best else "",
                           tok_s=float(np.median([s.new_tokens / s.seconds for s in stats])),
                           vs_best_fixed=float(np.median(ratio)),
                           vs_best_fixed_90="%.3f-%.3f" % median_interval(ratio),
                           vs_heldout_best=float(np.median(held)),
                           vs_heldout_best_90="%.3f-%.3f" % median_interval(held),
                           mean_k=float(np.mean(trace)), acceptance=float(np.mean([s.acceptance_rate for s in stats])),
                           same_output=checks[label])
                if label.startswith("goodput"):
                    row.update(k_shares=" ".join(f"{k}:{trace.count(k) / len(trace):.2f}" for k in sorted(set(trace))),
                               lane_step_ms=1e3 * float(np.median([s.seconds / len(s.extra["k_trace"])
                                                                   for s in stats])))
                    details[f"{batch} {mode} {label}"] = dict(trace=stats[-1].extra["k_trace"])
                rows.append(row)
                print(row, flush=True)
            write(args, pair_text, cost, rows, details)


def write(args, pair_text, cost, rows, details) -> None:
    text = (f"{pair_text}, greedy, {args.new_tokens} new tokens per request, on 8 virtual CPU devices "
            f"(XLA threads: {args.threads}): the target on one device, the draft on another "
            "(`MeshConfig(target_tp=1, draft_tp=1)`); `draft slice`: each step drafts, then verifies; "
            "`pipelined`: two batches, one drafting while the other verifies. Every configuration is "
            f"warmed up, then timed once per round for {args.rounds} rounds on a new prompt set each round; "
            "`vs_best_fixed`: the median over rounds of the best fixed k's time over the method's, in the "
            "same round (`_90`: a 90% bootstrap interval of that median); `vs_heldout_best`: each round "
            "against the fixed k with the best median over the other rounds. `mean_k`: the mean draft "
            "length of the verifications over the timed rounds (`k_shares`: how often each ran). `goodput + tetris`: "
            "k = K - 1, extra = 1 (standard windows up to K - 1, or TETRIS's K drafts a row and a budget chosen "
            "by goodput; `mean_k` counts its drafts). For the goodput rows, `lane_step_ms`: the measured "
            "seconds per verification (median over rounds of call time over verifications, prefill included); "
            "the policy plans with the cost model's lane-step times (`plans.plan_seconds`). "
            "`same_output`: every call's tokens equal the target's own "
            "greedy output. "
            f"Machine: {machine()['platform']}, {machine().get('cpu_count', '?')} cores. Cost model: "
            f"`{os.path.relpath(args.cost_model, REPO)}` (one device).\n\n")
    columns = ["batch", "mode", "method", "best_fixed", "tok_s", "vs_best_fixed", "vs_best_fixed_90",
               "vs_heldout_best", "vs_heldout_best_90", "mean_k", "k_shares", "acceptance", "lane_step_ms",
               "same_output"]
    full = [{c: row.get(c, "") for c in columns} for row in rows]
    write_results(out_dir(args) / args.name, dict(machine=machine(), args=vars(args), cost_model=cost.to_dict(),
                                                  rows=rows, details=details), text + table(full, columns) + "\n")


if __name__ == "__main__":
    main()
