"""What the goodput policy's machinery costs a call, apart from the plans it picks.

Two pairs of decoders that run the same steps, timed alternately in one process after warm-up:

- the autoregressive loop against a goodput decoder held to plain decoding (a cost model under
  which drafting never pays, `measure_plans=False`);
- fixed k = K against goodput decoders with k <= K held to drafting (a cost model under which
  drafting is free, so the longest draft pays most), once for each `--choose-every` (how often a
  drafting segment re-chooses its plan on device, `SpecConfig.choose_every`); K is `--draft-len`
  (default 1).

Greedy decoding with the same draft length emits the same tokens in the same steps, so each pair's
time difference is the policy's overhead alone. Timing calls of two lengths (`--tokens`) splits it
into a part per call (host work, the opening's choice, transfers) and a part per step (the loop's
bookkeeping, the on-device choices), by a line through the two lengths' paired differences.
Then each call is timed again by phase (`--phase-reps` calls, longer length): the host's own work,
its dispatches of compiled programs (asynchronous: host time), and its reads of results (waiting
for the device, and the transfers), each the median over calls; `extra_*` columns are the
differences of those medians against the row's reference.

    python scripts/policy_overhead.py [--pair tiny-8L] [--batches 4 16] [--tokens 32 96] [--reps 15]
        [--choose-every 4 16] [--draft-len 1] [--plain-only] [--dtype bfloat16] [--name policy_overhead]

Writes docs/results/<name>.json and .md (or under a path given as --name).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time

import jax
import numpy as np

import jaxspec
from jaxspec.benchmarking import PAIRS, build_pair, machine, prompt_sets, table, write_results
from jaxspec.cost import CostModel
from jaxspec.engine import loop

# Under this cost model a draft position costs a whole second: plain decoding wins at any acceptance.
NEVER_DRAFT = dict(draft_fixed=1.0, draft_per_token=0.0, target_fixed=1e-3, target_per_token=1e-5)
# Under this one drafting is free and a step's cost hardly depends on its tokens, so at the pairs'
# acceptance the longest draft allowed beats plain decoding (and shorter drafts) by far more than
# the policy's margins, and no plain trial comes close enough to be proposed. (At batch 1, K = 6,
# the drain rule still shortened some calls' last steps: `on_plan` 0.86-0.96.)
FREE_DRAFT = dict(draft_fixed=0.0, draft_per_token=0.0, target_fixed=1e-2, target_per_token=1e-6)


def paired_line(diffs_ms: dict[int, np.ndarray], steps: dict[int, int]) -> tuple[float, float]:
    """(ms per call, us per step) of the line through each length's median paired difference."""
    lengths = sorted(diffs_ms)
    x = np.array([steps[n] for n in lengths], np.float64)
    y = np.array([np.median(diffs_ms[n]) for n in lengths], np.float64)
    if len(lengths) < 2 or np.ptp(x) == 0:
        return float(np.mean(y)), float("nan")
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(1e3 * slope)


@contextlib.contextmanager
def phase_clock():
    """Wraps the decoders' compiled-program dispatches and result reads with a clock; yields the
    dict of seconds per phase ("dispatch", "read") that each call adds to (reset it per call)."""
    generate_module = importlib.import_module("jaxspec.generate")
    spent = {"dispatch": 0.0, "read": 0.0}
    depth = [0]

    def timed(fn, phase):
        def wrapper(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:   # a read inside a read counts once
                    spent[phase] += time.perf_counter() - start
        return wrapper

    patches = [(loop, name, "dispatch") for name in ("start_on_device", "run_on_device", "refill_on_device",
                                                    "plain_call_on_device")]
    patches += [(loop, "segment_outputs", "read"), (generate_module, "_generate_on_device", "dispatch"),
                (jax, "device_get", "read")]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, phase in patches:
            setattr(module, name, timed(getattr(module, name), phase))
        yield spent
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="tiny-8L", choices=sorted(PAIRS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 96])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--choose-every", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--draft-len", type=int, default=1, help="K: fixed k = K against goodput with k <= K")
    parser.add_argument("--phase-reps", type=int, default=10, help="calls timed by phase, per method (0: none)")
    parser.add_argument("--plain-only", action="store_true",
                        help="only the autoregressive loop against goodput held to plain decoding (fewer programs "
                             "to compile: for a short GPU lease at the qwen2.5 shapes)")
    parser.add_argument("--name", default="policy_overhead")
    args = parser.parse_args()
    if len(set(args.tokens)) < 2:
        raise ValueError(f"--tokens needs two different lengths to split per call from per step, got {args.tokens}")
    target, draft, pair_text = build_pair(args.pair, args.dtype)
    never, free = CostModel.from_coefficients(**NEVER_DRAFT), CostModel.from_coefficients(**FREE_DRAFT)
    kk = args.draft_len
    if kk < 1:
        raise ValueError(f"--draft-len must be >= 1, got {kk}")

    def decoder(**spec):
        return jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(**spec))

    # (label, reference label, decoder or None for the autoregressive loop, the draft length it should run)
    methods = [("autoregressive", None, None, 0),
               ("goodput, plain", "autoregressive", decoder(k=2, policy="goodput", cost_model=never,
                                                            measure_plans=False), 0),
               (f"fixed k={kk}", None, decoder(k=kk), kk)]
    methods += [(f"goodput k<={kk}, choose every {e}", f"fixed k={kk}",
                 decoder(k=kk, policy="goodput", cost_model=free, measure_plans=False, choose_every=e), kk)
                for e in args.choose_every]
    if args.plain_only:
        del methods[2:]
    columns = (["batch", "method"] + [f"ms_{n}" for n in args.tokens] + [f"steps_{n}" for n in args.tokens]
               + ["vs", "extra_ms_per_call", "extra_us_per_step", "on_plan", "same_output"]
               + ["host_ms", "dispatch_ms", "read_ms", "extra_host_ms", "extra_dispatch_ms", "extra_read_ms"])
    rows, raw = [], {}
    for batch in args.batches:
        ids = prompt_sets(target.config.vocab_size, batch, 1)[0]
        seconds = {label: {n: [] for n in args.tokens} for label, *_ in methods}
        steps, on_plan, same = {}, {}, {}
        for n in args.tokens:
            def run(dec, n=n):
                return (jaxspec.generate(target, ids, max_new_tokens=n) if dec is None
                        else dec.generate(ids, max_new_tokens=n))
            for _ in range(2):   # warm-up: compiles, and the goodput decoders' first-call timing
                results = {label: run(dec) for label, _, dec, _ in methods}
            order = np.random.default_rng(batch * 1000 + n)
            for _ in range(args.reps):
                for i in order.permutation(len(methods)):
                    label, _, dec, k = methods[i]
                    start = time.perf_counter()
                    res = run(dec)
                    seconds[label][n].append(time.perf_counter() - start)
                    if dec is not None and "k_trace" in res.stats.extra:
                        trace = np.asarray(res.stats.extra["k_trace"])
                        on_plan.setdefault(label, []).append(float(np.mean(trace == k)))
                    results[label] = res
            reference = results["autoregressive"].tokens
            for label, *_ in methods:
                steps[(label, n)] = results[label].stats.steps
                same.setdefault(label, True)
                same[label] &= results[label].tokens == reference
        phases = {}
        if args.phase_reps:
            n = max(args.tokens)
            with phase_clock() as spent:
                for _ in range(args.phase_reps):
                    for label, _, dec, _ in methods:
                        spent.update(dispatch=0.0, read=0.0)
                        start = time.perf_counter()
                        if dec is None:
                            jaxspec.generate(target, ids, max_new_tokens=n)
                        else:
                            dec.generate(ids, max_new_tokens=n)
                        total = time.perf_counter() - start
                        phases.setdefault(label, []).append(
                            (total - spent["dispatch"] - spent["read"], spent["dispatch"], spent["read"]))
        for label, ref, _, _ in methods:
            row = {"batch": batch, "method": label}
            if label in phases:
                host, dispatch, read = (1e3 * np.median(np.asarray(phases[label]), axis=0)).tolist()
                row.update(host_ms=host, dispatch_ms=dispatch, read_ms=read)
                if ref is not None:
                    ref_host, ref_dispatch, ref_read = (1e3 * np.median(np.asarray(phases[ref]), axis=0)).tolist()
                    row.update(extra_host_ms=host - ref_host, extra_dispatch_ms=dispatch - ref_dispatch,
                               extra_read_ms=read - ref_read)
            for n in args.tokens:
                row[f"ms_{n}"] = 1e3 * float(np.median(seconds[label][n]))
                row[f"steps_{n}"] = steps[(label, n)]
            if ref is not None:
                diffs = {n: 1e3 * (np.asarray(seconds[label][n]) - np.asarray(seconds[ref][n])) for n in args.tokens}
                per_call, per_step = paired_line(diffs, {n: steps[(ref, n)] for n in args.tokens})
                row.update(vs=ref, extra_ms_per_call=per_call, extra_us_per_step=per_step)
            if label in on_plan:
                row["on_plan"] = float(np.mean(on_plan[label]))
            row["same_output"] = bool(same[label])
            rows.append(row)
            raw[f"{batch}/{label}"] = {n: seconds[label][n] for n in args.tokens}
        print(table([r for r in rows if r["batch"] == batch], columns), flush=True)
    m = machine()
    text = (f"{pair_text}, greedy. Each row's calls timed {args.reps} times per length, alternating with the "
            f"others in shuffled order after warm-up; `ms_N`: median call time for N new tokens; `extra_ms_per_call`"
            f" / `extra_us_per_step`: the line through the median paired differences against `vs` at the two "
            f"lengths, over the steps `vs` ran; `on_plan`: the share of steps at the draft length the row is held "
            f"to. `host_ms` / `dispatch_ms` / `read_ms`: a {max(args.tokens)}-token call by phase (medians over "
            f"{args.phase_reps} calls): the host's own work, its dispatches of compiled programs, and its reads of "
            f"results (the wait for the device included); `extra_*`: less the reference's. "
            f"Machine: {m['processor']}, {m['cpu_count']} cores, {m['device_kind']}, jax {m['jax']}.")
    write_results(args.name, {"args": vars(args), "rows": rows, "seconds": raw},
                  markdown=f"# Policy overhead\n\n{text}\n\n{table(rows, columns)}")
    print(text)


if __name__ == "__main__":
    main()
