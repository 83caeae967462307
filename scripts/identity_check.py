"""Greedy identity on an accelerator: is a speculative output that differs from autoregressive
decoding a bug or the batch's arithmetic? For the device check's skeleton pair (near-tied logits
by design) in bfloat16 and float32 at batch 16: rows where autoregressive decoding at batch 16
differs from each row decoded alone, and where speculative decoding (k = 4) differs from either.

    python scripts/identity_check.py [--cpu-smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jaxspec
from jaxspec.tools.benchmarking import prompt_sets, skeleton_pair


def differing(a, b) -> list:
    """(row, first differing position) for each row where the two outputs differ."""
    return [(i, next((j for j, (x, y) in enumerate(zip(r, s)) if x != y), min(len(r), len(s))))
            for i, (r, s) in enumerate(zip(a, b)) if r != s]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", default="/tmp")
    args = p.parse_args()
    if args.cpu_smoke:
        tiny = jaxspec.ModelConfig.preset("tiny")
        shapes, batch, new = (tiny, tiny.replace(num_layers=1)), 4, 16
    else:
        shapes = (jaxspec.ModelConfig.preset("qwen2.5-1.5b"), jaxspec.ModelConfig.preset("qwen2.5-0.5b"))
        batch, new = 16, 64
    report = {}
    for dtype in ("bfloat16", "float32"):
        began = time.time()
        target, draft = skeleton_pair(*shapes, damping=7e-4, sharpness=6.0, dtype=dtype)
        prompts = prompt_sets(shapes[0].vocab_size, batch, 1)[0]
        batched = jaxspec.generate(target, prompts, max_new_tokens=new).tokens
        alone = [jaxspec.generate(target, [p], max_new_tokens=new).tokens[0] for p in prompts]
        spec = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=4)).generate(
            prompts, max_new_tokens=new).tokens
        report[dtype] = {"batched_vs_alone": differing(batched, alone), "spec_vs_batched": differing(spec, batched),
                         "spec_vs_alone": differing(spec, alone), "seconds": round(time.time() - began, 1)}
        print(dtype, report[dtype], flush=True)
    Path(args.out, "identity_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
