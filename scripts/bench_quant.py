"""Weight types on CPU: bfloat16 and int8 (weight-only, per-channel) against float32, for quality
and speed, on real weights.

Quality against the float32 model: relative L2 error of the logits over a 128-token text, greedy
agreement over 128 new tokens (the share of prompts whose whole continuation is identical, and the
mean number of tokens before the first difference), and the acceptance the model gets as a draft of
the float32 target (k = 3, greedy). Speed: plain decoding tokens/s at batch 1 and 8, each weight
type against float32 round-robin, medians of ratios within a round. One weight type besides the
float32 model is loaded at a time.

    python scripts/bench_quant.py [--pair smollm2|qwen] [--new-tokens 128] [--rounds 3]
        [--weights bfloat16 int8 int8/bf16]
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import jax
import numpy as np
from checkout import QWEN, add_out_argument, out_dir

import jaxspec
from jaxspec.tools.benchmarking import machine, round_robin, table, write_results

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a bicycle stays upright while it is moving.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "List three reasons why the sky appears blue during the day.",
           "What are the main differences between a list and a tuple in Python?",
           "Describe the water cycle to a ten-year-old child in simple words.",
           "import numpy as np\n\ndef normalize(x):\n",
           "Summarise the plot of Romeo and Juliet in a few sentences, please."]
TEXT = ("The history of the bicycle begins in the early nineteenth century, when inventors in Europe "
        "built two-wheeled machines that riders pushed along with their feet. Over the following decades "
        "pedals, chains and pneumatic tyres turned the toy into a practical vehicle, and by 1900 millions "
        "of people rode to work, to school and into the countryside. ")


WEIGHTS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantize": "int8"},
           "int8/bf16": {"dtype": "bfloat16", "quantize": "int8"}}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def release() -> None:
    """Frees a weight type's arrays and programs before the next one loads (a 1.5B model in
    float32 is 7 GB, and XLA:CPU holds a float32 copy of bfloat16 weights while it runs them)."""
    gc.collect()
    jax.clear_caches()


def quality(path: str, ref, prompts, new_tokens: int, names) -> list[dict]:
    """Each weight type against the float32 model `ref`, loaded one at a time."""
    ids = ref.tokenizer(TEXT * 4)["input_ids"][:128]
    want = np.asarray(ref.logits([ids]))[0]
    greedy_ref = jaxspec.generate(ref, prompts, max_new_tokens=new_tokens).tokens
    rows = []
    for name in names:
        model = jaxspec.load(path, **WEIGHTS[name])
        got = np.asarray(model.logits([ids]))[0]
        greedy = jaxspec.generate(model, prompts, max_new_tokens=new_tokens).tokens
        spec = jaxspec.SpeculativeDecoder(ref, model, spec=jaxspec.SpecConfig(k=3))
        res = spec.generate(prompts, max_new_tokens=new_tokens)
        pairs = list(zip(greedy, greedy_ref))
        rows.append({"weights": name, "logit_rel_l2": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
                     "top1_agree": float(np.mean(got.argmax(-1) == want.argmax(-1))),
                     "same_continuations": f"{sum(g == r for g, r in pairs)}/{len(prompts)}",
                     "tokens_to_first_diff": float(np.mean([first_difference(g, r) for g, r in pairs])),
                     "acceptance_as_draft": float(res.stats.acceptance_rate),
                     "spec_output_lossless": res.tokens == greedy_ref})
        print(table(rows[-1:]), flush=True)
        del model, spec
        release()
    return rows


def speed(path: str, ref, prompts, new_tokens: int, batches, rounds: int, names) -> list[dict]:
    """Each weight type against float32, timed round-robin in pairs (one type loaded at a time)."""
    rows = []
    for name in names:
        model = jaxspec.load(path, **WEIGHTS[name])
        for batch in batches:
            chunk = prompts[:batch]
            fns = {label: (lambda on_finish, m=m: jaxspec.generate(m, chunk, max_new_tokens=new_tokens))
                   for label, m in (("float32", ref), (name, model))}
            _, seconds, _ = round_robin(fns, rounds)
            rows.append({"batch": batch, "weights": name,
                         "float32_tok_s": batch * new_tokens / float(np.median(seconds["float32"])),
                         "tok_s": batch * new_tokens / float(np.median(seconds[name])),
                         "vs_float32": float(np.median(seconds["float32"] / seconds[name]))})
            print(table(rows[-1:]), flush=True)
        del model, fns
        release()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", choices=["smollm2", "qwen"], default="smollm2")
    p.add_argument("--model", help="a model path instead of the pair's target")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--speed-tokens", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--weights", nargs="+", default=list(WEIGHTS)[1:], choices=list(WEIGHTS)[1:])
    p.add_argument("--name", default=None)
    add_out_argument(p)
    args = p.parse_args()
    path = args.model or (jaxspec.example_model("smollm2-135m") if args.pair == "smollm2"
                          else str(QWEN))
    ref = jaxspec.load(path)
    tok = ref.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in PROMPTS]
    q_rows = quality(path, ref, prompts, args.new_tokens, args.weights)
    s_rows = speed(path, ref, prompts, args.speed_tokens, args.batches, args.rounds, args.weights)
    m = machine()
    md = "\n".join([
        f"{Path(path).name}: bfloat16 and int8 weights (weight-only, one scale per output channel; `int8/bf16`: int8 "
        f"weights with bfloat16 compute) against float32, on {len(prompts)} chat prompts. Quality: logits over a "
        f"128-token text (relative L2 error, top-1 agreement), greedy continuations of {args.new_tokens} tokens "
        f"against float32's, and the acceptance of each model as the draft of the float32 target (k = 3, greedy; "
        f"the output is the float32 target's, checked). Speed: plain decoding, {args.speed_tokens} new tokens, "
        f"each type against float32 in {args.rounds} round-robin rounds after warm-up "
        f"(medians). Machine: {m['processor']}, {m['cpu_count']} "
        f"cores, jax {m['jax']}.", "", table(q_rows), "", table(s_rows)])
    print("\n" + md)
    write_results(out_dir(args) / (args.name or f"bench_quant_{args.pair}"),
                  {"args": vars(args), "quality": q_rows, "speed": s_rows}, md)


if __name__ == "__main__":
    main()
