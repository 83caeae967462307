"""Attention of new tokens against keys and values at explicit positions, in several
implementations (`ATTENTION`): "plain" batched dots over the whole buffer, "blocked" (`BLOCK`-slot
blocks up to the `live_slots` bound, merged by an online softmax), and "xla" / "cudnn"
(`jax.nn.dot_product_attention`).

Shape key: b batch, t queries per row, s key slots, n query heads, k kv heads, g query heads per kv
head, h head dim, m = t * g query rows per kv head.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

_F32 = jnp.float32

# "plain", "blocked", "xla" / "cudnn" (module docstring), or "auto": cuDNN on a GPU in bfloat16 / float16 where
# its head sizes allow, else blocked (without a cache: plain). Read when a program is traced.
ATTENTION = "auto"
BLOCK = 128
_LIVE_SLOTS = contextvars.ContextVar("live_slots", default=None)   # per thread: parallel traces


@contextlib.contextmanager
def live_slots(n: int | None):
    """Trace under the contract that no row of any cache attended has more than n live slots (None: no
    bound), so the blocked path reads a static ceil(n / BLOCK) blocks. A row past n silently loses keys:
    the engine guarantees n, and keys its programs on n (a jitted function's cache does not see it)."""
    token = _LIVE_SLOTS.set(n)
    try:
        yield
    finally:
        _LIVE_SLOTS.reset(token)


@dataclasses.dataclass(frozen=True)
class Options:
    """How a layer scores keys: a sliding `window` (None: every earlier position), a soft cap c of
    the scores (c * tanh(s / c); None: none), and the scale of q . k (None: head_dim ** -0.5)."""

    window: int | None = None
    softcap: float | None = None
    scale: float | None = None


def _scores(scores, opts: Options, head_dim: int):
    scores = scores * (opts.scale if opts.scale is not None else head_dim ** -0.5)
    return scores if opts.softcap is None else opts.softcap * jnp.tanh(scores / opts.softcap)


def visible(k_pos, q_pos, window: int | None):
    """Whether a key at k_pos is visible to a query at q_pos (broadcasting): at or before it, and
    with a sliding `window`, less than `window` positions before it (the query itself included)."""
    seen = k_pos <= q_pos
    return seen if window is None else seen & (k_pos > q_pos - window)


def attend(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, opts: Options = Options()):
    """Causal grouped-query attention of t queries against s keys at explicit positions: a key is visible to a
    query iff `visible`. The plain path is batched 2-D dots with (batch, kv head) leading, which XLA's CPU
    backend runs faster than the equivalent multi-axis einsum."""
    impl = attention_impl(q_btnh.dtype, q_btnh.shape[-1])
    with jax.named_scope("attention"):
        return _dense(q_btnh, k_bskh, v_bskh, visible(k_pos_bs[:, None, :], q_pos_bt[:, :, None], opts.window),
                      opts, impl)


def attend_cache(q_btnh, k_bskh, v_bskh, q_pos_bt, live_b, opts: Options = Options(), tree=None):
    """`attend` against a cache buffer whose slot j holds the token at position j; no key past `live_b[b]`
    slots can be visible to row b. `tree` = (base_b, ancestor_btt): the queries are a draft tree's nodes,
    written at slots base_b + j; query i sees the committed slots below base_b and tree slot j iff
    ancestor_btt[b, i, j]."""
    impl = attention_impl(q_btnh.dtype, q_btnh.shape[-1])
    with jax.named_scope("attention"):
        if impl == "blocked":
            return _attend_blocks(q_btnh, k_bskh, v_bskh, q_pos_bt, opts, tree)
        k_bskh, v_bskh = k_bskh.astype(q_btnh.dtype), v_bskh.astype(q_btnh.dtype)
        visible_bts = _cache_visible(jnp.arange(k_bskh.shape[1], dtype=jnp.int32), q_pos_bt, opts.window, tree)
        return _dense(q_btnh, k_bskh, v_bskh, visible_bts, opts, impl, live_b)


def _dense(q_btnh, k_bskh, v_bskh, visible_bts, opts: Options, impl: str, live_b=None):
    """Attention under a dense mask: the plain dots, or `jax.nn.dot_product_attention` (which has
    no soft cap), reading only the first live_b[b] keys of row b when given."""
    if impl in ("plain", "blocked") or opts.softcap is not None:
        return _attend(q_btnh, k_bskh, v_bskh, visible_bts, opts)
    return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=visible_bts[:, None], scale=opts.scale,
                                        key_value_seq_lengths=live_b, implementation=impl)


def _cache_visible(slot_s, q_pos_bt, window: int | None, tree):
    """[b, t, s]: which cache slots each query sees (`attend_cache`)."""
    by_position = visible(slot_s, q_pos_bt[:, :, None], window)
    if tree is None:
        return by_position
    base_b, ancestor_btt = tree
    offset_bs = slot_s[None, :] - base_b[:, None]
    in_tree_bs = (offset_bs >= 0) & (offset_bs < ancestor_btt.shape[2])
    of_tree_bts = jnp.take_along_axis(ancestor_btt, jnp.clip(offset_bs, 0, ancestor_btt.shape[2] - 1)[:, None, :]
                                      .repeat(ancestor_btt.shape[1], axis=1), axis=2)
    return jnp.where(in_tree_bs[:, None], of_tree_bts, by_position & (offset_bs < 0)[:, None])


def attention_impl(dtype, head_dim: int) -> str:
    """The attention path `ATTENTION` selects for this dtype and head size."""
    if ATTENTION not in ("auto", "plain", "blocked", "xla", "cudnn"):
        raise ValueError(f"attention.ATTENTION must be auto, plain, blocked, xla or cudnn, got {ATTENTION!r}")
    if ATTENTION != "auto":
        return ATTENTION
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if jax.default_backend() == "gpu" and half and head_dim % 8 == 0 and head_dim <= 128 else "blocked"


def _grouped(q_btnh, kv_heads: int):
    """[b, t, n, h] -> [b, k, t * g, h]: each kv head's queries as rows (t-major)."""
    b, t, n, h = q_btnh.shape
    return q_btnh.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, -1, h)


def _ungrouped(out_bkmh, t: int):
    """The inverse of `_grouped`."""
    b, k, m, h = out_bkmh.shape
    return out_bkmh.reshape(b, k, t, m // t, h).transpose(0, 2, 1, 3, 4).reshape(b, t, -1, h)


_BATCH = ((0, 1), (0, 1))


def _attend(q_btnh, k_bskh, v_bskh, visible_bts, opts: Options):
    b, t, _, h = q_btnh.shape
    q_bkmh = _grouped(q_btnh, k_bskh.shape[2])
    k_bksh, v_bksh = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)
    scores = jax.lax.dot_general(q_bkmh, k_bksh, (((3,), (3,)), _BATCH), preferred_element_type=_F32)
    scores = _scores(scores.reshape(b, k_bksh.shape[1], t, -1, k_bksh.shape[2]), opts, h)
    scores = jnp.where(visible_bts[:, None, :, None, :], scores, jnp.finfo(_F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype).reshape(b, k_bksh.shape[1], q_bkmh.shape[2], -1)
    out = jax.lax.dot_general(probs, v_bksh, (((3,), (2,)), _BATCH), preferred_element_type=_F32)
    return _ungrouped(out, t).astype(q_btnh.dtype)


def _attend_blocks(q_btnh, k_bskh, v_bskh, q_pos_bt, opts: Options, tree=None):
    """Attention over the cache in blocks of `BLOCK` slots merged with an online softmax in float32: a static
    count, ceil(min(live_slots, s) / block), from the first block a query's window reaches (blocks past the
    buffer add nothing). Hidden keys get no weight even where a query sees nothing yet (its maximum still initial)."""
    b, t, _, h = q_btnh.shape
    s = k_bskh.shape[1]
    block = min(BLOCK, s)
    q_bkmh = _grouped(q_btnh, k_bskh.shape[2])
    g = q_bkmh.shape[2] // t
    q_pos_bm = jnp.repeat(q_pos_bt, g, axis=1)
    tree_m = None if tree is None else (tree[0], jnp.repeat(tree[1], g, axis=1))

    def step(i, carry):
        max_bkm, sum_bkm, acc_bkmh = carry
        j = first + i
        start = jnp.minimum(j * block, s - block)      # the last block may overlap the one before
        k_bksh, v_bksh = (jax.lax.dynamic_slice_in_dim(x, start, block, axis=1).transpose(0, 2, 1, 3)
                          .astype(q_btnh.dtype) for x in (k_bskh, v_bskh))
        scores = _scores(jax.lax.dot_general(q_bkmh, k_bksh, (((3,), (3,)), _BATCH), preferred_element_type=_F32),
                         opts, h)
        slot_s = start + jnp.arange(block, dtype=jnp.int32)
        visible_bms = (slot_s >= j * block) & _cache_visible(slot_s, q_pos_bm, opts.window, tree_m)
        scores = jnp.where(visible_bms[:, None], scores, jnp.finfo(_F32).min)
        new_max = jnp.maximum(max_bkm, scores.max(-1))
        probs = jnp.where(visible_bms[:, None], jnp.exp(scores - new_max[..., None]), 0.0)
        rescale = jnp.exp(max_bkm - new_max)
        pv = jax.lax.dot_general(probs.astype(v_bksh.dtype), v_bksh, (((3,), (2,)), _BATCH),
                                 preferred_element_type=_F32)
        return new_max, sum_bkm * rescale + probs.sum(-1), acc_bkmh * rescale[..., None] + pv

    shape = q_bkmh.shape[:3]
    init = (jnp.full(shape, jnp.finfo(_F32).min, _F32), jnp.zeros(shape, _F32), jnp.zeros(q_bkmh.shape, _F32))
    first = 0 if opts.window is None else jnp.maximum(jnp.min(q_pos_bt) - opts.window + 1, 0) // block
    count = -(-min(_LIVE_SLOTS.get() or s, s) // block)     # static: XLA knows the loop's trip count
    _, sum_bkm, acc_bkmh = jax.lax.fori_loop(0, count, step, init)
    return _ungrouped(acc_bkmh / sum_bkm[..., None], t).astype(q_btnh.dtype)
