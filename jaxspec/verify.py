"""Acceptance of draft windows: greedy matching and lossless rejection sampling.

Shape key: b rows, k draft tokens per row, v vocabulary.

Each row may use only the first `num_drafts_b` of its k drafts (TETRIS windows, rows whose
drafter had nothing to offer); the rest are never accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.sampling import SamplingConfig, probabilities, sample


def accepted_prefix(accept_bk: jax.Array) -> jax.Array:
    """Length of the leading run of True in each row."""
    return jnp.sum(jnp.cumprod(accept_bk.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def greedy_accept(draft_bk, target_logits_bkv, num_drafts_b):
    """Longest prefix of the first `num_drafts_b` drafts equal to the target's argmax (logits
    position j scores the token after draft j; j = 0: after the last committed token). Returns
    (accepted count [b], next token [b]: the correction at the first mismatch, or the bonus)."""
    k = draft_bk.shape[1]
    choice_bk1 = jnp.argmax(target_logits_bkv, axis=-1).astype(jnp.int32)
    usable_bk = jnp.arange(k)[None, :] < num_drafts_b[:, None]
    accepted_b = accepted_prefix((draft_bk == choice_bk1[:, :k]) & usable_bk)
    return accepted_b, jnp.take_along_axis(choice_bk1, accepted_b[:, None], axis=1)[:, 0]


def rejection_accept(key_b, draft_bk, q_bkv, target_logits_bkv, num_drafts_b, sampling: SamplingConfig):
    """Leviathan et al. / Chen et al. speculative sampling, per row: draft token x_j (drawn from q_j)
    is accepted with probability min(1, p_j(x_j) / q_j(x_j)). At the first rejection the next token
    is drawn from normalize(max(0, p_j - q_j)); after a full accept (of the row's usable drafts) the
    bonus token is drawn from p. The output then follows the target's distribution exactly, whatever
    q is (p and q go through the same `sampling` transforms). Returns (accepted count [b], next token [b]).
    """
    b, k = draft_bk.shape
    p_bkv = probabilities(target_logits_bkv, sampling)
    p_draft_bk = jnp.take_along_axis(p_bkv[:, :k], draft_bk[..., None], axis=-1)[..., 0]
    q_draft_bk = jnp.take_along_axis(q_bkv, draft_bk[..., None], axis=-1)[..., 0]
    accept_key_b, resample_key_b = jax.vmap(lambda key: tuple(jax.random.split(key)))(key_b)
    u_bk = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(accept_key_b)
    # u < p/q, written without a division so q = 0 (never drawn) cannot produce nan.
    usable_bk = jnp.arange(k)[None, :] < num_drafts_b[:, None]
    accepted_b = accepted_prefix((u_bk * q_draft_bk < p_draft_bk) & usable_bk)

    p_at_bv = jnp.take_along_axis(p_bkv, accepted_b[:, None, None], axis=1)[:, 0]
    q_pad_bkv = jnp.concatenate([q_bkv, jnp.zeros_like(q_bkv[:, :1])], axis=1)
    q_at_bv = jnp.take_along_axis(q_pad_bkv, accepted_b[:, None, None], axis=1)[:, 0]
    # After a full accept of the usable drafts the bonus comes from p itself.
    rejected_b = accepted_b < num_drafts_b
    residual_bv = jnp.where(rejected_b[:, None], jnp.maximum(p_at_bv - q_at_bv, 0.0), p_at_bv)
    mass_b = jnp.sum(residual_bv, axis=-1, keepdims=True)
    # A rejection implies p(x) < q(x), hence positive residual mass; guard rounding anyway.
    residual_bv = jnp.where(mass_b > 0, residual_bv / jnp.where(mass_b > 0, mass_b, 1.0), p_at_bv)
    return accepted_b, jax.vmap(sample)(resample_key_b, residual_bv)


def accept(key_b, draft_bk, q_bkv, target_logits_bkv, num_drafts_b, sampling: SamplingConfig):
    """Greedy matching when sampling is greedy, lossless rejection sampling otherwise."""
    if sampling.greedy:
        return greedy_accept(draft_bk, target_logits_bkv, num_drafts_b)
    return rejection_accept(key_b, draft_bk, q_bkv, target_logits_bkv, num_drafts_b, sampling)


def accept_tree(key_b, tokens_bw, parent_bw, used_bw, target_logits_bwv, sampling: SamplingConfig, depth: int,
                width: int):
    """Acceptance of a draft tree per row: the path the target's own choices follow, then one token.

    Column 0 is the root (the last committed token); target_logits_bwv[b, j] scores the token after
    column j. Greedy: follow the child equal to the target's argmax. Sampling (SpecInfer's rule with
    one-hot proposals, exact): at a node with target distribution p, try its children in column
    order; child x is accepted with probability p(x), else p <- normalize(p with x removed); with
    every child rejected the next token is drawn from what remains of p.

    parent_bw: each column's parent column (-1 at the root); used_bw: the verified columns (closed
    under ancestors); depth, width: static bounds on the path below the root and on a node's
    children. Returns (path [b, depth]: accepted columns, 0 past the count; count [b]; next token [b]).
    """
    b, w = tokens_bw.shape
    rows_b = jnp.arange(b)
    p_bwv = None if sampling.greedy else probabilities(target_logits_bwv, sampling)
    choice_bw = jnp.argmax(target_logits_bwv, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda key: jax.random.split(key, (depth + 1) * (width + 1)))(key_b)
    keys = keys.reshape(b, depth + 1, width + 1, *keys.shape[2:])   # [b, depth, sibling or final draw]
    cur_b, count_b, alive_b = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool)
    path_bd, final_b = jnp.zeros((b, depth), jnp.int32), jnp.zeros((b,), jnp.int32)
    for d in range(depth):
        # The first `width` verified children of the current node, in column order.
        order_bw = jnp.where(used_bw & (parent_bw == cur_b[:, None]), jnp.arange(w), w)
        child_bc = jnp.sort(order_bw, axis=1)[:, :width]
        valid_bc = (child_bc < w) & alive_b[:, None]
        child_bc = jnp.minimum(child_bc, w - 1)
        token_bc = jnp.take_along_axis(tokens_bw, child_bc, axis=1)
        if sampling.greedy:
            hit_bc = valid_bc & (token_bc == choice_bw[rows_b, cur_b][:, None])
        else:
            hit_bc, p_res_bv = _try_children(keys[:, d], token_bc, valid_bc, p_bwv[rows_b, cur_b])
            drawn_b = jax.vmap(sample)(keys[:, d, width], p_res_bv)   # used if the row stops here
            final_b = jnp.where(alive_b & ~hit_bc.any(1), drawn_b, final_b)
        alive_b = hit_bc.any(1)   # the row moves on to a child
        next_b = jnp.take_along_axis(child_bc, jnp.argmax(hit_bc, axis=1)[:, None], axis=1)[:, 0]
        path_bd = path_bd.at[:, d].set(jnp.where(alive_b, next_b, 0))
        count_b = count_b + alive_b
        cur_b = jnp.where(alive_b, next_b, cur_b)
    if sampling.greedy:
        return path_bd, count_b, choice_bw[rows_b, cur_b]
    # Rows that reached the depth bound draw their bonus token from p at their last node.
    bonus_b = jax.vmap(sample)(keys[:, depth, width], p_bwv[rows_b, cur_b])
    return path_bd, count_b, jnp.where(alive_b, bonus_b, final_b)


def _try_children(keys_bc, token_bc, valid_bc, p_bv):
    """One node's children as one-hot proposals, in order: child c is accepted with probability
    p(x_c), else x_c leaves p (renormalised). Returns (which child was accepted [b, c], what
    remains of p [b, v])."""
    rows_b = jnp.arange(p_bv.shape[0])
    hit_bc = jnp.zeros_like(valid_bc)
    for c in range(token_bc.shape[1]):
        x_b = token_bc[:, c]
        u_b = jax.vmap(jax.random.uniform)(keys_bc[:, c])
        trying_b = valid_bc[:, c] & ~hit_bc.any(1)
        hit_bc = hit_bc.at[:, c].set(trying_b & (u_b < p_bv[rows_b, x_b]))
        removed_bv = p_bv.at[rows_b, x_b].set(0.0)
        mass_b1 = removed_bv.sum(-1, keepdims=True)
        rejected_b = trying_b & ~hit_bc[:, c]
        p_bv = jnp.where(rejected_b[:, None] & (mass_b1 > 0), removed_bv / jnp.maximum(mass_b1, 1e-30), p_bv)
    return hit_bc, p_bv
