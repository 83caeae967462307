"""The attention paths over the KV cache (`jaxspec.models.attention.ATTENTION`) in the engine's decode
step: plain (batched dots over the whole buffer), blocked (blocks up to the longest live row),
XLA's `jax.nn.dot_product_attention`, and cuDNN's on a GPU; at a few live lengths of one cache
buffer. Each path's program is compiled first, then all are timed round-robin (a step: a loop of
1 + n steps minus a loop of 1, medians over rounds).

    python scripts/bench_attention.py [--preset smollm2-135m] [--layers N] [--batches 1 8]
        [--slots 1024] [--live 64 512 900] [--rounds 5] [--blocks 128 256] [--name bench_attention]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from checkout import add_out_argument, out_dir

import jaxspec
from jaxspec.drafting import NgramDrafter
from jaxspec.engine import timing
from jaxspec.models import attention as attention_lib
from jaxspec.tools.benchmarking import machine, table, write_results

STEPS = 8


def attention_rows(model, batch: int, slots: int, live, rounds: int, before_deadline=lambda: True,
                   blocks=(attention_lib.BLOCK,)) -> list[dict]:
    """One row per (path, live length): the decode step's milliseconds and its ratio to plain's
    (the blocked path at each block size of `blocks`, named "blocked/<size>" when several)."""
    drafter = NgramDrafter().bind_vocab(model.config.vocab_size)
    timers, default_block = {}, attention_lib.BLOCK
    paths = [("plain", None)] + [("blocked", b) for b in blocks] + [("xla", None)]
    for impl, block in paths + ([("cudnn", None)] if jax.default_backend() == "gpu" else []):
        attention_lib.ATTENTION, attention_lib.BLOCK = impl, block or default_block
        jax.clear_caches()   # `step_timer` keeps the program compiled now, with this path
        name = f"{impl}/{block}" if block and len(blocks) > 1 else impl
        for context in live:
            if before_deadline():
                timers[name, context] = timing.step_timer(model, drafter, 0, batch, slots, iterations=STEPS, seed=0,
                                                                  context=context)
                timers[name, context](1)
    attention_lib.ATTENTION, attention_lib.BLOCK = "auto", default_block
    jax.clear_caches()
    seconds = {key: [] for key in timers}
    for _ in range(rounds):
        for key, run in timers.items():
            seconds[key].append((run(1 + STEPS) - run(1)) / STEPS)
    ms = {key: 1e3 * float(np.median(v)) for key, v in seconds.items()}
    return [{"attention": impl, "batch": batch, "live_slots": context, "cache_slots": slots,
             "step_ms": round(step, 3), "vs_plain": round(step / ms["plain", context], 3)}
            for (impl, context), step in ms.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset's")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--slots", type=int, default=1024)
    p.add_argument("--live", type=int, nargs="+", default=[64, 512, 900])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--blocks", type=int, nargs="+", default=[attention_lib.BLOCK], help="blocked path's block sizes")
    p.add_argument("--name", default="bench_attention")
    add_out_argument(p)
    args = p.parse_args()
    config = jaxspec.ModelConfig.preset(args.preset)
    config = config.replace(num_layers=args.layers or config.num_layers)
    model = jaxspec.Model.random(config, seed=0, dtype=args.dtype)
    rows = []
    for batch in args.batches:
        rows += attention_rows(model, batch, args.slots, args.live, args.rounds, blocks=args.blocks)
        print(table(rows[-len(args.live) * (2 + len(args.blocks)):]), flush=True)
    m = machine()
    md = "\n".join([
        f"Attention paths in the decode step (plain decoding), {config.name} shape ({config.num_layers} layers, "
        f"random weights, {args.dtype}), a cache of {args.slots} slots per row with `live_slots` of them filled; "
        f"each step timed inside the engine's device loop, {args.rounds} round-robin rounds after compiling "
        f"(medians). `vs_plain`: the step against the plain path's at the same batch and live length. Machine: "
        f"{m['processor']}, {m['cpu_count']} cores, {m['device_kind']}, jax {m['jax']}.", "", table(rows)])
    write_results(out_dir(args) / args.name, {"args": vars(args), "rows": rows}, md)
    print("\n" + md)


if __name__ == "__main__":
    main()
