"""`ModelDrafter`: a smaller model drafting autoregressively on its own KV cache.

Shape key: b rows, l sequence-buffer slots, k draft tokens, v vocabulary.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
from flax import struct

from jaxspec.drafting.base import Drafter, Proposal, abstract, catch_up, draft_chain, draft_logprob, prefill_cache
from jaxspec.drafting.trees import draft_tree
from jaxspec.models.cache import KVCache
from jaxspec.models.model import Model, forward, init_cache
from jaxspec.sampling import SamplingConfig, choose, probabilities


@struct.dataclass
class _ModelDraftState:
    cache: KVCache


class ModelDrafter(Drafter):
    """Drafts autoregressively with a smaller model on its own KV cache.

    Catch-up rule: each step rolls the draft cache back to pending - 1 and feeds the last two
    committed tokens. After a drafting step the cache holds every token before that (after a
    partial accept its drafts up to the accepted one are already there; after a full accept only
    the last draft and the bonus token are missing), so two tokens suffice and the shapes stay
    static; after steps without drafting, `catch_up` first feeds what was missed.
    """

    def __init__(self, model: Model, *, greedy: bool = False):
        self.model = model
        self.greedy = greedy

    # Compiled programs are keyed on the drafter: equal structure, equal program.
    def __eq__(self, other):
        return (type(other) is ModelDrafter and other.model.graphdef == self.model.graphdef
                and other.greedy == self.greedy)

    def __hash__(self):
        return hash((ModelDrafter, self.model.graphdef, self.greedy))

    def forwards_per_step(self, k: int) -> int:
        return k

    @property
    def params(self):
        return self.model.params

    def static(self) -> ModelDrafter:
        twin = copy.copy(self)
        twin.model = abstract(self.model)
        return twin

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        return _ModelDraftState(cache=prefill_cache(self.model.graphdef, params, tokens_bp, prompt_len_b, cache_len))

    def init_deferred(self, params, tokens_bp, prompt_len_b, cache_len: int):
        # An empty cache: the first propose feeds the prompt through `catch_up`. Where speculation
        # never starts (large batches) this saves the draft's prefill, 3-4% of a 96-token run.
        return _ModelDraftState(cache=init_cache(self.model.graphdef, params, tokens_bp.shape[0], cache_len))

    def _fed(self, params, state, seq_bl, pending_b):
        """The cache through the pending token (committed to it) and the logits after it."""
        cache = catch_up(self.model.graphdef, params, state.cache, seq_bl, pending_b - 1)
        last_two_b2 = jnp.take_along_axis(seq_bl, pending_b[:, None] + jnp.array([[-1, 0]]), axis=1)
        logits_b1v, cache = forward(self.model.graphdef, params, last_two_b2, cache, jnp.ones_like(pending_b)[:, None])
        return logits_b1v[:, 0], cache.commit(pending_b + 1)

    def propose_tree(self, params, state, seq_bl, pending_b, shape, sampling: SamplingConfig):
        logits_bv, cache = self._fed(params, state, seq_bl, pending_b)
        root_b = jnp.take_along_axis(seq_bl, pending_b[:, None], axis=1)[:, 0]
        tree, cache = draft_tree(self.model.graphdef, params, cache.commit(pending_b), root_b, logits_bv, shape,
                                 SamplingConfig() if self.greedy else sampling)
        # The tree's nodes sit past the pending token's slot: untrusted, as rejected drafts are.
        return tree, _ModelDraftState(cache=cache.commit(pending_b + 1))

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        graphdef = self.model.graphdef
        draw = SamplingConfig() if self.greedy else sampling
        logits_bv, cache = self._fed(params, state, seq_bl, pending_b)

        def draw_one(logits_bv, keys_b):
            token_b, q_bv = choose(keys_b, logits_bv, draw), probabilities(logits_bv, draw)
            return token_b, q_bv, draft_logprob(logits_bv, token_b, q_bv, sampling, draw.greedy)

        (tokens_bk, q_bkv, logprob_bk), cache = draft_chain(graphdef, params, cache, logits_bv, k, key_b, draw_one)
        proposal = Proposal(tokens_bk=tokens_bk, q_bkv=q_bkv, logprob_bk=logprob_bk,
                            num_drafts_b=jnp.full(pending_b.shape, k, jnp.int32))
        return proposal, _ModelDraftState(cache=cache)
