"""Autoregressive generation: the baseline every speculative path must reproduce exactly.

Shape key: b batch rows, p padded prompt length, o output buffer length, v vocabulary.

The whole call is one compiled program: a ragged prefill (each row's logits taken at its own last
prompt token), then a `lax.while_loop` that feeds each row its last token, samples the next and
stops a row at eos or at its budget. The host reads results once, at the end.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import prompts as prompts_lib
from jaxspec.models.model import Model, forward, init_cache
from jaxspec.results import GenerationResult, GenerationStats, decode_texts
from jaxspec.sampling import SamplingConfig, choose, row_keys

NO_EOS = -1


def prefill(graphdef, params, tokens_bp, prompt_len_b, max_new_b, request_keys_b, eos_id,
            sampling: SamplingConfig, cache_len: int, features=()):
    """Ragged prefill and the first token, shared by every engine.

    Returns the cache (committed to the prompt lengths), the first token of each row, the count
    of tokens emitted (1, or 0 for padding rows), the done flags, and the prompt's features
    ([b, p, f] of the `features` layers, for an EAGLE drafter; None when no layers are asked).
    """
    cache = init_cache(graphdef, params, tokens_bp.shape[0], cache_len)
    out = forward(graphdef, params, tokens_bp, cache, (prompt_len_b - 1)[:, None], empty=True, features=features)
    (logits_b1v, cache), features_bpf = out[:2], (out[2] if features else None)
    cache = cache.commit(prompt_len_b)
    live_b = max_new_b > 0
    first_b = choose(row_keys(request_keys_b, jnp.zeros_like(prompt_len_b)), logits_b1v[:, 0], sampling)
    n_out_b = live_b.astype(jnp.int32)
    done_b = ~live_b | (first_b == eos_id) | (n_out_b >= max_new_b)
    return cache, first_b, n_out_b, done_b, features_bpf


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "cache_len", "out_len"))
def _generate_on_device(graphdef, params, tokens_bp, prompt_len_b, max_new_b, request_keys_b, eos_id,
                        *, sampling: SamplingConfig, cache_len: int, out_len: int):
    b = tokens_bp.shape[0]
    rows = jnp.arange(b)
    cache, first_b, n_out_b, done_b, _ = prefill(graphdef, params, tokens_bp, prompt_len_b, max_new_b,
                                              request_keys_b, eos_id, sampling, cache_len)
    out_bo = jnp.zeros((b, out_len), jnp.int32).at[:, 0].set(first_b)

    def cond(state):
        return ~jnp.all(state[4])

    def body(state):
        cache, last_b, out_bo, n_out_b, done_b, steps = state
        logits_b1v, cache = forward(graphdef, params, last_b[:, None], cache)
        # Finished rows keep computing (static shapes) but commit and emit nothing.
        cache = cache.commit(cache.lengths + (~done_b).astype(jnp.int32))
        token_b = choose(row_keys(request_keys_b, n_out_b), logits_b1v[:, 0], sampling)
        write_at_b = jnp.where(done_b, out_len, n_out_b)  # out_len is out of bounds: dropped
        out_bo = out_bo.at[rows, write_at_b].set(token_b, mode="drop")
        n_out_b = n_out_b + (~done_b).astype(jnp.int32)
        done_b = done_b | (token_b == eos_id) | (n_out_b >= max_new_b)
        last_b = jnp.where(done_b, last_b, token_b)
        return cache, last_b, out_bo, n_out_b, done_b, steps + 1

    state = (cache, first_b, out_bo, n_out_b, done_b, jnp.int32(0))
    _, _, out_bo, n_out_b, _, steps = jax.lax.while_loop(cond, body, state)
    return out_bo, n_out_b, steps


def generate(model: Model, prompts, max_new_tokens=64, sampling: SamplingConfig | None = None,
             seed: int = 0, eos_token_id: int | None = None, request_ids=None) -> GenerationResult:
    """Autoregressive generation for a batch of prompts of different lengths.

    Args:
      model: the jaxspec.Model to sample from.
      prompts: a list of token-id lists, or of strings when the model has a tokenizer.
      max_new_tokens: the most new tokens per prompt (an int, or one per prompt), >= 1.
      sampling: SamplingConfig; default greedy.
      seed: RNG seed; request i's j-th token uses fold_in(fold_in(key(seed), i), j), so the output
        of a request does not depend on what else is in the batch.
      eos_token_id: a row stops after emitting this token (kept in its output); None: never.
      request_ids: distinct ints naming each prompt's RNG stream in place of its index i, so a
        request samples the same tokens whatever list it is passed in (a resumed batch job).

    Returns:
      GenerationResult with the new tokens of each prompt in prompt order.
    """
    sampling = sampling if sampling is not None else SamplingConfig()
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a jaxspec.SamplingConfig, got {type(sampling).__name__}")
    cfg = model.config
    eos = check_eos(eos_token_id, cfg.vocab_size)
    batch = prompts_lib.prepare(prompts, model.tokenizer, vocab_size=cfg.vocab_size,
                                max_positions=cfg.max_position_embeddings,
                                max_new_tokens=max_new_tokens, request_ids=request_ids)
    keys = request_keys(seed, batch.request_ids_b)
    cache_len = batch.tokens_bp.shape[1] + batch.out_len
    start = time.perf_counter()
    out_bo, n_out_b, steps = _generate_on_device(
        model.graphdef, model.params, batch.tokens_bp, batch.lengths_b, batch.max_new_b, keys, np.int32(eos),
        sampling=sampling,
        cache_len=cache_len, out_len=batch.out_len)
    out_bo, n_out_b, steps = jax.device_get((out_bo, n_out_b, steps))
    seconds = time.perf_counter() - start
    tokens = [out_bo[i, :n_out_b[i]].tolist() for i in range(batch.num_prompts)]
    new_tokens = int(sum(len(t) for t in tokens))
    stats = GenerationStats(
        new_tokens=new_tokens, steps=int(steps), seconds=seconds,
        tokens_per_second=new_tokens / seconds if seconds > 0 else 0.0,
        per_request_new_tokens=[len(t) for t in tokens], target_forwards=int(steps) + 1,
        mean_accepted_length=1.0)
    return GenerationResult(tokens=tokens, texts=decode_texts(model.tokenizer, tokens), stats=stats)


def request_keys(seed: int, request_ids_b: np.ndarray) -> jax.Array:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return _fold_keys(_base_key(int(seed)), np.asarray(request_ids_b))


@functools.lru_cache(maxsize=64)
def _base_key(seed: int) -> jax.Array:
    # Made once per seed: building a key eagerly cost about 0.3 ms of host time per call on
    # XLA:CPU, before the device had anything to do (5% of a 96-token call at batch 1 is 3 ms).
    return jax.random.key(seed)


def clear_keys() -> None:
    """Forgets the keys of seeds seen (`jaxspec.clear_caches`)."""
    _base_key.cache_clear()


@jax.jit
def _fold_keys(base, request_ids_b):
    # Compiled: folding in eagerly, op by op, cost 5 ms of host time per call.
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(request_ids_b)


def check_eos(eos_token_id, vocab_size: int) -> int:
    if eos_token_id is None:
        return NO_EOS
    if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, (int, np.integer)) \
            or not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"eos_token_id must be None or an int in [0, {vocab_size}), got {eos_token_id!r}")
    return int(eos_token_id)
