"""`ModelDrafter`: a smaller model drafting autoregressively on its own KV cache.

Shape key: b rows, l sequence-buffer slots, k draft tokens, v vocabulary.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import struct

from jaxspec.drafting.base import Drafter, draft_chain, draw_token, feed_last_two, feed_missing, model_feed, prefilled
from jaxspec.drafting.trees import draft_tree
from jaxspec.models.cache import KVCache
from jaxspec.models.model import Model, init_cache
from jaxspec.sampling import SamplingConfig


@struct.dataclass
class _ModelDraftState:
    cache: KVCache


class ModelDrafter(Drafter):
    """Drafts autoregressively with a smaller model on its own KV cache.

    Each step rolls the cache back to the token before the pending one and re-feeds the last two
    committed tokens (`feed_last_two`); after steps without drafting, `catch_up` feeds what it missed.
    """

    weights = {"model": "model.params"}
    forwards_per_draft = 1

    def __init__(self, model: Model, *, greedy: bool = False, extra: int = 0):
        self.model, self.greedy, self.extra = model, greedy, extra   # extra: see `discard`

    def _key(self):
        return (self.model.graphdef, self.greedy, self.extra)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        return _ModelDraftState(prefilled(self.model.graphdef, params["model"], tokens_bp, prompt_len_b, cache_len))

    def init_deferred(self, params, tokens_bp, prompt_len_b, cache_len: int):
        # An empty cache until `catch_up`: where speculation never starts, this saves the draft's prefill.
        return _ModelDraftState(init_cache(self.model.graphdef, params["model"], tokens_bp.shape[0], cache_len))

    def lag(self, state, seq_bl, pending_b):
        return jnp.maximum(pending_b - 1 - state.cache.lengths, 0)

    def catch_up(self, params, state, seq_bl, pending_b, width: int):
        return _ModelDraftState(feed_missing(self.model.graphdef, params["model"], state.cache, seq_bl, pending_b - 1,
                                             width)[0])

    def discard(self, state, keep_b):
        """As `Drafter.discard`; up to `extra` dropped tokens are fed at the next proposal, the rest by `catch_up`."""
        return _ModelDraftState(state.cache.commit(jnp.minimum(state.cache.lengths, keep_b)))

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        graphdef, draw = self.model.graphdef, SamplingConfig() if self.greedy else sampling
        logits_bv, cache, _ = feed_last_two(graphdef, params["model"], state.cache, seq_bl, pending_b, self.extra)
        proposal, cache = draft_chain(logits_bv, k, key_b, functools.partial(draw_token, draw=draw, sampling=sampling),
                                      model_feed(graphdef, params["model"]), cache.commit(pending_b + 1))
        return proposal, _ModelDraftState(cache)

    def propose_tree(self, params, state, seq_bl, pending_b, shape, sampling: SamplingConfig):
        logits_bv, cache, _ = feed_last_two(self.model.graphdef, params["model"], state.cache, seq_bl, pending_b,
                                            shape.depth - 1)
        root_b = jnp.take_along_axis(seq_bl, pending_b[:, None], axis=1)[:, 0]
        tree, cache = draft_tree(self.model.graphdef, params["model"], cache, root_b, logits_bv, shape,
                                 SamplingConfig() if self.greedy else sampling)
        # The tree's nodes sit past the pending token's slot: untrusted, as rejected drafts are.
        return tree, _ModelDraftState(cache.commit(pending_b + 1))
