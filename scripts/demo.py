"""`make demo`: a batch job on SmolLM2-135M-Instruct, decoded plainly and with suffix decoding.

The job asks for a docstring on each of the small Python functions of data/jobs/code_edit.jsonl
("change nothing else, return the whole function"), one request at a time (`--batch`), greedy,
stopping at the end of the turn. The suffix drafter (`jaxspec.SuffixDrafter`) has no model and no
training: it drafts from each request's own prompt (the function the answer restates) and from
the requests the job finished earlier (its corpus, which starts empty). The demo checks that both
runs give the same tokens and prints their decoding speed (compilation is timed apart,
`stats.compile_seconds`). On a 2-core CPU a step that verifies k + 1 tokens costs 2-3 plain steps
(few-row matrix products; docs/results/bench_suffix.md), which is what the drafts must beat.

    python scripts/demo.py [--requests 16] [--batch 1] [--max-new-tokens 160] [--k 8]
"""

from __future__ import annotations

import argparse
import time

from checkout import DATA

import jaxspec
from jaxspec.cli.jobs import read_jobs
from jaxspec.cli.tools import chat_prompt

INSTRUCTION = ("Add a one-line docstring to this function. Change nothing else. Return the whole function in a "
               "Python code block.\n\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1, help="requests decoded at once")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=8, help="most draft tokens per row and step")
    args = parser.parse_args()

    start = time.perf_counter()
    model = jaxspec.load(jaxspec.example_model("smollm2-135m"))
    print(f"loaded {model} in {time.perf_counter() - start:.1f} s")
    jobs = read_jobs(DATA / "jobs" / "code_edit.jsonl")[:args.requests]
    prompts = [chat_prompt(model.tokenizer, INSTRUCTION + job.prompt.split("\n\n", 1)[1]) for job in jobs]
    job = dict(max_new_tokens=args.max_new_tokens, eos_token_id=model.tokenizer.eos_token_id,
               batch_size=args.batch)
    runs = {"plain": jaxspec.SpeculativeDecoder(model, jaxspec.Drafter(), spec=jaxspec.SpecConfig(k=0)),
            "suffix": jaxspec.SpeculativeDecoder(model, jaxspec.SuffixDrafter(), spec=jaxspec.SpecConfig(k=args.k))}
    results = {}
    for name, decoder in runs.items():
        results[name] = decoder.generate(prompts, **job)
        s = results[name].stats
        print(f"{name:>6}: {s.new_tokens} tokens, compiled in {s.compile_seconds:.1f} s, decoded in {s.seconds:.1f} s")

    plain, suffix = results["plain"], results["suffix"]
    print(f"\nrequest {jobs[-1].id}:\n{suffix.texts[-1].strip()}")
    p, s = plain.stats, suffix.stats
    print(f"\n{len(prompts)} requests, batch {args.batch}, greedy; same tokens as plain decoding: "
          f"{suffix.tokens == plain.tokens}")
    print(f"plain decoding:       {p.tokens_per_second:6.1f} tokens/s")
    speedup = s.tokens_per_second / p.tokens_per_second
    print(f"suffix decoding k={args.k}: {s.tokens_per_second:6.1f} tokens/s ({speedup:.2f}x), "
          f"acceptance {s.acceptance_rate:.2f}, {s.mean_accepted_length:.2f} tokens per target pass")


if __name__ == "__main__":
    main()
