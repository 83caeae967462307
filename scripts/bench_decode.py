"""Autoregressive decode speed: jaxspec vs transformers (torch, CPU) on SmolLM2-135M.

Same GGUF weights, same prompts (cut to one length so neither side pads), greedy, batch 1 and 8;
each configuration warmed up once, then timed as the median of repeats in this one run; outputs
are checked token for token. Prints a table and writes docs/results/bench_decode.{json,md} (or into
--out DIR).

    python scripts/bench_decode.py [--new-tokens 64] [--prompt-len 32] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import os

import torch
from checkout import add_out_argument, out_dir
from transformers import AutoModelForCausalLM

import jaxspec
from jaxspec.tools.benchmarking import machine, table, timed, write_results

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright while it is moving.",
    "List three reasons why the sky appears blue during the day.",
    "Describe the water cycle to a ten-year-old child in simple words.",
    "What are the main differences between a list and a tuple in Python?",
    "Give me a recipe for a quick vegetarian dinner with rice and beans.",
    "Summarise the plot of Romeo and Juliet in a few sentences, please.",
    "How do vaccines train the immune system to recognise a virus?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="bench_decode")
    add_out_argument(parser)
    args = parser.parse_args()
    path = jaxspec.example_model("smollm2-135m")
    ours = jaxspec.load(path)
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                               dtype=torch.float32).eval()
    # Neither side stops at eos: both must emit exactly --new-tokens tokens.
    ref.generation_config.eos_token_id = None
    ids = [ours.tokenizer(p)["input_ids"][:args.prompt_len] for p in PROMPTS]
    assert all(len(i) == args.prompt_len for i in ids), "prompts shorter than --prompt-len"

    rows = []
    for batch in args.batches:
        prompts = [ids[i % len(ids)] for i in range(batch)]

        def run_ours():
            return jaxspec.generate(ours, prompts, max_new_tokens=args.new_tokens)

        def run_ref():
            with torch.no_grad():
                x = torch.tensor(prompts)
                out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens,
                                   do_sample=False, pad_token_id=0)
            return out[:, args.prompt_len:].tolist()

        t_ours, res = timed(run_ours, repeats=args.repeats)
        t_ref, ref_tokens = timed(run_ref, repeats=args.repeats)
        same = res.tokens == ref_tokens
        total = batch * args.new_tokens
        rows.append({"batch": batch, "new_tokens": args.new_tokens,
                     "jaxspec_tok_s": total / t_ours, "transformers_tok_s": total / t_ref,
                     "speedup": t_ref / t_ours, "same_output": same})
        print(table(rows[-1:]), flush=True)

    md = (f"SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32), greedy, prompt {args.prompt_len} "
          f"tokens, {args.new_tokens} new tokens; median of {args.repeats} after warm-up.\n"
          f"Machine: {machine()['processor']}, {machine()['cpu_count']} cores, torch "
          f"{torch.__version__} with {torch.get_num_threads()} threads, jax {machine()['jax']}.\n\n"
          + table(rows))
    print("\n" + md)
    write_results(out_dir(args) / args.name, {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt_len": args.prompt_len,
                              "torch_threads": torch.get_num_threads(), "rows": rows}, md)
    if not all(r["same_output"] for r in rows):
        raise SystemExit("outputs differ between jaxspec and transformers")



if __name__ == "__main__":
    main()
