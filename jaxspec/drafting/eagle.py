"""`EagleDrafter`: an EAGLE-3 head (`jaxspec.models.eagle`) drafting from the target's features,
as a chain or a tree.

Shape key: b rows, l sequence-buffer slots, k draft tokens, v vocabulary, w draft vocabulary
(tree columns in `propose_tree`), e expanded nodes, d the head's width, f fused feature width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.drafting.base import Drafter, draft_chain, draw_token
from jaxspec.drafting.trees import TreeShape, grow_tree
from jaxspec.models import eagle as eagle_lib
from jaxspec.models.cache import KVCache
from jaxspec.sampling import SamplingConfig


@struct.dataclass
class EagleState:
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

    weights = {"head": "head.params", "embed_vd": "head.embed_vd"}
    forwards_per_draft = 1

    def __init__(self, head: eagle_lib.EagleHead):
        if head.embed_vd is None:
            raise ValueError("EagleDrafter needs a head bound to its target (EagleHead.init(target) or "
                             "jaxspec.load(path, target=target))")
        self.head = head
        self.feature_layers = head.config.feature_layers

    def _key(self):
        return (self.head.graphdef, self.head.config, self.head.draft_ids.tobytes())

    @property
    def vocab_size(self) -> int:
        return self.head.config.target_vocab_size

    def _target_logits(self, logits_bw):
        return eagle_lib.to_target_logits(logits_bw, self.head.draft_ids, self.head.config.target_vocab_size)

    def _forward(self, params, hidden_btd, tokens_bt, cache: KVCache, tree=None):
        return eagle_lib.head_forward(self.head.graphdef, params["head"], params["embed_vd"], hidden_btd, tokens_bt,
                                      cache, tree)

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        b, d = tokens_bp.shape[0], self.head.config.layer.hidden_size
        cache = KVCache.init(self.head.config.layer, b, cache_len, params["head"]["fc_fd"].dtype)
        return EagleState(cache=cache, hidden_bd=jnp.zeros((b, d), cache.k[0].dtype),
                          logits_bw=jnp.zeros((b, self.head.config.layer.vocab_size), jnp.float32))

    def absorb(self, params, state, features_bwf, next_bw, count_b):
        hidden_bwd = eagle_lib.fuse(self.head.graphdef, params["head"], features_bwf)
        logits_bww, out_bwd, cache = self._forward(params, hidden_bwd, next_bw, state.cache)
        last_b11 = jnp.maximum(count_b - 1, 0)[:, None, None]
        kept_b1 = (count_b > 0)[:, None]
        hidden_bd = jnp.where(kept_b1, jnp.take_along_axis(out_bwd, last_b11, axis=1)[:, 0], state.hidden_bd)
        logits_bw = jnp.where(kept_b1, jnp.take_along_axis(logits_bww, last_b11, axis=1)[:, 0], state.logits_bw)
        return EagleState(cache=cache.commit(state.cache.lengths + count_b), hidden_bd=hidden_bd, logits_bw=logits_bw)

    def truncate(self, state, length_b):
        """The state with the head's rows from `length_b` on dropped (they are absorbed again);
        its last output is stale until the next `absorb`."""
        return state.replace(cache=state.cache.commit(jnp.minimum(state.cache.lengths, length_b)))

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        def draw_one(logits_bw, keys_b):
            return draw_token(self._target_logits(logits_bw), keys_b, sampling, sampling)

        def feed(carry, token_b):
            cache, hidden_bd = carry
            logits_b1w, out_b1d, cache = self._forward(params, hidden_bd[:, None], token_b[:, None], cache)
            return logits_b1w[:, 0], (cache.commit(cache.lengths + 1), out_b1d[:, 0])

        proposal, (cache, _) = draft_chain(state.logits_bw, k, key_b, draw_one, feed, (state.cache, state.hidden_bd))
        return proposal, state.replace(cache=cache.commit(state.cache.lengths))

    def propose_tree(self, params, state, seq_bl, pending_b, shape: TreeShape, sampling: SamplingConfig):
        """`grow_tree` from the head's state: its output after the root is the first depth's input
        and scores. A node is fed with its parent's output (the root's: `hidden_bd`), at the
        position after its parent's and at slot lengths + column - 1 (the root is not fed), seeing
        its fed ancestors; the head's cache past `lengths` is scratch (`absorb` rewrites it)."""
        b = seq_bl.shape[0]
        rows_b1 = jnp.arange(b)[:, None]

        def expand(carry, d, expand_be, tokens_bw, parent_bw, ancestor_bww):
            cache, hidden_bwd = carry
            hidden_bed = jnp.take_along_axis(hidden_bwd, jnp.take_along_axis(parent_bw, expand_be, 1)[:, :, None], 1)
            tree = (expand_be - 1, jnp.full_like(expand_be, d - 1), ancestor_bww[rows_b1, expand_be][:, :, 1:])
            logits_bew, out_bed, cache = self._forward(params, hidden_bed, jnp.take_along_axis(tokens_bw, expand_be, 1),
                                                       cache, tree)
            hidden_bwd = hidden_bwd.at[rows_b1, expand_be].set(out_bed.astype(hidden_bwd.dtype))
            return self._target_logits(logits_bew), (cache, hidden_bwd)

        root_b = jnp.take_along_axis(seq_bl, pending_b[:, None], axis=1)[:, 0]
        hidden_bwd = jnp.zeros((b, shape.columns, state.hidden_bd.shape[-1]), state.hidden_bd.dtype)
        carry = (state.cache, hidden_bwd.at[:, 0].set(state.hidden_bd))
        return grow_tree(root_b, self._target_logits(state.logits_bw), shape, sampling, expand, carry)[0], state
