"""Draft trees: their static layout and dynamic drafting (EAGLE-2), with a draft model or any
logits function.

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


def grow_tree(root_b, root_logits_bv, shape: TreeShape, sampling: SamplingConfig, expand, carry) -> tuple[Tree, object]:
    """A draft tree per row (EAGLE-2's dynamic tree), whatever computes the draft's logits.

    The root's W most probable next tokens make depth 1; each later depth takes the W children of
    each of the W most probable nodes of the depth above. `expand(carry, d, expand_be, tokens_bw,
    parent_bw, ancestor_bww)` returns the draft's logits after each of the e nodes `expand_be`
    (columns at depth d) [b, e, v] and the new carry; the tree's columns are filled up to depth d.
    """
    b, w, width = root_b.shape[0], shape.columns, shape.width
    starts = shape.starts()
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
        logits_bev, carry = expand(carry, d, expand_be, tokens, parent, ancestor)
        token_bec, logq_bec = _children(logits_bev, shape, sampling)
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
    """`grow_tree` with a draft model.

    `cache` holds the committed tokens below slot cache.lengths and the root's keys and values at
    that slot; `root_logits_bv` are the draft's logits after the root. Each depth below the first
    feeds the W most probable nodes of the depth above in one packed pass (each at its column's
    slot, seeing its own ancestors). `allowed_v` (bool [v]): the only tokens it may draft.
    Returns the tree and the cache with the fed nodes written (its lengths unchanged).
    """
    b, depth_bw = root_b.shape[0], jnp.broadcast_to(jnp.asarray(shape.depth_w()), (root_b.shape[0], shape.columns))
    allow = (lambda x: x) if allowed_v is None else (lambda logits: jnp.where(allowed_v, logits, -jnp.inf))

    def expand(cache, d, expand_be, tokens_bw, parent_bw, ancestor_bww):
        used = jnp.zeros(tokens_bw.shape, bool).at[jnp.arange(b)[:, None], expand_be].set(True)
        logits_bwv, cache = forward_packed(graphdef, params, tokens_bw, used, cache, b * shape.width,
                                           tree=(depth_bw, ancestor_bww))
        return allow(jnp.take_along_axis(logits_bwv, expand_be[:, :, None], axis=1)), cache

    return grow_tree(root_b, allow(root_logits_bv), shape, sampling, expand, cache)


def eagle_tree(graphdef, params, embed_vd, draft_ids, vocab_size: int, cache: KVCache, hidden_bd, logits_bw, root_b,
               shape: TreeShape, sampling: SamplingConfig) -> Tree:
    """`grow_tree` with an EAGLE-3 head (`jaxspec.models.eagle`) whose cache is committed to the
    kept tokens, `hidden_bd` and `logits_bw` its output after the root (its first draft's input
    and scores). A node is fed with its parent's output (the root's: `hidden_bd`), at the
    position after its parent's and at slot lengths + column - 1 (the root is not fed), seeing
    its fed ancestors; the head's cache past `lengths` is scratch (`absorb` rewrites it)."""
    from jaxspec.models import eagle as eagle_lib
    b, rows_b1 = root_b.shape[0], jnp.arange(root_b.shape[0])[:, None]

    def expand(carry, d, expand_be, tokens_bw, parent_bw, ancestor_bww):
        cache, hidden_bwd = carry
        hidden_bed = jnp.take_along_axis(hidden_bwd, jnp.take_along_axis(parent_bw, expand_be, 1)[:, :, None], 1)
        tree = (expand_be - 1, jnp.full_like(expand_be, d - 1), ancestor_bww[rows_b1, expand_be][:, :, 1:])
        logits_bew, out_bed, cache = eagle_lib.head_forward(graphdef, params, embed_vd, hidden_bed,
                                                            jnp.take_along_axis(tokens_bw, expand_be, 1), cache, tree)
        hidden_bwd = hidden_bwd.at[rows_b1, expand_be].set(out_bed.astype(hidden_bwd.dtype))
        return eagle_lib.to_target_logits(logits_bew, draft_ids, vocab_size), (cache, hidden_bwd)

    hidden_bwd = jnp.zeros((b, shape.columns, hidden_bd.shape[-1]), hidden_bd.dtype).at[:, 0].set(hidden_bd)
    root_logits_bv = eagle_lib.to_target_logits(logits_bw, draft_ids, vocab_size)
    return grow_tree(root_b, root_logits_bv, shape, sampling, expand, (cache, hidden_bwd))[0]


def ngram_tree(seq_bl, pending_b, shape: TreeShape, max_ngram: int, min_ngram: int) -> Tree:
    """A prompt-lookup tree per row: up to W branches, each continuing one earlier occurrence of
    the row's last n tokens for D tokens (the longest n first, then the latest), with distinct
    first tokens. Branch i's node at depth d scores -(d + i) (no model, no probabilities: each
    token and each rank down counts as one unit of doubt); nodes past the present are unusable.
    Branch i sits in column 1 + i at depth 1 and in the first child column of expanded node i
    below, so the layout is `TreeShape`'s."""
    b, slots = seq_bl.shape
    width, starts, cols_w = shape.width, shape.starts(), jnp.arange(shape.columns)
    slot_l = jnp.arange(slots)
    score_bl = jnp.full((b, slots), -1, jnp.int32)       # by continuation start: n * slots + start, -1: none
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix_bn = jnp.take_along_axis(seq_bl, jnp.clip(pending_b[:, None] - n + 1 + jnp.arange(n), 0), axis=1)
        match_bl = (slot_l[None, :] + n <= pending_b[:, None]) & (pending_b[:, None] + 1 >= n)
        for j in range(n):
            match_bl &= jnp.take(seq_bl, jnp.clip(slot_l + j, 0, slots - 1), axis=1) == suffix_bn[:, j:j + 1]
        cont_l = jnp.minimum(slot_l + n, slots - 1)
        score_bl = jnp.maximum(score_bl, jnp.full((b, slots), -1, jnp.int32).at[:, cont_l].max(
            jnp.where(match_bl, n * slots + cont_l[None], -1)))
    rows_b1 = jnp.arange(b)[:, None]
    tokens = jnp.zeros((b, shape.columns), jnp.int32).at[:, 0].set(seq_bl[rows_b1[:, 0], pending_b])
    parent = jnp.full((b, shape.columns), -1, jnp.int32)
    cum = jnp.full((b, shape.columns), -jnp.inf, jnp.float32).at[:, 0].set(0.0)
    ancestor = jnp.broadcast_to(jnp.eye(shape.columns, dtype=bool), (b, shape.columns, shape.columns))
    for i in range(width):
        start_b = jnp.argmax(score_bl, axis=1)
        found_b = jnp.max(score_bl, axis=1) >= 0
        score_bl = jnp.where(seq_bl == seq_bl[rows_b1[:, 0], start_b][:, None], -1, score_bl)   # distinct firsts
        above_b = jnp.zeros((b,), jnp.int32)
        for d in range(1, shape.depth + 1):
            col = 1 + i if d == 1 else starts[d - 1] + i * width
            ok_b = found_b & (start_b + d - 1 <= pending_b)
            tokens = tokens.at[:, col].set(jnp.take_along_axis(seq_bl, jnp.minimum(start_b + d - 1, slots - 1)[:, None],
                                                               axis=1)[:, 0])
            parent = parent.at[:, col].set(above_b)
            cum = cum.at[:, col].set(jnp.where(ok_b, -float(d + i), -jnp.inf))
            ancestor = ancestor.at[:, col].set(ancestor[rows_b1[:, 0], above_b] | (cols_w == col)[None])
            above_b = jnp.full((b,), col, jnp.int32)
    return Tree(tokens_bw=tokens, parent_bw=parent, ancestor_bww=ancestor, cum_bw=cum)
