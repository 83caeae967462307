"""Step anatomy of jaxspec's decode step (`jaxspec.tools.profiling`): kernels per step and their time by
category, the costliest kernels, and the step against reading its bytes at the device's measured
bandwidth; per weight type, batch and draft length (k = 0: plain decoding; k > 0: a verification
of k + 1 tokens per row, drafts from n-gram lookup, whose own cost is negligible).

    python scripts/step_profile.py [--preset qwen2.5-1.5b | --model PATH] [--dtypes float32 bfloat16]
        [--quantize none int8] [--batches 1 8 32] [--ks 0 3] [--context 256] [--name step_profile]
        [--deadline SECONDS] [--peer]

--peer (with --model FILE.gguf) adds transformers' step on the same weights, split the same way:
projections, attention over the cache, the cache write, the LM head, sampling, the rest.

Writes docs/results/<name>.{json,md} (or into --out DIR).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
from checkout import add_out_argument, out_dir

import jaxspec
from jaxspec.tools import profiling
from jaxspec.tools.benchmarking import machine, table, write_results


def build(args, dtype: str, quantize: str | None):
    if args.model:
        return jaxspec.load(args.model, dtype=dtype, quantize=quantize, tokenizer=False)
    model = jaxspec.Model.random(jaxspec.ModelConfig.preset(args.preset), seed=0, dtype=dtype)
    return model.quantize(quantize) if quantize else model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--model", help="a model path instead of a random preset")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--quantize", nargs="+", default=["none", "int8"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 3])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--name", default="step_profile")
    add_out_argument(p)
    p.add_argument("--deadline", type=float, default=None, help="seconds: start no configuration after this")
    p.add_argument("--peer", action="store_true",
                   help="also transformers' step on the same GGUF (--model), float32, at each batch and k")
    args = p.parse_args()
    if args.peer and not (args.model and args.model.endswith(".gguf")):
        p.error("--peer needs --model FILE.gguf (transformers loads the same file)")
    start = time.time()
    bandwidth = profiling.read_bandwidth()
    print({k: f"{v / 1e9:.1f} GB/s" for k, v in bandwidth.items()}, flush=True)
    results, rows, skipped = [], [], []
    for dtype in args.dtypes:
        for q in [None if q == "none" else q for q in args.quantize]:
            if args.deadline is not None and time.time() - start > args.deadline:
                skipped.append(f"{dtype}/{q or 'float'}")
                continue
            model = build(args, dtype, q)
            plain = {}
            for batch in args.batches:
                for k in args.ks:
                    r = profiling.profile_step(model, batch, args.context, k=k, steps=args.steps,
                                               bandwidth=max(bandwidth.values()))
                    plain.setdefault(batch, r["step_ms"] if k == 0 else None)
                    results.append(r)
                    rows.append(row(r, plain.get(batch)))
                    print(table(rows[-1:]), flush=True)
            del model
            jax.clear_caches()
    peers = peer_steps(args) if args.peer else []
    m = machine()
    what = Path(args.model).name if args.model else args.preset + " (random weights)"
    md = "\n".join([
        f"Decode step anatomy, {what}, context {args.context} tokens per "
        f"row; each step timed inside the engine's device loop (the median of loops of {args.steps} steps, minus a "
        f"1-step loop), kernels from a jax.profiler trace of such a loop. `floor_ms`: the bytes a step must read "
        f"(weights but the embedding table, plus the live KV cache) at the faster of the measured copy "
        f"({bandwidth['copy'] / 1e9:.1f} GB/s, read + write) and matrix-vector ({bandwidth['matvec'] / 1e9:.1f} GB/s) "
        f"rates; `bw_frac` = floor / step. `vs_k0`: the step against the plain step at the same batch (a "
        f"verification of k + 1 tokens against one). Machine: {m['processor']}, {m['cpu_count']} cores, "
        f"{m['device_kind']}, jax {m['jax']}."
        + (f" Not run (past the deadline): {', '.join(skipped)}." if skipped else ""), "", table(rows), "",
        "Costliest kernels per configuration:", "",
        table([{"weights": f"{r['dtype']}/{r['quantization'] or 'float'}", "batch": r["batch"], "k": r["k"], **t}
               for r in results for t in r["top_kernels"][:4]])])
    if peers:
        md += "\n\n" + "\n".join([
            "Where a step's time goes, jaxspec against transformers on the same weights (float32), in ms per step "
            "(jaxspec: kernel time from the trace by JAX source; transformers: operator self time under "
            "torch.profiler, `other` = the step's wall time less the parts). A verification of k + 1 tokens per row "
            f"is a forward of that width over the cache (transformers: {peers[0]['threads']} threads).", "",
            table([component_row("jaxspec", r) for r in results if r["dtype"] == "float32"
                   and not r["quantization"]] + [component_row("transformers", r) for r in peers])])
    write_results(out_dir(args) / args.name, {"args": vars(args), "bandwidth": bandwidth, "results": results,
                                              "transformers": peers, "skipped": skipped}, md)
    print("\n" + md)


def peer_steps(args) -> list[dict]:
    """transformers' step anatomy at each batch and k (`profiling.transformers_step_anatomy`)."""
    from jaxspec.tools.benchmarking import transformers_gguf

    model, out = transformers_gguf(args.model), []
    for batch in args.batches:
        for k in args.ks:
            out.append({**profiling.transformers_step_anatomy(model, batch, args.context, width=k + 1), "k": k})
            print(component_row("transformers", out[-1]), flush=True)
    return out


def component_row(engine: str, r: dict) -> dict:
    parts = r["by_component"]
    return {"engine": engine, "batch": r["batch"], "k": r["k"], "step_ms": round(r["step_ms"], 1),
            **{c: round(ms, 1) for c, ms in parts.items()},
            "matrices_share": round((parts["projections"] + parts["LM head"]) / max(sum(parts.values()), 1e-9), 2)}


def row(r: dict, plain_ms: float | None) -> dict:
    cats = r["by_category"]
    return {"weights": f"{r['dtype']}/{r['quantization'] or 'float'}", "batch": r["batch"], "k": r["k"],
            "step_ms": round(r["step_ms"], 3), "vs_k0": round(r["step_ms"] / plain_ms, 2) if plain_ms else None,
            "kernels": round(r["kernels_per_step"]), "kernel_ms": round(r["kernel_ms"], 3),
            "matmul_ms": round(cats.get("matmul", {}).get("ms", 0.0), 3),
            "floor_ms": round(r["floor_ms"], 3), "bw_frac": round(r["bandwidth_fraction"], 3),
            "top": f"{r['top_kernels'][0]['source'] or r['top_kernels'][0]['kernel']} "
                   f"{r['top_kernels'][0]['shape']}" if r["top_kernels"] else ""}


if __name__ == "__main__":
    main()
