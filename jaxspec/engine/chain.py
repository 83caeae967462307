"""Multi-level speculation: a speculative decoder used as the drafter of a larger target.

A chain M1 -> M2 -> target: M1 drafts for M2, and M2's verified output (k tokens per row) is the
draft the target verifies. Each level runs the same `speculative_step` as the outermost one.

Exactness: the tokens a level emits follow its model's distribution exactly, which it reports as q
to the level above, whose rejection sampling is then lossless too.

Bookkeeping: the middle model's cache is trusted as far as the tokens it was fed agree with the
row (`catch_up` feeds what plain steps above emitted). Each propose rolls back to that prefix,
re-feeds the token before the pending one, then runs `inner_steps(k)` inner steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.drafting.base import Drafter, Proposal, feed_missing, prefilled
from jaxspec.engine.plans import Program, schedule_for
from jaxspec.engine.step import Counters, DecodeState, speculative_step
from jaxspec.models.cache import KVCache
from jaxspec.models.model import init_cache
from jaxspec.prompts import NO_EOS
from jaxspec.sampling import SamplingConfig


@struct.dataclass
class _ChainState:
    cache: KVCache        # the middle model's cache
    inner_state: object   # the state of the middle model's own drafter
    seen_bl: jax.Array    # the tokens that cache was fed ([b, cache_len]; past its lengths: anything)


def inner_steps(k: int) -> int:
    """Inner steps per proposal of k: enough for k tokens where the inner level accepts at least
    one draft a step (a loop of data-dependent length would stall a GPU's host every step)."""
    return -(-k // 2)


def _fit(x_bl, width: int):
    return jnp.pad(x_bl, ((0, 0), (0, max(0, width - x_bl.shape[1]))))[:, :width]


class ChainDrafter(Drafter):
    """Adapts a SpeculativeDecoder (target M2, its own drafter) into a drafter for a larger model."""

    def __init__(self, decoder):
        if decoder.spec.k < 1:
            raise ValueError(f"a chain level needs k >= 1 for its own drafting, got k={decoder.spec.k}")
        if decoder.spec.policy != "fixed":
            raise ValueError("a chain level runs a fixed draft length: use policy='fixed' for the inner decoder "
                             f"(got policy={decoder.spec.policy!r}); the outermost decoder may use 'goodput'")
        if decoder.spec.tree is not None:
            raise ValueError("a chain level drafts chains, not trees: use tree=None for the inner decoder")
        self.model, self.inner, self.inner_spec = decoder.target, decoder.drafter, decoder.spec

    weights = {"model": "model.params", "inner": "inner"}

    def _key(self):
        return (self.model.graphdef, self.inner, self.inner_spec)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        graphdef, model_params = self.model.graphdef, params["model"]
        state = _ChainState(cache=init_cache(graphdef, model_params, tokens_bp.shape[0], cache_len),
                            inner_state=self.inner.init(params["inner"], tokens_bp, prompt_len_b, cache_len),
                            seen_bl=_fit(tokens_bp, cache_len))
        if self.inner.feature_layers:   # a head reading this level's features takes in the prompt's too
            return self.catch_up(params, state, tokens_bp, prompt_len_b, tokens_bp.shape[1])
        return state.replace(cache=prefilled(graphdef, model_params, tokens_bp, prompt_len_b, cache_len))

    def _trusted(self, state, seq_bl, pending_b):
        """The state rolled back to the trusted prefix: position p is while the tokens fed through
        p + 1 are this row's (an EAGLE head's row p reads token p + 1) and p < pending_b - 1."""
        w = min(state.seen_bl.shape[1], seq_bl.shape[1])
        same_b = jnp.sum(jnp.cumprod(state.seen_bl[:, :w] == seq_bl[:, :w], axis=1), axis=1).astype(jnp.int32)
        cache = state.cache.commit(jnp.minimum(state.cache.lengths, jnp.minimum(same_b, pending_b) - 1))
        if self.inner.feature_layers:   # an EAGLE head: its rows follow this level's cache exactly
            return state.replace(cache=cache, inner_state=self.inner.truncate(state.inner_state, cache.lengths))
        return state.replace(cache=cache)

    def lag(self, state, seq_bl, pending_b):
        return jnp.maximum(pending_b - 1 - self._trusted(state, seq_bl, pending_b).cache.lengths,
                           self.inner.lag(state.inner_state, seq_bl, pending_b) - 1)   # propose feeds it one

    def catch_up(self, params, state, seq_bl, pending_b, width: int):
        state = self._trusted(state, seq_bl, pending_b)
        cache, inner_state, _ = feed_missing(self.model.graphdef, params["model"], state.cache, seq_bl, pending_b - 1,
                                             width, reader=(self.inner, params["inner"], state.inner_state))
        inner_state = self.inner.catch_up(params["inner"], inner_state, seq_bl, pending_b, width + 1)
        return state.replace(cache=cache, inner_state=inner_state, seen_bl=_fit(seq_bl, state.seen_bl.shape[1]))

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        model_params, inner_params = params["model"], params["inner"]
        graphdef, b = self.model.graphdef, seq_bl.shape[0]
        state = self._trusted(state, seq_bl, pending_b)
        inner_state = self.inner.catch_up(inner_params, state.inner_state, seq_bl, pending_b, 1)
        cache, inner_state, _ = feed_missing(graphdef, model_params, state.cache, seq_bl, pending_b, 1,
                                             reader=(self.inner, inner_params, inner_state))
        inner = DecodeState(
            target_cache=cache.commit(pending_b), draft_state=inner_state, seq_bl=seq_bl,
            out_bo=jnp.zeros((b, k), jnp.int32), n_out_b=jnp.zeros((b,), jnp.int32),
            done_b=jnp.zeros((b,), bool), counters=Counters.zeros(b), steps=jnp.int32(0),
            max_new_b=jnp.full((b,), k, jnp.int32), keys_b=key_b, eos_id=jnp.int32(NO_EOS),
            probs_bov=jnp.zeros((b, k, self.vocab_size), jnp.float32), logprob_bo=jnp.zeros((b, k), jnp.float32))
        # The inner level's own plan (and TETRIS budget) over this batch's rows, recording what
        # it emits for this level's verification.
        schedule, (budget,) = schedule_for(self.inner_spec, b, b)
        program = Program(target=graphdef, drafter=self.inner, schedule=schedule, sampling=sampling, record=True)
        inner = jax.lax.fori_loop(0, inner_steps(k), lambda _, s: speculative_step(
            program, schedule.plans[0], (model_params, inner_params), s, budget), inner)
        proposal = Proposal(tokens_bk=inner.out_bo, q_bkv=inner.probs_bov, logprob_bk=inner.logprob_bo,
                            num_drafts_b=inner.n_out_b)
        return proposal, _ChainState(cache=inner.target_cache, inner_state=inner.draft_state,
                                     seen_bl=_fit(inner.seq_bl, state.seen_bl.shape[1]))
