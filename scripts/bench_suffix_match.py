"""What suffix matching costs: `SuffixDrafter.propose` alone and inside a decode step, against a
SmolLM2-135M step (random weights) at batch 8, with a full corpus.

  python scripts/bench_suffix_match.py [--corpus 262144] [--batch 8] [--k 8] [--context 512]
"""

import argparse
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
    plain = timing.time_steps(target, jaxspec.NgramDrafter().bind_vocab(vocab), 0, args.batch, cache_len)
    suffix = timing.time_steps(target, drafter, args.k, args.batch, cache_len)
    ngram = timing.time_steps(target, jaxspec.NgramDrafter().bind_vocab(vocab), args.k, args.batch, cache_len)
    ms = 1e3 * float(np.median(times))
    print(f"corpus {args.corpus} tokens: {memory / 2**20:.1f} MiB on the device, index built in {build:.2f} s")
    print(f"propose alone, batch {args.batch}, k {args.k}, {args.context} context slots: {ms:.2f} ms")
    print(f"SmolLM2-135M plain step {1e3 * plain:.1f} ms; step with k={args.k}: n-gram {1e3 * ngram:.1f} ms, "
          f"suffix {1e3 * suffix:.1f} ms")
    print(f"propose / plain step: {ms / 1e3 / plain:.1%}; suffix - n-gram step: {(suffix - ngram) / plain:.1%} "
          "of a plain step")


if __name__ == "__main__":
    main()
