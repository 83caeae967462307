"""The `jaxspec` command line: thin front ends over the library.

    jaxspec profile --target PATH --draft PATH --output cost.json

A model argument is a path (GGUF file, HF folder, jaxspec checkpoint) or `preset:NAME` for random
weights at a preset's shape (`preset:qwen2.5-1.5b`): timings depend on shapes, not on weights.
"""

from __future__ import annotations

import argparse
import sys

import jax

import jaxspec
from jaxspec.benchmarking import table
from jaxspec.cost import COEFFICIENTS, CostModel


def load_model(spec: str, dtype: str, *, seed: int = 0) -> jaxspec.Model:
    """A model from a path or `preset:NAME` (random weights)."""
    if spec.startswith("preset:"):
        config = jaxspec.ModelConfig.preset(spec.split(":", 1)[1])
        return jaxspec.Model.random(config, seed=seed, dtype=dtype)
    return jaxspec.load(spec, dtype=dtype)


def _ints(text: str, low: int = 1) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < low:
        kind = "positive" if low == 1 else f">= {low}"
        raise argparse.ArgumentTypeError(f"expected {kind} integers, got {text!r}")
    return values


def _draft_lengths(text: str) -> tuple[int, ...]:
    return _ints(text, low=0)


def profile(args) -> int:
    target = load_model(args.target, args.dtype)
    draft = None if args.draft in ("none", "ngram") else load_model(args.draft, args.dtype, seed=1)
    print(f"profiling {target.config.name} (target) and {draft.config.name if draft else 'no draft model'} "
          f"on {jax.devices()[0].device_kind} ...", flush=True)
    cost = CostModel.profile(target, draft, batches=args.batches, ks=args.ks,
                             cache_lens=args.cache_lens, repeats=args.repeats)
    cost.save(args.output)
    rows = [{"part": part, **{k: v for k, v in fit.items() if k != "points_seconds"}}
            for part, fit in cost.fit.items() if fit]
    coefficients = [{"coefficient": name, "seconds": getattr(cost, name)} for name in COEFFICIENTS]
    print(table(coefficients))
    print(table(rows))
    print(f"wrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxspec", description="Batch speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="time speculative steps on this device and fit a cost model",
                       description="Times the speculative decode step over batch sizes, draft lengths and cache "
                                   "sizes (inside a compiled loop), fits the linear latency models of the draft "
                                   "and the target verification and writes them as JSON for "
                                   "SpecConfig(policy='goodput', cost_model=CostModel.load(...)).")
    p.add_argument("--target", required=True, help="path, or preset:NAME for random weights")
    p.add_argument("--draft", default="none", help="path, preset:NAME, or none/ngram (no draft model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", type=_ints, default=(1, 2, 4, 8, 16), help="comma-separated batch sizes")
    p.add_argument("--ks", type=_draft_lengths, default=(0, 1, 2, 4), help="draft lengths timed (must include 0)")
    p.add_argument("--cache-lens", type=_ints, default=(128, 512), help="cache sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default="cost_model.json")
    p.set_defaults(run=profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
