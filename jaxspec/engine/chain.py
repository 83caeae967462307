"""Multi-level speculation: a speculative decoder used as the drafter of a larger target.

A chain M1 -> M2 -> target: M1 drafts for M2, and M2's verified output (k tokens per row) is the
draft the target verifies. Each level runs the same `speculative_step` as the outermost one.

Exactness. Greedy chains reproduce the target's greedy output (every level is greedy-exact).
With sampling, every level is lossless for its own model, so the tokens a level emits follow its
model's (transformed) distribution exactly; that distribution is what the level reports as q to
the level above, whose rejection sampling is then lossless too. The final output follows the
target's distribution exactly; only the acceptance rates depend on how close the levels are.

Bookkeeping. The middle model's cache is trusted as far as the tokens it was fed agree with the
row (it also holds this level's proposals, of which the level above keeps a prefix, and plain
steps above may have emitted other tokens since). Each propose feeds what is missing (`feed_missing`),
re-feeds the committed token before the pending one, then runs inner steps until every row has k
tokens. The cache is never cleared: lowering its lengths rolls back. An EAGLE head as the middle
model's drafter follows the same lengths and absorbs every token fed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.drafting.base import Drafter, Proposal, feed_missing, prefill_cache
from jaxspec.engine.plans import Program, schedule_for
from jaxspec.engine.step import Counters, DecodeState, speculative_step
from jaxspec.models.cache import KVCache
from jaxspec.models.model import forward, init_cache
from jaxspec.prompts import NO_EOS
from jaxspec.sampling import SamplingConfig


@struct.dataclass
class _ChainState:
    cache: KVCache        # the middle model's cache
    inner_state: object   # the state of the middle model's own drafter
    seen_bl: jax.Array    # the tokens that cache was fed ([b, cache_len]; past its lengths: anything)


def _fit(x_bl, width: int):
    """The first `width` columns of x, zero-padded."""
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
        self.model = decoder.target
        self.inner = decoder.drafter
        self.inner_spec = decoder.spec

    weights = {"model": "model.params", "inner": "inner"}

    def _key(self):
        return (self.model.graphdef, self.inner, self.inner_spec)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        model_params, inner_params = params["model"], params["inner"]
        inner_state = self.inner.init(inner_params, tokens_bp, prompt_len_b, cache_len)
        if not self.inner.feature_layers:
            cache = prefill_cache(self.model.graphdef, model_params, tokens_bp, prompt_len_b, cache_len)
            return _ChainState(cache=cache, inner_state=inner_state, seen_bl=_fit(tokens_bp, cache_len))
        # The head under this level reads its features: it takes in the prompt's as the cache does.
        cache = init_cache(self.model.graphdef, model_params, tokens_bp.shape[0], cache_len)
        cache, inner_state = feed_missing(self.model.graphdef, model_params, cache, tokens_bp, prompt_len_b - 1,
                                          chunk=tokens_bp.shape[1], reader=(self.inner, inner_params, inner_state))
        return _ChainState(cache=cache, inner_state=inner_state, seen_bl=_fit(tokens_bp, cache_len))

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        model_params, inner_params = params["model"], params["inner"]
        graphdef = self.model.graphdef
        b = seq_bl.shape[0]
        # Catch up. Position p of the cache is trusted while the tokens it was fed through p + 1 are this
        # row's (an EAGLE head's row p reads token p + 1): the cache may hold this level's
        # proposals past what the level above kept, and plain steps may have come since.
        w = min(state.seen_bl.shape[1], seq_bl.shape[1])
        same_b = jnp.sum(jnp.cumprod(state.seen_bl[:, :w] == seq_bl[:, :w], axis=1), axis=1).astype(jnp.int32)
        cache = state.cache.commit(jnp.minimum(state.cache.lengths, jnp.minimum(same_b, pending_b) - 1))
        inner_state = state.inner_state
        if self.inner.feature_layers:   # an EAGLE head: its rows follow this level's cache exactly
            inner_state = self.inner.truncate(inner_state, cache.lengths)
        cache, inner_state = feed_missing(graphdef, model_params, cache, seq_bl, pending_b - 1,
                                          reader=(self.inner, inner_params, inner_state))
        before_b1 = jnp.take_along_axis(seq_bl, pending_b[:, None] - 1, axis=1)
        out = forward(graphdef, model_params, before_b1, cache, jnp.zeros_like(before_b1),
                      features=self.inner.feature_layers)
        if self.inner.feature_layers:
            inner_state = self.inner.absorb(inner_params, inner_state, out[2],
                                            jnp.take_along_axis(seq_bl, pending_b[:, None], axis=1),
                                            jnp.ones_like(pending_b))
        cache = out[1].commit(pending_b)
        inner = DecodeState(
            target_cache=cache, draft_state=inner_state, seq_bl=seq_bl,
            out_bo=jnp.zeros((b, k), jnp.int32), n_out_b=jnp.zeros((b,), jnp.int32),
            done_b=jnp.zeros((b,), bool), counters=Counters.zeros(b), steps=jnp.int32(0),
            max_new_b=jnp.full((b,), k, jnp.int32), keys_b=key_b, eos_id=jnp.int32(NO_EOS),
            probs_bov=jnp.zeros((b, k, self.vocab_size), jnp.float32), logprob_bo=jnp.zeros((b, k), jnp.float32))
        # The inner level's own plan (and TETRIS budget) over this batch's rows, recording what
        # it emits for this level's verification.
        schedule, (budget,) = schedule_for(self.inner_spec, b, b)
        program = Program(target=graphdef, drafter=self.inner, schedule=schedule, sampling=sampling, record=True)
        inner = jax.lax.while_loop(lambda s: ~jnp.all(s.done_b), lambda s: speculative_step(
            program, schedule.plans[0], (model_params, inner_params), s, budget), inner)
        proposal = Proposal(tokens_bk=inner.out_bo, q_bkv=inner.probs_bov, logprob_bk=inner.logprob_bo,
                            num_drafts_b=jnp.full((b,), k, jnp.int32))
        return proposal, _ChainState(cache=inner.target_cache, inner_state=inner.draft_state,
                                     seen_bl=_fit(inner.seq_bl, state.seen_bl.shape[1]))
