"""`EagleDrafter`: an EAGLE-3 head (`jaxspec.models.eagle`) drafting from the target's features.

Shape key: b rows, l sequence-buffer slots, k draft tokens, v vocabulary, w draft vocabulary,
d the head's width, f fused feature width.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.drafting.base import Drafter, Proposal, abstract, draft_logprob
from jaxspec.drafting.trees import eagle_tree
from jaxspec.models import eagle as eagle_lib
from jaxspec.models.cache import KVCache
from jaxspec.sampling import SamplingConfig, choose, probabilities

_F32 = jnp.float32


@struct.dataclass
class _EagleState:
    cache: KVCache          # the head's cache, committed to the positions the target has kept
    hidden_bd: jax.Array    # the head's pre-norm output at the last kept position
    logits_bw: jax.Array    # its draft-vocabulary logits: the first draft's


class EagleDrafter(Drafter):
    """Drafts with an EAGLE-3 head (`jaxspec.models.eagle`) fed by the target's own features.

    After every target pass the head takes in the kept tokens (`absorb`): row t pairs the
    target's features at t with the token at t + 1, so the last kept row already scores the first
    draft. `propose` then drafts k tokens, each later step feeding the head's own output at the
    drafted token. Drafted rows are never committed: the next `absorb` rewrites those cache slots
    from the target's features (EAGLE's reference does the same).
    """

    def __init__(self, head: eagle_lib.EagleHead):
        if head.embed_vd is None:
            raise ValueError("EagleDrafter needs a head bound to its target (EagleHead.init(target) or "
                             "jaxspec.load(path, target=target))")
        self.head = head
        self.feature_layers = head.config.feature_layers

    def __eq__(self, other):
        return (type(other) is EagleDrafter and other.head.graphdef == self.head.graphdef
                and other.head.config == self.head.config and np.array_equal(other.head.draft_ids, self.head.draft_ids))

    def __hash__(self):
        return hash((EagleDrafter, self.head.graphdef, self.head.config, self.head.draft_ids.tobytes()))

    def forwards_per_step(self, k: int) -> int:
        return k

    @property
    def params(self):
        return {"head": self.head.params, "embed_vd": self.head.embed_vd}

    def static(self) -> EagleDrafter:
        twin, twin.head = copy.copy(self), abstract(self.head, ("params", "embed_vd"))
        return twin

    @property
    def vocab_size(self) -> int:
        return self.head.config.target_vocab_size

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        b, d = tokens_bp.shape[0], self.head.config.layer.hidden_size
        cache = KVCache.init(self.head.config.layer, b, cache_len, params["head"]["fc_fd"].dtype)
        return _EagleState(cache=cache, hidden_bd=jnp.zeros((b, d), cache.k[0].dtype),
                           logits_bw=jnp.zeros((b, self.head.config.layer.vocab_size), _F32))

    def absorb(self, params, state, features_bwf, next_bw, count_b):
        graphdef = self.head.graphdef
        hidden_bwd = eagle_lib.fuse(graphdef, params["head"], features_bwf)
        logits_bww, out_bwd, cache = eagle_lib.head_forward(graphdef, params["head"], params["embed_vd"], hidden_bwd,
                                                            next_bw, state.cache)
        last_b1 = jnp.maximum(count_b - 1, 0)[:, None]
        kept_b = count_b > 0
        hidden_bd = jnp.where(kept_b[:, None], jnp.take_along_axis(out_bwd, last_b1[:, :, None], axis=1)[:, 0],
                              state.hidden_bd)
        logits_bw = jnp.where(kept_b[:, None], jnp.take_along_axis(logits_bww, last_b1[:, :, None], axis=1)[:, 0],
                              state.logits_bw)
        return _EagleState(cache=cache.commit(state.cache.lengths + count_b), hidden_bd=hidden_bd, logits_bw=logits_bw)

    def truncate(self, state, length_b):
        """The state with the head's rows from `length_b` on dropped (they are absorbed again);
        its last output is stale until the next `absorb`."""
        return state.replace(cache=state.cache.commit(jnp.minimum(state.cache.lengths, length_b)))

    def propose_tree(self, params, state, seq_bl, pending_b, shape, sampling: SamplingConfig):
        root_b = jnp.take_along_axis(seq_bl, pending_b[:, None], axis=1)[:, 0]
        return eagle_tree(self.head.graphdef, params["head"], params["embed_vd"], self.head.draft_ids,
                          self.head.config.target_vocab_size, state.cache, state.hidden_bd, state.logits_bw, root_b,
                          shape, sampling), state

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        graphdef, vocab = self.head.graphdef, self.head.config.target_vocab_size
        keys_bk = jax.vmap(lambda key: jax.random.split(key, k))(key_b)

        def draw_one(logits_bw, keys_b):
            logits_bv = eagle_lib.to_target_logits(logits_bw, self.head.draft_ids, vocab)
            token_b, q_bv = choose(keys_b, logits_bv, sampling), probabilities(logits_bv, sampling)
            return token_b, q_bv, draft_logprob(logits_bv, token_b, q_bv, sampling, sampling.greedy)

        first = draw_one(state.logits_bw, keys_bk[:, 0])

        def step(carry, keys_b):
            cache, hidden_bd, token_b = carry
            logits_b1w, out_b1d, cache = eagle_lib.head_forward(graphdef, params["head"], params["embed_vd"],
                                                                hidden_bd[:, None], token_b[:, None], cache)
            drawn = draw_one(logits_b1w[:, 0], keys_b)
            return (cache.commit(cache.lengths + 1), out_b1d[:, 0], drawn[0]), drawn

        (cache, _, _), rest = jax.lax.scan(step, (state.cache, state.hidden_bd, first[0]),
                                           jnp.swapaxes(keys_bk[:, 1:], 0, 1))
        tokens_bk, q_bkv, logprob_bk = (jnp.concatenate([a[:, None], jnp.swapaxes(r, 0, 1)], axis=1)
                                        for a, r in zip(first, rest))
        proposal = Proposal(tokens_bk=tokens_bk, q_bkv=q_bkv, logprob_bk=logprob_bk,
                            num_drafts_b=jnp.full(pending_b.shape, k, jnp.int32))
        return proposal, state.replace(cache=cache.commit(state.cache.lengths))
