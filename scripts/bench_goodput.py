"""Goodput policy against every fixed configuration, across batch sizes.

For each batch size: autoregressive decoding, fixed k = 1..6 (standard), fixed-k TETRIS, and the
goodput policy with standard selection (k chosen each step among 0..6) and with TETRIS
(a draft length below k + extra, or the TETRIS window at one of a few budgets). The cost model is
profiled first on this device (and saved next to the results); for each fixed k the measured mean
step time is compared with the cost model's prediction. Greedy outputs are checked identical to
autoregressive decoding (and where one differs, the row and token where it parts are reported). Configurations are timed
round-robin and compared within a round (the machine's speed drifts). Writes
docs/results/<name>.{json,md,png} (or --out DIR) after every batch.

    python scripts/bench_goodput.py [--batches 1 4 16 64] [--new-tokens 96] [--cost-model FILE]

On a GPU, at the qwen2.5-1.5b / 0.5b shapes in bfloat16, with options for a short lease
(`--profile-per-batch`, `--no-tetris`, `--deadline`): scripts/bench_goodput_gpu.sh OUTDIR.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import numpy as np
from checkout import add_out_argument, out_dir, pyplot

import jaxspec
from jaxspec.engine.plans import cache_length
from jaxspec.engine.timing import side_by_side, time_points
from jaxspec.policy.cost import CostModel
from jaxspec.tools.benchmarking import (
    PAIRS,
    build_pair,
    divergence,
    heldout_best_ratios,
    machine,
    median_interval,
    prompt_sets,
    table,
    write_results,
)


def profile_batches(batches):
    """The batch sizes profiled: powers of two up to the largest benchmarked, and those benchmarked."""
    return sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max(batches)} | set(batches))


def generate_fn(decoder, target, new_tokens):
    if decoder is None:
        return lambda ids: jaxspec.generate(target, ids, max_new_tokens=new_tokens)
    return lambda ids: decoder.generate(ids, max_new_tokens=new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="tiny-8L", choices=sorted(PAIRS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--tetris", action=argparse.BooleanOptionalAction, default=True,
                        help="also fixed-k TETRIS and the goodput policy with TETRIS")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds over all configurations")
    parser.add_argument("--prompt-sets", type=int, default=1,
                        help="round i runs prompt set i mod N (same lengths, other tokens): the best fixed "
                             "configuration is then the best over N samples of text, not on one (default: one set)")
    parser.add_argument("--cost-model", help="use this cost model JSON instead of profiling first")
    parser.add_argument("--profile-ks", type=int, nargs="+", default=[0, 1, 2, 4, 6])
    parser.add_argument("--profile-per-batch", action=argparse.BooleanOptionalAction, default=False,
                        help="profile each batch's own shapes (--profile-ks at --profile-cache-sizes) just before "
                             "benchmarking it, refitting over every point so far (with --cost-model, starting from "
                             "that model's points), instead of a grid first")
    parser.add_argument("--profile-cache-sizes", type=int, nargs="+", default=[1, 2],
                        help="--profile-per-batch: the cache sizes timed, as multiples of the batch's own")
    parser.add_argument("--deadline", type=float,
                        help="seconds to finish in: a batch starts only if, at the pace of the slowest batch so far, "
                             "it ends by then (results are written after every batch)")
    parser.add_argument("--name", default="bench_goodput", help="output name under --out (or a path)")
    add_out_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    target, draft, pair_text = build_pair(args.pair, args.dtype)
    config = target.config
    out = out_dir(args) / args.name
    out.parent.mkdir(parents=True, exist_ok=True)
    provenance = dict(target_name=config.name, draft_name=draft.config.name, dtype=str(target.dtype), mesh_shape=(),
                      device_kind=jax.devices()[0].device_kind)
    points = []   # profiled steps (batch, k, cache size, seconds)
    cost = None
    if args.cost_model:
        cost = CostModel.load(args.cost_model)
        if args.profile_per_batch:
            points = [tuple(p) for p in cost.fit.get("step", {}).get("points_seconds", [])]
    elif not args.profile_per_batch:
        start = time.perf_counter()
        cost = CostModel.profile(target, draft, batches=profile_batches(args.batches),
                                 ks=tuple(args.profile_ks), cache_lens=(128, 256))
        print(f"profiled in {time.perf_counter() - start:.0f} s: R^2 {cost.fit['step']['r2']:.3f}, worst held-out "
              f"error {cost.fit['step']['worst_heldout_rel_error']:.1%}", flush=True)
        cost.save(f"{out}_cost_model.json")
        points = [tuple(p) for p in cost.fit["step"]["points_seconds"]]
        if jax.devices()[0].platform == "cpu":
            jax.clear_caches()   # bounds XLA:CPU's memory maps; elsewhere the fixed rows reuse the programs
    sets = prompt_sets(config.vocab_size, max(args.batches), max(args.prompt_sets, 1))
    kmax = max(args.ks)
    rows, round_seconds, skipped, batch_seconds = [], {}, [], [0.0]
    round_plans = {}   # the goodput runs' (draft length, steps) segments, per batch and round
    for batch in args.batches:
        batch_start = time.perf_counter()
        if args.deadline is not None and batch_start - started + 1.1 * max(batch_seconds) > args.deadline:
            skipped.append(batch)
            print(f"batch {batch} skipped: it would end past the {args.deadline:.0f} s deadline", flush=True)
            continue
        batch_sets = [prompts[:batch] for prompts in sets]
        ids = batch_sets[0]
        prompt_width, out_len = (jaxspec.prompts.bucket_length(max(map(len, ids))),
                                 jaxspec.prompts.bucket_length(args.new_tokens))
        rows_b = jaxspec.prompts.bucket_batch(batch)
        if args.profile_per_batch:
            start = time.perf_counter()
            step_len = cache_length(prompt_width, out_len, args.new_tokens, kmax)
            points += time_points(target, draft, [
                (rows_b, k, s) for s in sorted({m * step_len for m in args.profile_cache_sizes})
                for k in args.profile_ks])
            cost = CostModel.fit_points(points, **provenance)
            cost.save(f"{out}_cost_model.json")
            print(f"batch {batch}: profiled in {time.perf_counter() - start:.0f} s; fit over {len(points)} points: "
                  f"R^2 {cost.fit['step']['r2']:.3f}", flush=True)
        profiled = {(b, k, s): sec for b, k, s, sec in points}
        # The fixed configurations' steps at their compiled shapes, where the profile has not timed
        # them: in shuffled passes, as the profile is (timed one after another at batch 1, k = 5's
        # step came out 9% dearer than k = 6's).
        fixed_shapes = [(rows_b, k, cache_length(prompt_width, out_len, args.new_tokens, k)) for k in args.ks]
        profiled.update({(b, k, s): sec for b, k, s, sec in time_points(
            target, draft, [shape for shape in fixed_shapes if shape not in profiled], passes=5)})
        configs = [("autoregressive", None)]
        configs += [(f"fixed k={k}", jaxspec.SpecConfig(k=k)) for k in args.ks]
        if args.tetris:
            configs += [("tetris k=2 extra=2", jaxspec.SpecConfig(k=2, extra=2, selection="tetris")),
                        ("tetris k=4 extra=2", jaxspec.SpecConfig(k=4, extra=2, selection="tetris"))]
        configs += [("goodput", jaxspec.SpecConfig(k=kmax, policy="goodput", cost_model=cost))]
        if args.tetris:
            configs += [("goodput + tetris", jaxspec.SpecConfig(k=4, extra=2, selection="tetris", policy="goodput",
                                                                cost_model=cost))]
        start = time.perf_counter()
        fns = {label: generate_fn(None if spec is None else jaxspec.SpeculativeDecoder(target, draft, spec=spec),
                                  target, args.new_tokens) for label, spec in configs}
        # Warm-up (compiles). The fixed configurations warm up side by side, one thread each up to
        # the host's cores (their programs compile in parallel: about 18 s each at the qwen2.5
        # shapes on an H200's host); the goodput decoders one at a time after them (two calls: their
        # plans compile as the policy first picks them).
        fixed_fns = {label: fn for label, fn in fns.items() if not label.startswith("goodput")}
        results = dict(zip(fixed_fns, side_by_side([functools.partial(fn, ids) for fn in fixed_fns.values()])))
        results.update({label: [fn(ids), fn(ids)][-1] for label, fn in fns.items() if label not in results})
        print(f"batch {batch}: warmed up in {time.perf_counter() - start:.0f} s", flush=True)
        # The machine's speed drifts over minutes (a shared VM), so every configuration is timed
        # once per round and ratios are taken within a round, then the median over rounds. The
        # order is shuffled each round: in a fixed order the goodput runs always came last, ten
        # runs after the autoregressive one, and a drift in between fell on their ratios in every
        # round alike.
        seconds = {label: [] for label in fns}
        segments = {label: [] for label in fns}   # the goodput runs' segments, one list per round
        order = np.random.default_rng(batch)
        for round_index in range(args.rounds):
            ids = batch_sets[round_index % len(batch_sets)]
            for i in order.permutation(len(fns)):
                label, fn = list(fns.items())[i]
                start = time.perf_counter()
                results[label] = fn(ids)
                seconds[label].append(time.perf_counter() - start)
                segments[label].append(results[label].stats.extra.get("segments", []))
        secs = {label: np.asarray(v) for label, v in seconds.items()}
        fixed = [label for label, _ in configs if not label.startswith("goodput")]
        # The best fixed configuration is the one a user would pick: the fastest by median over
        # rounds. (The fastest per round instead would be the best of ten noisy draws where several
        # configurations are within the noise, biased upward by about one noise width.)
        best_label = min(fixed, key=lambda label: float(np.median(secs[label])))
        best_fixed_s = secs[best_label]
        reference = results["autoregressive"].tokens   # the last round's, on its prompts (`ids`)
        batch_rows = []
        for label, spec in configs:
            res = results[label]
            s = res.stats
            tokens = sum(map(len, res.tokens))
            heldout = heldout_best_ratios(secs, fixed, label)
            row = {"batch": batch, "method": label, "best_fixed": "yes" if label == best_label else "",
                   "tok_s": tokens / float(np.median(secs[label])),
                   "vs_ar": float(np.median(secs["autoregressive"] / secs[label])),
                   "vs_best_fixed": float(np.median(best_fixed_s / secs[label])),
                   "vs_best_fixed_90": "{:.3f}-{:.3f}".format(*median_interval(best_fixed_s / secs[label])),
                   "vs_heldout_best": float(np.median(heldout)),
                   "vs_heldout_best_90": "{:.3f}-{:.3f}".format(*median_interval(heldout)),
                   "steps": s.steps, "draft_len": s.mean_draft_length,
                   "acceptance": s.acceptance_rate if spec is not None else None,
                   "same_output": divergence(target, ids, reference, res.tokens)}
            if label.startswith("fixed"):
                # The step the prediction is about, at this run's compiled shape, in a loop.
                step_len = cache_length(prompt_width, out_len, args.new_tokens, spec.k)
                measured = profiled[(rows_b, spec.k, step_len)]
                predicted = cost.step_seconds(rows_b, spec.k, step_len)
                row.update(step_ms=1e3 * measured, predicted_step_ms=1e3 * predicted,
                           prediction_error=predicted / measured - 1)
            if label.startswith("goodput"):
                trace = s.extra["k_trace"]
                row["k_used"] = f"{np.mean(trace):.2f} (0 in {np.mean(np.asarray(trace) == 0):.0%} of steps)"
                # The cost model's step time of the plans run against their segments' wall time per
                # step (round trip included), pooled over the timed rounds.
                plan_s = s.extra["plan_seconds"]
                segs = np.asarray([(n, t, n * plan_s[j]) for run in segments[label] for j, n, t in run if n > 0])
                row.update(step_ms=1e3 * segs[:, 1].sum() / segs[:, 0].sum(),
                           predicted_step_ms=1e3 * segs[:, 2].sum() / segs[:, 0].sum(),
                           prediction_error=segs[:, 2].sum() / segs[:, 1].sum() - 1)
            batch_rows.append(row)
            print(table([row], COLUMNS), flush=True)
        rows += batch_rows
        round_seconds[batch] = {label: v.tolist() for label, v in secs.items()}
        round_plans[batch] = {label: [[(j, n) for j, n, _ in run] for run in runs]
                              for label, runs in segments.items() if label.startswith("goodput")}
        jax.clear_caches()   # programs of this batch size are not reused; keep memory maps bounded
        report(args, out, pair_text, cost, points, rows, round_seconds=round_seconds, skipped=skipped,
               round_plans=round_plans)
        batch_seconds.append(time.perf_counter() - batch_start)
        print(f"batch {batch}: {batch_seconds[-1]:.0f} s", flush=True)
    print("\n" + report(args, out, pair_text, cost, points, rows, round_seconds=round_seconds, skipped=skipped,
                        round_plans=round_plans))


def report(args, out, pair_text, cost, points, rows, *, round_seconds, skipped, round_plans=None) -> str:
    """Writes <out>.{json,md,png} for the batches run so far; returns the markdown."""
    m = machine()
    fit = cost.fit.get("step", {})
    held = fit.get("worst_heldout_rel_error")
    shapes = (f"batch {min(p[0] for p in points)}..{max(p[0] for p in points)}, k "
              f"{min(p[1] for p in points)}..{max(p[1] for p in points)}, {len(points)} shapes"
              + (", each batch's just before it was benchmarked" if args.profile_per_batch else "")) if points else ""
    if points and args.cost_model:
        profile = (f"Cost model: the points of `{args.cost_model}` with this machine's profile of each batch's own "
                   f"shapes added (real decode steps, {shapes}), fitted together: R^2 "
                   f"{fit.get('r2', float('nan')):.3f}")
        profile += f", worst held-out error {held:.1%}." if held is not None else " (too few shapes to hold any out)."
    elif points:
        profile = (f"Cost model profiled on this machine (real decode steps, {shapes}): fit R^2 "
                   f"{fit.get('r2', float('nan')):.3f}")
        profile += f", worst held-out error {held:.1%}." if held is not None else " (too few shapes to hold any out)."
    else:
        profile = f"Cost model loaded from `{args.cost_model}`."
    batches_run = [b for b in args.batches if b in round_seconds]
    md = "\n".join([
        f"{pair_text}, greedy, {args.new_tokens} new tokens per request. Every configuration is warmed up, then "
        f"timed once per round for {args.rounds} rounds"
        + (f", round i on prompt set i mod {args.prompt_sets} (random prompts of the same lengths, other tokens: "
           "every configuration meets the same text in a round, and the best fixed one is best over several "
           "samples of text, not picked after the fact on one)" if args.prompt_sets > 1 else ", on one prompt set")
        + "; `vs_ar` and `vs_best_fixed` are medians over rounds of "
        "ratios within a round (this shared VM's speed drifts by tens of percent over minutes, so times from "
        "different moments are not comparable); the best fixed configuration is the fixed one with the best median "
        "time (`best_fixed`); `vs_best_fixed_90`: a 90% bootstrap interval of that median over the rounds. "
        "`vs_heldout_best` (and its `_90`): the same median, each round against the fixed configuration with the best "
        "median over the other rounds (`benchmarking.heldout_best_ratios`): where several fixed configurations are "
        "within the noise, the one picked on the very rounds it is compared on is the one that drew fast noise there, "
        "and every other method looks slower by about that much; picked without the round, it is what a user would "
        "have fixed in advance. "
        "`step_ms`: one decode step at the run's compiled shape timed in a compiled loop (median over shuffled "
        "passes), against the cost model's `predicted_step_ms`; for the goodput rows, the mean wall time per step "
        "of their segments (round trip included) against the cost model's for the plans they ran. "
        "`same_output`: the greedy output "
        "equals the autoregressive loop's token for token (or where the first differing row parts from it). "
        "`k_used`: the goodput run's mean draft length over the last round's steps and its share of plain steps. "
        f"Machine: {m['processor']}, {m['cpu_count']} cores, {m['device_kind']}, jax {m['jax']}"
        f"{', XLA_FLAGS ' + repr(m['xla_flags']) if m['xla_flags'] else ''}. {profile}"
        + (f" Not run (they would have ended past the {args.deadline:.0f} s deadline): batch "
           f"{', '.join(map(str, skipped))}." if skipped
           else ""),
        "", table(rows, COLUMNS), "", f"![goodput]({out.name}.png)"])
    plot(rows, batches_run, out.with_name(f"{out.name}.png"))
    write_results(out, {"args": vars(args), "cost_model": cost.to_dict(), "rows": rows,
                        "round_seconds": round_seconds, "round_plans": round_plans or {},
                        "skipped_batches": skipped}, md)
    return md


COLUMNS = ["batch", "method", "best_fixed", "tok_s", "vs_ar", "vs_best_fixed", "vs_best_fixed_90", "vs_heldout_best",
           "vs_heldout_best_90", "step_ms",
           "predicted_step_ms", "prediction_error", "steps", "draft_len", "acceptance", "k_used",
           "same_output"]


def plot(rows, batches, path):
    plt = pyplot()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    for method in methods:
        ys = [next((r["vs_ar"] for r in rows if r["method"] == method and r["batch"] == b), np.nan) for b in batches]
        style = dict(lw=2.5, marker="o") if method.startswith("goodput") else dict(lw=1, alpha=0.6, marker=".")
        ax.plot(batches, ys, label=method, **style)
    ax.set(xscale="log", xlabel="batch size", ylabel="tokens/s relative to autoregressive",
           title="Fixed configurations and the goodput policy")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
