"""TETRIS against standard speculative decoding at the same verification budget.

Parts:
  tiny    random layer-skip pair (the draft is the target's first layers; acceptance varies by row),
          batches 8, 32, 64, k = 1..5, standard vs TETRIS extra = 1..3 with C = N * k.
  qwen    Qwen2.5-Coder 1.5B <- 0.5B on the code prompts (needs `make models-qwen`), batch 8.
  packed  target verification time, packed (N + C tokens) against padded (N * (K + 1)), at equal N.

Every configuration is warmed up on the same compiled shapes, then timed (median of --repeats);
greedy outputs are checked identical to autoregressive decoding. `select_share` is the time of one
`tetris.select` at the step's shape (measured in a compiled loop) over the mean step time.
Prints tables and writes docs/results/bench_tetris.{json,md} (or --out DIR, --name NAME).

    python scripts/bench_tetris.py [--part tiny qwen packed] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from checkout import add_out_argument, code_prompts, out_dir, qwen_files

import jaxspec
from jaxspec import tetris
from jaxspec.models.model import forward, forward_packed
from jaxspec.tools.benchmarking import PAIRS, layer_skip_pair, machine, table, timed, write_results

TINY = PAIRS["tiny-8L"][0]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _select_loop(lp_nk, capacity, reps):
    def body(i, total):
        # A different input each iteration, so the compiler cannot hoist the selection.
        return total + tetris.select(lp_nk - i.astype(jnp.float32) * 1e-6, capacity).sum()
    return jax.lax.fori_loop(0, reps, body, jnp.int32(0))


def select_seconds(n: int, k: int, capacity: int, reps: int = 200) -> float:
    lp = jnp.log(jax.random.uniform(jax.random.key(0), (n, k), minval=0.05))
    seconds, _ = timed(lambda: _select_loop(lp, capacity, reps).block_until_ready(), repeats=5)
    return seconds / reps


def run_grid(label, target, draft, prompts, batches, ks, extras, *, new_tokens, repeats):
    rows = []
    for batch in batches:
        ids = prompts[:batch]
        seconds, ar = timed(lambda: jaxspec.generate(target, ids, max_new_tokens=new_tokens), repeats=repeats)
        ar_tok_s = sum(map(len, ar.tokens)) / seconds
        print(f"{label} batch {batch}: autoregressive {ar_tok_s:.1f} tok/s", flush=True)
        for k in ks:
            base = None
            for extra in [0, *extras]:
                selection = "tetris" if extra else "standard"
                spec = jaxspec.SpecConfig(k=k, extra=extra, selection=selection)
                decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec)
                seconds, res = timed(lambda: decoder.generate(ids, max_new_tokens=new_tokens), repeats=repeats)
                s = res.stats
                tok_s = sum(map(len, res.tokens)) / seconds
                row_steps = sum(s.extra["per_request_steps"])
                step_s = seconds / s.steps
                if extra:
                    padded_rows = jaxspec.prompts.bucket_batch(batch)
                    capacity = tetris.capacity_bucket(batch * k, padded_rows, k + extra)
                    share = select_seconds(padded_rows, k + extra, capacity) / step_s
                else:
                    share = None
                row = {"task": label, "batch": batch, "k": k, "selection": selection, "extra": extra,
                       "vsr": s.vsr, "ter": s.ter, "accepted_per_row_step": s.accepted_tokens / row_steps,
                       "emitted_per_row_step": s.mean_accepted_length, "draft_len": s.mean_draft_length,
                       "tok_s": tok_s, "vs_ar": tok_s / ar_tok_s, "step_ms": 1e3 * step_s,
                       "select_share": share, "same_output": res.tokens == ar.tokens}
                if base is None:
                    base = row
                else:
                    row["vsr_gain"] = row["vsr"] / base["vsr"] - 1 if base["vsr"] else None
                    row["tok_s_gain"] = row["tok_s"] / base["tok_s"] - 1
                rows.append(row)
                print(table([row], GRID_COLUMNS), flush=True)
    return rows


GRID_COLUMNS = ["task", "batch", "k", "selection", "extra", "vsr", "vsr_gain", "ter", "accepted_per_row_step",
                "draft_len", "tok_s", "tok_s_gain", "vs_ar", "select_share", "same_output"]


def tiny_part(args):
    target, draft = layer_skip_pair(TINY, draft_layers=2, damping=0.15, sharpness=6.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, int(n)).tolist() for n in rng.integers(4, 48, max(args.batches))]
    return run_grid("tiny layer-skip pair", target, draft, prompts, args.batches, args.ks, args.extras,
                    new_tokens=args.new_tokens, repeats=args.repeats)


def qwen_part(args):
    target, draft = map(jaxspec.load, qwen_files())
    return run_grid("qwen-coder 1.5B <- 0.5B, code", target, draft, code_prompts(target.tokenizer), [8],
                    args.qwen_ks, args.extras, new_tokens=args.qwen_new_tokens, repeats=1)


def packed_part(args):
    """Verification only: one target pass over N rows at context ~128, K = 8 drafts per row."""
    model = jaxspec.Model.random(jaxspec.ModelConfig.preset(args.packed_model), seed=0)
    return packed_rows(model, args.packed_batches, args.repeats)


def packed_rows(model, batches, repeats: int = 3, capacities=None) -> list[dict]:
    """Packed (N + C tokens) against padded (N * 9) verification passes of `model` at each batch,
    for C in `capacities` as multiples of N (default 1/4 to 8)."""
    config = model.config
    rows = []
    for n in batches:
        width = 9
        cache = model.init_cache(n, 160)
        prompt = jax.random.randint(jax.random.key(1), (n, 128), 0, config.vocab_size)
        _, cache = jax.jit(forward, static_argnums=0)(model.graphdef, model.params, prompt, cache)
        cache = cache.commit(jnp.full((n,), 128, jnp.int32))
        window = jax.random.randint(jax.random.key(2), (n, width), 0, config.vocab_size)
        padded_fn = jax.jit(forward, static_argnums=0)
        padded_s, _ = timed(lambda: jax.block_until_ready(padded_fn(model.graphdef, model.params, window, cache)),
                            repeats=repeats)
        packed_fn = jax.jit(forward_packed, static_argnums=(0, 5))
        for c in sorted({max(1, int(f * n)) for f in (capacities or (0.25, 0.5, 1, 2, 4, 8))}):
            # An even split of the budget over the rows: what the packed pass costs does not depend on it.
            counts = 1 + jnp.minimum(c // n + (jnp.arange(n) < c % n), width - 1).astype(jnp.int32)
            packed_s, _ = timed(lambda: jax.block_until_ready(
                packed_fn(model.graphdef, model.params, window, counts, cache, n + c)), repeats=repeats)
            row = {"model": config.name, "batch": n, "capacity": c, "packed_tokens": n + c,
                   "padded_tokens": n * width, "packed_ms": 1e3 * packed_s, "padded_ms": 1e3 * padded_s,
                   "packed_over_padded": packed_s / padded_s, "token_ratio": (n + c) / (n * width)}
            rows.append(row)
            print(table([row]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", default=["tiny", "packed", "qwen"], choices=["tiny", "qwen", "packed"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--qwen-new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--qwen-ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--extras", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--packed-model", default="smollm2-135m")
    parser.add_argument("--packed-batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="bench_tetris")
    add_out_argument(parser)
    args = parser.parse_args()
    results = {}
    start = time.perf_counter()
    if "tiny" in args.part:
        results["tiny"] = tiny_part(args)
    if "packed" in args.part:
        results["packed"] = packed_part(args)
    if "qwen" in args.part:
        results["qwen"] = qwen_part(args)
    m = machine()
    md = [f"Greedy, {args.new_tokens} new tokens per request ({args.qwen_new_tokens} for Qwen), TETRIS budget "
          f"C = N * k (standard speculative decoding's). Machine: {m['processor']}, {m['cpu_count']} cores, "
          f"{m['device_kind']}, jax {m['jax']}. "
          f"Gains are against standard selection with the same k and batch. Total time "
          f"{time.perf_counter() - start:.0f} s."]
    for part in ("tiny", "qwen"):
        if part in results:
            md += [f"\n### {part}\n", table(results[part], GRID_COLUMNS)]
    if "packed" in results:
        md += ["\n### packed vs padded verification\n", table(results["packed"])]
    md = "\n".join(md)
    print("\n" + md)
    write_results(out_dir(args) / args.name, {"args": vars(args), **results}, md)


if __name__ == "__main__":
    main()
