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
from jaxspec.engine.plans import TARGET_ONLY, Program
from jaxspec.engine.step import Requests, prefill
from jaxspec.models.model import Model, forward
from jaxspec.results import GenerationResult, GenerationStats, decode_texts
from jaxspec.sampling import SamplingConfig, choose, request_keys, row_keys


@functools.partial(jax.jit, static_argnames=("program",))
def _generate_on_device(program: Program, params, requests: Requests):
    b, out_len = requests.tokens_bp.shape[0], program.out_len
    rows = jnp.arange(b)
    cache, first_b, n_out_b, done_b, _ = prefill(program.target, params, requests, program.sampling,
                                                 program.cache_len)
    out_bo = jnp.zeros((b, out_len), jnp.int32).at[:, 0].set(first_b)

    def body(state):
        cache, last_b, out_bo, n_out_b, done_b, steps = state
        logits_b1v, cache = forward(program.target, params, last_b[:, None], cache)
        # Finished rows keep computing (static shapes) but commit and emit nothing.
        cache = cache.commit(cache.lengths + (~done_b).astype(jnp.int32))
        token_b = choose(row_keys(requests.keys_b, n_out_b), logits_b1v[:, 0], program.sampling)
        write_at_b = jnp.where(done_b, out_len, n_out_b)  # out_len is out of bounds: dropped
        out_bo = out_bo.at[rows, write_at_b].set(token_b, mode="drop")
        n_out_b = n_out_b + (~done_b).astype(jnp.int32)
        done_b = done_b | (token_b == requests.eos_id) | (n_out_b >= requests.max_new_b)
        last_b = jnp.where(done_b, last_b, token_b)
        return cache, last_b, out_bo, n_out_b, done_b, steps + 1

    state = (cache, first_b, out_bo, n_out_b, done_b, jnp.int32(0))
    _, _, out_bo, n_out_b, _, steps = jax.lax.while_loop(lambda state: ~jnp.all(state[4]), body, state)
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
    eos = prompts_lib.check_eos(eos_token_id, cfg.vocab_size)
    batch = prompts_lib.prepare(prompts, model.tokenizer, vocab_size=cfg.vocab_size,
                                max_positions=cfg.max_position_embeddings,
                                max_new_tokens=max_new_tokens, request_ids=request_ids)
    requests = Requests(tokens_bp=batch.tokens_bp, prompt_len_b=batch.lengths_b, max_new_b=batch.max_new_b,
                        keys_b=request_keys(seed, batch.request_ids_b), eos_id=np.int32(eos))
    program = Program(target=model.graphdef, drafter=None, schedule=TARGET_ONLY, sampling=sampling,
                      cache_len=batch.tokens_bp.shape[1] + batch.out_len, out_len=batch.out_len)
    start = time.perf_counter()
    out_bo, n_out_b, steps = _generate_on_device(program, model.params, requests)
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
