"""Speculative decoding speed on CPU: the Qwen2.5-Coder pair and SmolLM2 with n-gram lookup.

Qwen part (needs `make models-qwen`): 1.5B target, 0.5B draft, greedy, the code prompts in
data/code_prompts.jsonl, batch 1 and 4: jaxspec autoregressive, jaxspec speculative k = 1..6, and
transformers' assisted generation (assistant_model=, batch 1: transformers supports no larger) on
the same GGUF files and prompts. Sonnet part: SmolLM2-135M-Instruct with NgramDrafter, asked to
repeat lines of Sonnet 18 (the TETRIS paper's sonnet task). Every configuration is warmed up (same
compiled shapes), then timed once; outputs are checked identical to autoregressive decoding.
Prints tables and writes docs/results/bench_speculative.{json,md}.

    python scripts/bench_speculative.py [--part qwen sonnet] [--new-tokens 128] [--ks 1 2 3 4 5 6]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import jaxspec
from jaxspec.benchmarking import machine, table, write_results
from jaxspec.models.loading import smollm2_gguf_path

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT = REPO / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def timed_run(fn, warm):
    warm()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def jaxspec_rows(label, target, draft, prompts, batches, ks, new_tokens):
    """AR and speculative rows for each batch size; returns rows and the AR outputs."""
    rows, reference = [], {}
    for batch in batches:
        ids = prompts[:batch]
        half = new_tokens // 2 + 1  # same compiled program (output bucket), half the warm-up work
        seconds, ar = timed_run(lambda: jaxspec.generate(target, ids, max_new_tokens=new_tokens),
                                lambda: jaxspec.generate(target, ids, max_new_tokens=half))
        reference[batch] = ar.tokens
        total = sum(map(len, ar.tokens))
        base = total / seconds
        rows.append({"task": label, "batch": batch, "method": "jaxspec autoregressive", "k": 0,
                     "tok_s": base, "speedup": 1.0, "acceptance": None, "mean_accepted": 1.0,
                     "same_output": True})
        print(table(rows[-1:]), flush=True)
        for k in ks:
            dec = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=k))
            seconds, res = timed_run(lambda: dec.generate(ids, max_new_tokens=new_tokens),
                                     lambda: dec.generate(ids, max_new_tokens=half))
            tok_s = sum(map(len, res.tokens)) / seconds
            rows.append({"task": label, "batch": batch, "method": "jaxspec speculative", "k": k,
                         "tok_s": tok_s, "speedup": tok_s / base,
                         "acceptance": res.stats.acceptance_rate,
                         "mean_accepted": res.stats.mean_accepted_length,
                         "same_output": res.tokens == ar.tokens})
            print(table(rows[-1:]), flush=True)
    return rows, reference


def transformers_rows(label, prompts, new_tokens, reference, jax_ar_tok_s):
    import torch
    from transformers import AutoModelForCausalLM

    def load(path):
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        model.generation_config.eos_token_id = None  # both sides emit exactly new_tokens tokens
        return model.eval()

    target, draft = load(TARGET), load(DRAFT)
    rows = []
    ids = torch.tensor([prompts[0]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for method, kwargs in (("transformers autoregressive", {}),
                               ("transformers assisted", {"assistant_model": draft})):
            run = lambda: target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,  # noqa: E731
                                          do_sample=False, pad_token_id=0, **kwargs)
            seconds, out = timed_run(run, lambda: target.generate(ids, attention_mask=mask, max_new_tokens=8,
                                                                  do_sample=False, pad_token_id=0, **kwargs))
            tokens = out[0, len(prompts[0]):].tolist()
            tok_s = len(tokens) / seconds
            rows.append({"task": label, "batch": 1, "method": method, "k": None, "tok_s": tok_s,
                         "speedup": tok_s / jax_ar_tok_s, "acceptance": None, "mean_accepted": None,
                         "same_output": tokens == reference[1][0]})
            print(table(rows[-1:]), flush=True)
    return rows


def qwen_part(args):
    for path in (TARGET, DRAFT):
        if not path.exists():
            raise SystemExit(f"{path} is missing: run `make models-qwen`")
    start = time.perf_counter()
    target, draft = jaxspec.load(TARGET), jaxspec.load(DRAFT)
    print(f"loaded the Qwen pair in {time.perf_counter() - start:.0f}s", flush=True)
    lines = [json.loads(line) for line in (REPO / "data" / "code_prompts.jsonl").read_text().splitlines()]
    prompts = [target.tokenizer(line["prompt"])["input_ids"] for line in lines]
    rows, reference = jaxspec_rows("qwen-coder 1.5B <- 0.5B, code", target, draft, prompts, args.batches,
                                   args.ks, args.new_tokens)
    ar_b1 = next(r["tok_s"] for r in rows if r["batch"] == 1 and r["k"] == 0)
    del target, draft
    gc.collect()
    if not args.skip_transformers:
        rows += transformers_rows("qwen-coder 1.5B <- 0.5B, code", prompts, args.new_tokens, reference, ar_b1)
    return rows


def sonnet_part(args):
    model = jaxspec.load(smollm2_gguf_path())
    sonnet = (REPO / "data" / "sonnet18.txt").read_text().strip().splitlines()
    prompts = []
    for first in range(0, 8):
        ask = (f"Here is a sonnet:\n{chr(10).join(sonnet)}\n\nRepeat lines {first + 1} to {first + 6} "
               f"of the sonnet exactly, one per line.")
        chat = model.tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                                   add_generation_prompt=True)
        prompts.append(model.tokenizer(chat)["input_ids"])
    rows, _ = jaxspec_rows("smollm2-135m + n-gram, sonnet", model, jaxspec.NgramDrafter(max_ngram=3),
                           prompts, args.batches, args.ks, args.new_tokens)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", default=["qwen", "sonnet"], choices=["qwen", "sonnet"])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--name", default="bench_speculative")
    args = parser.parse_args()
    rows = []
    if "sonnet" in args.part:
        rows += sonnet_part(args)
    if "qwen" in args.part:
        rows += qwen_part(args)
    m = machine()
    md = (f"Greedy, {args.new_tokens} new tokens, float32 weights dequantised from the GGUF files; each "
          f"configuration warmed up, then timed once. Machine: {m['processor']}, {m['cpu_count']} cores, "
          f"{m['device_kind']}, jax {m['jax']}. `speedup` is against jaxspec autoregressive at the same "
          f"batch (transformers rows: against jaxspec autoregressive at batch 1).\n\n" + table(rows))
    print("\n" + md)
    write_results(args.name, {"new_tokens": args.new_tokens, "rows": rows}, md)


if __name__ == "__main__":
    main()
