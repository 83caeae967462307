"""What suffix matching costs: `SuffixDrafter.propose` alone and inside a decode step, against a
SmolLM2-135M step (random weights) at batch 8, with a full corpus.

  python scripts/bench_suffix_match.py [--corpus 262144] [--batch 8] [--k 8] [--context 512]

Writes docs/results/bench_suffix_match.{md,json}.
"""

import argparse
import json
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.engine import timing
from jaxspec.sampling import SamplingConfig


def corpus(rng, tokens: int, vocab: int):
    """Requests of 300 tokens that repeat phrases of a small phrase book, as batch jobs do."""
    book = rng.integers(0, vocab, (512, 12))
    requests, total = [], 0
    while total < tokens:
        requests.append(book[rng.integers(0, 512, 25)].reshape(-1))
        total += requests[-1].size + 1
    return requests


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=int, default=262144)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    target = jaxspec.Model.random(jaxspec.ModelConfig.preset("smollm2-135m"))
    vocab = target.config.vocab_size
    drafter = jaxspec.SuffixDrafter(corpus_tokens=args.corpus).bind_vocab(vocab)
    start = time.perf_counter()
    drafter.remember(corpus(rng, args.corpus, vocab))
    build = time.perf_counter() - start
    memory = sum(x.nbytes for x in jax.tree.leaves(drafter.params))
    seq = jnp.asarray(np.concatenate(corpus(rng, args.batch * args.context, vocab))[:args.batch * args.context]
                      .reshape(args.batch, args.context), jnp.int32)
    pending = jnp.full((args.batch,), args.context - 1, jnp.int32)
    propose = jax.jit(lambda p, s, n: drafter.propose(p, (), s, n, args.k, None, SamplingConfig())[0])
    jax.block_until_ready(propose(drafter.params, seq, pending))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(propose(drafter.params, seq, pending))
        times.append(time.perf_counter() - start)
    cache_len = timing.cache_len_for(args.context, args.k, 6)
    ngram = jaxspec.NgramDrafter().bind_vocab(vocab)
    rounds = {"plain": [], "ngram": [], "suffix": []}
    for _ in range(3):   # round-robin: this VM's speed drifts within minutes
        for name, drafter, k in (("plain", ngram, 0), ("ngram", ngram, args.k), ("suffix", drafter, args.k)):
            rounds[name].append(timing.time_steps(target, drafter, k, args.batch, cache_len))
    step = {name: float(np.median(t)) for name, t in rounds.items()}
    row = dict(corpus_tokens=args.corpus, corpus_mib=memory / 2**20, index_build_s=build, batch=args.batch, k=args.k,
               context=args.context, propose_ms=1e3 * float(np.median(times)),
               **{f"{name}_step_ms": 1e3 * t for name, t in step.items()})
    row["propose_vs_plain_step"] = row["propose_ms"] / row["plain_step_ms"]
    row["suffix_minus_ngram_vs_plain_step"] = (step["suffix"] - step["ngram"]) / step["plain"]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {jax.default_backend()}, jax {jax.__version__}"
    lines = ["SuffixDrafter matching against a SmolLM2-135M step (random weights, float32): `propose` alone "
             "(jitted, median of 20) and whole decode steps (plain; k drafts from n-gram lookup or the suffix "
             f"drafter), each timed in the engine's device loop, 3 round-robin rounds, medians. Machine: {machine}.",
             "", "| " + " | ".join(row) + " |", "|" + "---|" * len(row),
             "| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |"]
    print("\n".join(lines))
    out = pathlib.Path("docs/results/bench_suffix_match")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(dict(machine=machine, rows=[row]), indent=1) + "\n")


if __name__ == "__main__":
    main()
