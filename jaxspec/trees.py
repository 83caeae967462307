"""Draft trees: their static layout and dynamic drafting (EAGLE-2) with a draft model.

Shape key: b rows, w tree columns, v vocabulary, e expanded nodes per depth (= width).

A tree of depth D and width W hangs under the root (the row's last committed token, column 0):
depth 1 holds the root's W most probable children (columns 1..W); every later depth holds the
W children of each of the W most probable nodes of the depth above (W * W columns). So the
columns' depths are static, while which node is whose parent depends on the draft's
probabilities. A column's cumulative log-probability is the sum along its path; it never exceeds
its parent's, so `tetris.select_nodes` picks ancestor-closed sets. Children are the draft's top-W
tokens, deterministic given their path, which `verify.accept_tree` needs to stay lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.models.cache import KVCache
from jaxspec.models.model import forward_packed
from jaxspec.sampling import SamplingConfig, probabilities


@dataclasses.dataclass(frozen=True)
class TreeShape:
    depth: int
    width: int

    def __post_init__(self):
        for name in ("depth", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tree {name} must be an int >= 1, got {value!r}")

    @property
    def columns(self) -> int:
        """Columns of the tree, the root included."""
        return 1 + self.width + (self.depth - 1) * self.width ** 2

    def starts(self) -> list[int]:
        """The first column of each depth 1..D, and the end."""
        out = [1, 1 + self.width]
        for _ in range(2, self.depth + 1):
            out.append(out[-1] + self.width ** 2)
        return out

    def depth_w(self) -> np.ndarray:
        """int32 [w]: each column's depth (0 for the root)."""
        starts = self.starts()
        depth = np.zeros(self.columns, np.int32)
        for d in range(1, self.depth + 1):
            depth[starts[d - 1]:starts[d]] = d
        return depth


@struct.dataclass
class Tree:
    """A drafted tree per row, in the column layout of its `TreeShape` (column 0: the root)."""

    tokens_bw: jax.Array     # int [b, w]; column 0 holds the root's token
    parent_bw: jax.Array     # int [b, w]; -1 at the root
    ancestor_bww: jax.Array  # bool [b, w, w]: column j's ancestors and itself
    cum_bw: jax.Array        # float [b, w]: cumulative log-probability (0 at the root; -inf: unusable)


def _children(logits_bev, shape: TreeShape, sampling: SamplingConfig):
    """Each node's W most probable next tokens and their log-probabilities, [b, e, W]."""
    dist = jax.nn.softmax(logits_bev.astype(jnp.float32), -1) if sampling.greedy else probabilities(logits_bev,
                                                                                                      sampling)
    prob, token = jax.lax.top_k(dist, shape.width)
    return token.astype(jnp.int32), jnp.log(prob)


def draft_tree(graphdef, params, cache: KVCache, root_b, root_logits_bv, shape: TreeShape,
               sampling: SamplingConfig) -> tuple[Tree, KVCache]:
    """Drafts a tree per row with a draft model (EAGLE-2's dynamic tree).

    `cache` holds the committed tokens below slot cache.lengths and the root's keys and values at
    that slot; `root_logits_bv` are the draft's logits after the root. Each depth below the first
    feeds the W most probable nodes of the depth above in one packed pass (each at its column's
    slot, seeing its own ancestors) and takes their W most probable children. Returns the tree
    and the cache with the fed nodes written (its lengths unchanged).
    """
    b, w, width = root_b.shape[0], shape.columns, shape.width
    starts, depth_w = shape.starts(), jnp.asarray(shape.depth_w())
    tokens = jnp.zeros((b, w), jnp.int32).at[:, 0].set(root_b)
    parent = jnp.full((b, w), -1, jnp.int32).at[:, 1:1 + width].set(0)
    ancestor = jnp.broadcast_to(jnp.eye(w, dtype=bool), (b, w, w)).at[:, 1:1 + width, 0].set(True)
    token_be, logq_be = _children(root_logits_bv[:, None], shape, sampling)
    tokens = tokens.at[:, 1:1 + width].set(token_be[:, 0])
    cum = jnp.full((b, w), -jnp.inf, jnp.float32).at[:, 0].set(0.0).at[:, 1:1 + width].set(logq_be[:, 0])
    rows_b1 = jnp.arange(b)[:, None]
    for d in range(1, shape.depth):
        lo, hi = starts[d - 1], starts[d]
        _, pick_be = jax.lax.top_k(cum[:, lo:hi], width)
        expand_be = lo + pick_be                                           # the columns fed at this depth
        used = jnp.zeros((b, w), bool).at[rows_b1, expand_be].set(True)
        logits_bwv, cache = forward_packed(graphdef, params, tokens, used, cache, b * width,
                                           tree=(jnp.broadcast_to(depth_w, (b, w)), ancestor))
        token_bec, logq_bec = _children(logits_bwv[rows_b1, expand_be], shape, sampling)
        cols_bec = hi + jnp.arange(width * width).reshape(width, width)[None]     # children of expanded e
        cols_bn = cols_bec.reshape(1, -1).repeat(b, 0)
        parents_bn = jnp.repeat(expand_be, width, axis=1)
        tokens = tokens.at[rows_b1, cols_bn].set(token_bec.reshape(b, -1))
        parent = parent.at[rows_b1, cols_bn].set(parents_bn)
        cum = cum.at[rows_b1, cols_bn].set((jnp.take_along_axis(cum, expand_be, 1)[:, :, None] + logq_bec)
                                           .reshape(b, -1))
        inherited = jnp.take_along_axis(ancestor, parents_bn[:, :, None], axis=1)      # [b, n, w]
        ancestor = ancestor.at[rows_b1, cols_bn].set(inherited | jax.nn.one_hot(cols_bn, w, dtype=bool))
    return Tree(tokens_bw=tokens, parent_bw=parent, ancestor_bww=ancestor, cum_bw=cum), cache
