"""Greedy speculative output against the autoregressive loop's, in float32 and in bfloat16.

Speculative decoding is lossless in exact arithmetic: a verification pass scores the same tokens
the autoregressive loop would. In bfloat16 the two compute each position in a different shape (a
window of k + 1 tokens per row against one), so rounding differs, and where the target's top two
logits are closer than that rounding, the two runs can pick different tokens and part from there.
This script measures how often that happens on the qwen2.5-shape benchmark pair (random weights,
`benchmarking.skeleton_pair`, whose top logits over 151,936 tokens are close), and, for the first
differing row, shows the target's own logits of both tokens (an uncached forward over the
autoregressive prefix). Writes docs/results/greedy_precision.{json,md}.

    python scripts/greedy_precision.py [--dtypes float32 bfloat16] [--batch 64] [--new-tokens 32] [--k 1]
"""

from __future__ import annotations

import argparse
import time

import jaxspec
from jaxspec.benchmarking import PAIRS, build_pair, divergence, machine, prompt_sets, table, write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="qwen2.5-shape", choices=sorted(PAIRS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes:
        target, draft, _ = build_pair(args.pair, dtype)
        prompts = prompt_sets(target.config.vocab_size, args.batch, 1)[0]
        start = time.perf_counter()
        reference = jaxspec.generate(target, prompts, max_new_tokens=args.new_tokens).tokens
        result = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=args.k)).generate(
            prompts, max_new_tokens=args.new_tokens)
        rows.append({"dtype": dtype, "batch": args.batch, "k": args.k, "new_tokens": args.new_tokens,
                     "acceptance": result.stats.acceptance_rate,
                     "rows_differing": sum(r != t for r, t in zip(reference, result.tokens)),
                     "same_output": divergence(target, prompts, reference, result.tokens),
                     "seconds": time.perf_counter() - start})
        print(table(rows[-1:]), flush=True)
        del target, draft
    md = "\n".join([f"Pair `{args.pair}` (random weights, `benchmarking.PAIRS`), batch {args.batch}, "
                    f"fixed k = {args.k} against the autoregressive loop, {args.new_tokens} new tokens, greedy; "
                    f"`scripts/greedy_precision.py` on {machine()['device_kind']}. `same_output`: True, or where the "
                    "first differing row parts from the autoregressive loop's output, with the target's logits of "
                    "both tokens there (an uncached forward).",
                    "", table(rows)])
    print("\n" + md)
    write_results("greedy_precision", {"args": vars(args), "rows": rows}, md)


if __name__ == "__main__":
    main()
