"""`make demo`: generate with SmolLM2-135M-Instruct (installed by `make .venv`) and report speed.

    python scripts/demo.py [--max-new-tokens 48] [--temperature 0] [PROMPT ...]
"""

from __future__ import annotations

import argparse
import time

import jaxspec
from jaxspec.models.loading import smollm2_gguf_path

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a neural network is.",
    "Give three tips for writing clean Python code.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="*", default=DEFAULT_PROMPTS)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    start = time.perf_counter()
    model = jaxspec.load(smollm2_gguf_path())
    print(f"loaded {model} in {time.perf_counter() - start:.1f}s")
    tok = model.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in args.prompts]
    sampling = jaxspec.SamplingConfig(temperature=args.temperature)
    kwargs = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, eos_token_id=tok.eos_token_id)
    jaxspec.generate(model, chats, **kwargs)  # compile once, so the timing below is steady state
    result = jaxspec.generate(model, chats, **kwargs)
    for prompt, text in zip(args.prompts, result.texts):
        print(f"\n> {prompt}\n{text.replace(tok.eos_token, '').strip()}")
    s = result.stats
    print(f"\nautoregressive, batch {len(chats)}: {s.new_tokens} tokens in {s.seconds:.2f}s "
          f"= {s.tokens_per_second:.1f} tokens/s")


if __name__ == "__main__":
    main()
