"""How many kernels one decode step runs, fixed k against the goodput policy: a noise-free measure
of the policy's per-step cost.

On XLA:CPU each fused kernel of a compiled loop body runs one at a time, with a few microseconds
of overhead each, and at the tiny-8L pair's batch-1 shapes that overhead is most of a step; on a
GPU each is a kernel launch. So the number of fusions in the step's loop body (and in the
drafter's scan body, run k - 1 times a step) counts what the policy's bookkeeping adds to every
drafting step, without the timing noise of a shared machine. Compiles only (no timing).

    python scripts/step_kernels.py [--pair tiny-8L] [--batches 1 4 16 64] [--k 4] [--name step_kernels]

Writes docs/results/<name>.json and .md (or under a path given as --name).
"""

from __future__ import annotations

import argparse
import re

import jax
import numpy as np

import jaxspec
from jaxspec import engine
from jaxspec import prompts as prompts_lib
from jaxspec.benchmarking import PAIRS, build_pair, machine, prompt_sets, table, write_results
from jaxspec.cost import CostModel
from jaxspec.engine.control import as_arrays
from jaxspec.generate import request_keys

NEW_TOKENS = 96


def compiled_text(decoder, ids, k: int) -> str:
    """The optimised HLO of `run_on_device` for `decoder`'s plan of draft length k."""
    target = decoder.target
    batch = prompts_lib.prepare(ids, None, vocab_size=target.config.vocab_size,
                                max_positions=target.config.max_position_embeddings, max_new_tokens=NEW_TOKENS)
    cache_len = engine.cache_length(batch.tokens_bp.shape[1], batch.out_len, NEW_TOKENS, decoder.spec.draft_len)
    slots = prompts_lib.bucket_batch(len(ids))
    schedule, budget = decoder._schedule(slots, len(ids), cache_len)
    goodput = schedule.predict_ks is not None
    static = dict(cache_len=cache_len, seq_len=cache_len, out_len=batch.out_len, mesh=None)
    rows = prompts_lib.subset(batch, list(range(len(ids))), min_rows=slots)   # padded to the slots, as a call's
    rows_in = (rows.tokens_bp, rows.lengths_b, rows.max_new_b, request_keys(0, rows.request_ids_b))
    seconds = as_arrays(decoder._goodput.predicted_seconds(schedule, slots, cache_len))
    plan = [p.k for p in schedule.plans].index(k)
    if goodput:
        opening = (np.int32(plan), decoder._goodput.acceptance.seed(schedule.positions), np.bool_(True))
        flags = (np.int32(0), np.int32(NEW_TOKENS), np.bool_(True), np.bool_(False))
    else:
        opening, flags = (None, None, None), (np.int32(0), np.int32(NEW_TOKENS), None, None)
    args = (target.graphdef, decoder.drafter, engine.prefill_schedule(schedule), decoder.sampling, target.params,
            decoder.drafter.params)
    state = engine.start_on_device(*args, *rows_in, np.int32(-1), seconds, *opening, **static)
    return engine.run_on_device.lower(target.graphdef, decoder.drafter, schedule, decoder.sampling, target.params,
                                      decoder.drafter.params, state, rows_in[3], rows_in[2], np.int32(-1),
                                      np.int32(budget), seconds, *flags, **static,
                                      plan_index=plan).compile().as_text()


def body_kernels(hlo: str) -> tuple[int, int]:
    """Fusions in the step's loop body and in the drafter's scan body (run k - 1 times a step):
    of the computations that carry a KV cache (a 4-d float array in their parameters), the two
    with the most fusions. (The policy's choice has computations of its own, over small arrays.)"""
    counts = sorted((len(re.findall(r" fusion\(", c)) for c in re.split(r"\n(?=\S)", hlo)
                     if re.search(r"[fb]f?\d+\[\d+,\d+,\d+,\d+\]", c.split("\n", 1)[0])), reverse=True)
    return counts[0], counts[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="tiny-8L", choices=sorted(PAIRS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--k", type=int, default=4, help="the draft length compared (goodput: k <= this)")
    parser.add_argument("--name", default="step_kernels")
    args = parser.parse_args()
    target, draft, pair_text = build_pair(args.pair, args.dtype)
    # Any cost model compiles the same programs; its numbers only enter as traced arguments.
    cost = CostModel.from_coefficients(draft_fixed=1e-3, draft_per_token=1e-5, target_fixed=1e-3,
                                       target_per_token=1e-5)
    decoders = {"fixed": jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=args.k)),
                "goodput": jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(
                    k=args.k, policy="goodput", cost_model=cost))}
    rows = []
    for batch in args.batches:
        ids = prompt_sets(target.config.vocab_size, batch, 1)[0]
        counts = {label: body_kernels(compiled_text(dec, ids, args.k)) for label, dec in decoders.items()}
        for label, (step, scan) in counts.items():
            per_step = step + (args.k - 1) * scan
            rows.append({"batch": batch, "method": f"{label} k={args.k}", "step_body": step, "draft_scan_body": scan,
                         "kernels_per_step": per_step,
                         "extra_per_step": per_step - counts["fixed"][0] - (args.k - 1) * counts["fixed"][1]})
        print(table([r for r in rows if r["batch"] == batch]), flush=True)
        jax.clear_caches()
    m = machine()
    text = (f"{pair_text}. Fusions (kernels) in the compiled drafting step of `engine.run_on_device` at draft length "
            f"{args.k}: `step_body`, the step's loop body; `draft_scan_body`, the drafter's scan body, run k - 1 "
            f"times a step; `kernels_per_step` = step_body + (k - 1) draft_scan_body; "
            f"`extra_per_step`: less fixed k's. "
            f"Compiled, not timed. Machine: {m['processor']}, {m['cpu_count']} cores, {m['device_kind']}, "
            f"jax {m['jax']}.")
    write_results(args.name, {"args": vars(args), "rows": rows},
                  markdown=f"# Kernels per step\n\n{text}\n\n{table(rows)}")
    print(text)


if __name__ == "__main__":
    main()
