"""TETRIS: choose which draft tokens the target verifies, across the whole batch, under a budget.

Shape key: n rows, k draft slots per row.

Wu et al. (ACL 2025) verify at most C draft tokens per step over a batch. Slot j of a row is worth
the cumulative product a_1 * ... * a_j of per-token acceptance estimates (by default the draft's own
probability), which never increases along a row, so the paper's heap is one `lax.top_k` over the
grid flattened position-major: ties go to earlier positions (selections stay prefixes), and equal
confidences (an n-gram drafter) split the budget evenly across rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def cumulative_logprobs(draft_logprobs_nk):
    """log(a_1 * ... * a_j) per slot, with -inf from the first unusable slot of a row onwards.
    Estimates above 1 are clipped to 1 and nan counts as unusable, so the result never increases
    along a row whatever the surrogate returns."""
    lp = jnp.asarray(draft_logprobs_nk, jnp.float32)
    lp = jnp.where(jnp.isnan(lp), _NEG_INF, jnp.minimum(lp, 0.0))
    return jnp.cumsum(lp, axis=1)


def select(draft_logprobs, capacity: int, budget=None) -> jax.Array:
    """How many leading draft tokens of each row to verify, maximising expected acceptance.

    Args:
      draft_logprobs: float [n, k]: log of the estimated acceptance probability of each row's
        j-th draft token given its prefix; -inf marks slots that must not be verified.
      capacity: static int >= 0, the verification budget C: min(capacity, usable slots) are chosen.
      budget: optional traced int <= capacity: choose only this many (a per-step budget inside a
        program compiled for `capacity`).

    Returns:
      int32 [n] window lengths; each row's selected slots are its first `counts[i]` drafts.
    """
    lp = jnp.asarray(draft_logprobs)
    if lp.ndim != 2:
        raise ValueError(f"draft_logprobs must have shape [rows, slots], got shape {lp.shape}")
    # The slots are the nodes of chains: select_nodes' node-major order sends ties to earlier slots.
    return jnp.sum(select_nodes(cumulative_logprobs(lp), capacity, budget), axis=1, dtype=jnp.int32)


def select_nodes(cum_logprobs, capacity: int, budget=None, *, per_row: bool = False) -> jax.Array:
    """bool [n, t]: the nodes of each row's draft tree to verify, the `capacity` best of the whole
    batch (`budget` as in `select`) or, with `per_row`, of each row, by cumulative log-probability
    `cum_logprobs` [n, t] (ancestors numbered before descendants; -inf: not to be verified).

    A node's cumulative estimate never exceeds its parent's, so the best C nodes maximise the
    expected accepted tokens and include their ancestors (ties go to the lower index, an ancestor's).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be a static int >= 0, got {capacity!r}")
    cum_nt = jnp.asarray(cum_logprobs, jnp.float32)
    if cum_nt.ndim != 2:
        raise ValueError(f"cum_logprobs must have shape [rows, nodes], got shape {cum_nt.shape}")
    n, t = cum_nt.shape
    chosen = jnp.zeros((n, t), bool)
    if per_row:
        values, index = jax.lax.top_k(cum_nt, min(capacity, t))
        return chosen.at[jnp.arange(n)[:, None], index].set(values > _NEG_INF)
    top = min(capacity, n * t)
    if top == 0:
        return chosen
    values, index = jax.lax.top_k(cum_nt.T.reshape(-1), top)   # node-major: ties to lower node indices
    take = values > _NEG_INF
    if budget is not None:
        take &= jnp.arange(top) < budget
    return chosen.at[index % n, index // n].set(take)


def capacity_bucket(capacity: int, rows: int, slots: int) -> int:
    """The compiled size for a budget: a multiple of 8 (a few programs), never more than the grid."""
    return max(0, min(-(-capacity // 8) * 8, rows * slots))
