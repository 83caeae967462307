"""Acceptance of draft windows: greedy matching and lossless rejection sampling.

Shape key: b rows, k draft tokens per row, v vocabulary.

Pure functions of the draft tokens, the draft distributions q and the target logits; no caches.
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
    """Longest prefix equal to the target's argmax, then the target's own token.

    Args:
      draft_bk: int [b, k] draft tokens.
      target_logits_bkv: [b, k + 1, v]: position j scores the token after draft j (j = 0: after
        the last committed token).
      num_drafts_b: int [b]: how many leading drafts of each row may be accepted.

    Returns:
      (accepted count [b], next token [b]): the correction at the first mismatch, or the bonus.
    """
    k = draft_bk.shape[1]
    choice_bk1 = jnp.argmax(target_logits_bkv, axis=-1).astype(jnp.int32)
    usable_bk = jnp.arange(k)[None, :] < num_drafts_b[:, None]
    accepted_b = accepted_prefix((draft_bk == choice_bk1[:, :k]) & usable_bk)
    return accepted_b, jnp.take_along_axis(choice_bk1, accepted_b[:, None], axis=1)[:, 0]


def rejection_accept(key_b, draft_bk, q_bkv, target_logits_bkv, num_drafts_b, sampling: SamplingConfig):
    """Leviathan et al. / Chen et al. speculative sampling, per row.

    Draft token x_j (drawn from q_j) is accepted with probability min(1, p_j(x_j) / q_j(x_j)).
    At the first rejection the next token is drawn from normalize(max(0, p_j - q_j)); after a full
    accept (of the row's usable drafts) the bonus token is drawn from p. The output then follows
    the target's distribution exactly, whatever q is. p goes through the same transforms as q.

    Args:
      key_b: one PRNG key per row.
      draft_bk: int [b, k] draft tokens.
      q_bkv: float [b, k, v] draft distributions the tokens were drawn from (one-hot for a
        deterministic drafter).
      target_logits_bkv: [b, k + 1, v] target logits.
      num_drafts_b: int [b] usable drafts per row.
      sampling: the SamplingConfig applied to the target logits (the draft used the same).

    Returns:
      (accepted count [b], next token [b]).
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
    next_b = jax.vmap(sample)(resample_key_b, residual_bv)
    return accepted_b, next_b


def accept(key_b, draft_bk, q_bkv, target_logits_bkv, num_drafts_b, sampling: SamplingConfig):
    """Greedy matching when sampling is greedy, lossless rejection sampling otherwise."""
    if sampling.greedy:
        return greedy_accept(draft_bk, target_logits_bkv, num_drafts_b)
    return rejection_accept(key_b, draft_bk, q_bkv, target_logits_bkv, num_drafts_b, sampling)
