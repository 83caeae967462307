"""Draft trees: their static layout (`TreeShape`), the drafted `Tree`, their dynamic growth
(EAGLE-2's, `grow_tree`) from any logits function, and `draft_tree`, its form for a draft model.

Shape key: b rows, w tree columns, v vocabulary, e expanded nodes per depth (= width).

A tree of depth D and width W hangs under the root (the row's last committed token, column 0):
depth 1 holds the root's W most probable children (columns 1..W); every later depth the W children
of each of the W most probable nodes above (W * W columns): the columns' depths are static, their
parents depend on the draft's probabilities. A column's cumulative log-probability never exceeds
its parent's, so `tetris.select_nodes` picks ancestor-closed sets. Children are the draft's top-W
tokens, deterministic given their path, which `verify.accept_tree` needs to stay lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.drafting.base import scoring_probs
from jaxspec.models.cache import KVCache
from jaxspec.models.model import forward_packed
from jaxspec.prompts import check_int
from jaxspec.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class TreeShape:
    depth: int
    width: int

    def __post_init__(self):
        for name in ("depth", "width"):
            check_int(f"tree {name}", getattr(self, name), 1)

    @property
    def columns(self) -> int:
        """Columns of the tree, the root included."""
        return 1 + self.width + (self.depth - 1) * self.width ** 2

    def starts(self) -> list[int]:
        """The first column of each depth 1..D, and the end."""
        return [1] + [1 + self.width + d * self.width ** 2 for d in range(self.depth)]

    def depth_w(self) -> np.ndarray:
        """int32 [w]: each column's depth (0 for the root)."""
        return np.repeat(np.arange(self.depth + 1, dtype=np.int32), np.diff([0, *self.starts()]))


@struct.dataclass
class Tree:
    """A drafted tree per row, in the column layout of its `TreeShape` (column 0: the root)."""

    tokens_bw: jax.Array     # int [b, w]; column 0 holds the root's token
    parent_bw: jax.Array     # int [b, w]; -1 at the root
    ancestor_bww: jax.Array  # bool [b, w, w]: column j's ancestors and itself
    cum_bw: jax.Array        # float [b, w]: cumulative log-probability (0 at the root; -inf: unusable)


def _children(logits_bev, shape: TreeShape, sampling: SamplingConfig):
    """Each node's W most probable next tokens and their log-probabilities, [b, e, W]."""
    prob, token = jax.lax.top_k(scoring_probs(logits_bev, sampling), shape.width)
    return token.astype(jnp.int32), jnp.log(prob)


def grow_tree(root_b, root_logits_bv, shape: TreeShape, sampling: SamplingConfig, expand, carry) -> tuple[Tree, object]:
    """A draft tree per row (EAGLE-2's dynamic tree, module docstring), whatever computes the
    draft's logits: `expand(carry, d, expand_be, tokens_bw, parent_bw, ancestor_bww)` returns the
    draft's logits after each of the e nodes `expand_be` (columns at depth d) [b, e, v] and the new
    carry; the tree's columns are filled up to depth d."""
    def children(carry, *where):
        logits_bev, carry = expand(carry, *where)
        return (*_children(logits_bev, shape, sampling), carry)

    return grow_tree_from(root_b, _children(root_logits_bv[:, None], shape, sampling), shape, children, carry)


def grow_tree_from(root_b, root_children, shape: TreeShape, children, carry) -> tuple[Tree, object]:
    """`grow_tree` from any source of children: `root_children` = the root's W children and their
    log-probabilities ([b, 1, W] each); `children(carry, d, expand_be, tokens_bw, parent_bw,
    ancestor_bww)` returns those of each expanded node [b, e, W] and the new carry."""
    b, w, width = root_b.shape[0], shape.columns, shape.width
    starts = shape.starts()
    token_be, logq_be = root_children
    tokens = jnp.zeros((b, w), jnp.int32).at[:, 0].set(root_b).at[:, 1:1 + width].set(token_be[:, 0])
    parent = jnp.full((b, w), -1, jnp.int32).at[:, 1:1 + width].set(0)
    ancestor = jnp.broadcast_to(jnp.eye(w, dtype=bool), (b, w, w)).at[:, 1:1 + width, 0].set(True)
    cum = jnp.full((b, w), -jnp.inf, jnp.float32).at[:, 0].set(0.0).at[:, 1:1 + width].set(logq_be[:, 0])
    rows_b1 = jnp.arange(b)[:, None]
    for d in range(1, shape.depth):
        lo, hi = starts[d - 1], starts[d]
        _, pick_be = jax.lax.top_k(cum[:, lo:hi], width)
        expand_be = lo + pick_be                                           # the columns fed at this depth
        token_bec, logq_bec, carry = children(carry, d, expand_be, tokens, parent, ancestor)
        cols_bn = (hi + jnp.arange(width * width))[None].repeat(b, 0)   # children of expanded e at hi + e W + c
        parents_bn = jnp.repeat(expand_be, width, axis=1)
        tokens = tokens.at[rows_b1, cols_bn].set(token_bec.reshape(b, -1))
        parent = parent.at[rows_b1, cols_bn].set(parents_bn)
        cum = cum.at[rows_b1, cols_bn].set((jnp.take_along_axis(cum, expand_be, 1)[:, :, None] + logq_bec)
                                           .reshape(b, -1))
        inherited = jnp.take_along_axis(ancestor, parents_bn[:, :, None], axis=1)      # [b, n, w]
        ancestor = ancestor.at[rows_b1, cols_bn].set(inherited | jax.nn.one_hot(cols_bn, w, dtype=bool))
    return Tree(tokens_bw=tokens, parent_bw=parent, ancestor_bww=ancestor, cum_bw=cum), carry


def draft_tree(graphdef, params, cache: KVCache, root_b, root_logits_bv, shape: TreeShape,
               sampling: SamplingConfig, allowed_v=None) -> tuple[Tree, KVCache]:
    """`grow_tree` with a draft model: `cache` holds the committed tokens below slot cache.lengths
    and the root's keys and values at that slot; `root_logits_bv` are the draft's logits after the
    root. Each depth below the first feeds the W most probable nodes of the depth above in one
    packed pass (each at its column's slot, seeing its own ancestors). `allowed_v` (bool [v]): the
    only tokens it may draft. Returns the tree and the cache, fed nodes written, lengths unchanged."""
    b, depth_bw = root_b.shape[0], jnp.broadcast_to(jnp.asarray(shape.depth_w()), (root_b.shape[0], shape.columns))
    allow = (lambda x: x) if allowed_v is None else (lambda logits: jnp.where(allowed_v, logits, -jnp.inf))

    def expand(cache, d, expand_be, tokens_bw, parent_bw, ancestor_bww):
        used = jnp.zeros(tokens_bw.shape, bool).at[jnp.arange(b)[:, None], expand_be].set(True)
        logits_bwv, cache = forward_packed(graphdef, params, tokens_bw, used, cache, b * shape.width,
                                           tree=(depth_bw, ancestor_bww))
        return allow(jnp.take_along_axis(logits_bwv, expand_be[:, :, None], axis=1)), cache

    return grow_tree(root_b, allow(root_logits_bv), shape, sampling, expand, cache)
