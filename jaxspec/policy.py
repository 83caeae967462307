"""The goodput policy (TurboSpec / SmartSpec): each step runs the plan that maximises

    goodput(plan) = E[tokens the batch keeps] / predicted step seconds(plan)

Shape key: b rows, j plans, k draft positions.

- Plans are compiled step shapes: plain decoding (k = 0), standard windows (every row verifies k
  drafts) and TETRIS plans (D drafts per row, the batch's best C verified), written `(k, budget)`
  with budget None for a standard window.
- Expected tokens come from one acceptance rate per row, alpha_b, with the geometric model: a
  window of k drafts emits (1 - alpha^(k+1)) / (1 - alpha) tokens, the bonus included; a TETRIS
  plan emits one token per live row plus the C largest of alpha_b^j over the batch's (row, j)
  slots (the expected acceptance of the j-th draft of row b).
- alpha_b is a running estimate kept on device (`PolicyState`): decayed counts of each row's
  accepted drafts and acceptance trials, shrunk toward the batch's pooled rate (itself shrunk
  toward a prior, optimistic so that drafting gets tried). `observe` folds in each verified
  window. Plain decoding observes nothing, so `age` lets the counts fade back toward the prior and
  a batch that stopped drafting tries again after a while (a probe).
- With requests waiting, a finished row is refilled at once and the batch's rate is the sum of
  its rows'; a draining batch is done when its slowest rows are (`goodput`).
- A drafting plan entered after plain steps pays once for the drafter's catch-up on what it
  missed; `choose` leaves the running plan only for a predicted gain above `MARGIN` (hysteresis:
  a switch costs a host round trip).
- Predicted seconds come from a `CostModel` profiled on the machine that decodes
  (`CostModel.profile`).

Every engine calls these functions; `jaxspec.policy_sim` runs them against simulated acceptance
with a cost model as the clock, which is where each rule here earned its place
(`docs/results/policy_sim.md`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

PRIOR_ALPHA = 0.8   # acceptance assumed before a row has been observed (optimistic: drafting gets tried)
PRIOR_WEIGHT = 2.0  # how many trials the prior is worth (in the batch's rate; the batch's, in a row's)
DECAY = 0.9         # per verified window: the counts are a moving average over about ten windows
OFF_DECAY = 0.97    # per plain step: how fast the evidence fades while nothing is observed
MARGIN = 0.04       # predicted gain a switch of plan must promise
DRAIN_QUANTILE = 0.9  # a draining batch is done when this share of its rows is (`tokens_and_steps`)
CHOOSE_EVERY = 4    # steps between two choices on device (`jaxspec.engine.loop.run_on_device`)
HORIZON = 16        # steps over which a plan's cost of starting (the drafter's catch-up) is spread while requests wait
CATCH_UP_CHUNK = 8  # tokens a drafter that fell behind feeds per forward (`drafters.catch_up`)


def expected_tokens_per_step(alpha, k):
    """Tokens a row emits per verification with k drafts, each accepted with probability alpha:
    (1 - alpha^(k+1)) / (1 - alpha), the bonus/correction token included (k + 1 at alpha = 1)."""
    alpha = jnp.clip(jnp.asarray(alpha, jnp.float32), 0.0, 1.0)
    k = jnp.asarray(k, jnp.float32)
    safe = jnp.where(alpha < 1.0, alpha, 0.5)
    return jnp.where(alpha < 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe), k + 1.0)


@struct.dataclass
class PolicyState:
    """The policy's state on device.

    Attributes:
      accepted_b: decayed accepted drafts per row.
      tried_b: decayed acceptance trials per row (accepted drafts plus the first rejection).
      prior: the acceptance a row with no evidence is assumed to have (float32 scalar).
      behind: tokens the drafter has not seen (plain steps since it last drafted), which it must
        feed before it drafts again (float32 scalar).
      choice: index of the plan the next step runs (int32 scalar).
    """

    accepted_b: jax.Array
    tried_b: jax.Array
    prior: jax.Array
    behind: jax.Array
    choice: jax.Array

    @classmethod
    def init(cls, b: int, prior=PRIOR_ALPHA, behind=0.0) -> PolicyState:
        zeros = jnp.zeros((b,), jnp.float32)
        return cls(accepted_b=zeros, tried_b=zeros, prior=jnp.asarray(prior, jnp.float32),
                   behind=jnp.asarray(behind, jnp.float32), choice=jnp.int32(0))

    def alpha_b(self, live_b=None) -> jax.Array:
        """Each row's acceptance estimate: its counts shrunk toward the batch's (the live rows'
        pooled counts, themselves shrunk toward the prior): a row's few recent trials say little
        on their own, and the batch's slowest row decides when a draining batch is done."""
        live = jnp.ones(self.accepted_b.shape, bool) if live_b is None else live_b
        pooled = ((jnp.sum(jnp.where(live, self.accepted_b, 0.0)) + PRIOR_WEIGHT * self.prior)
                  / (jnp.sum(jnp.where(live, self.tried_b, 0.0)) + PRIOR_WEIGHT))
        return (self.accepted_b + PRIOR_WEIGHT * pooled) / (self.tried_b + PRIOR_WEIGHT)

    def reset_rows(self, slots_r) -> PolicyState:
        """Rows `slots_r` hold new requests: they start from the prior (out-of-range slots: none)."""
        return self.replace(accepted_b=self.accepted_b.at[slots_r].set(0.0, mode="drop"),
                            tried_b=self.tried_b.at[slots_r].set(0.0, mode="drop"))


def observe(state: PolicyState, verified_b, accepted_b, live_b, decay: float = DECAY) -> PolicyState:
    """Folds one verification into the counts: a row that verified v drafts and accepted a of
    them tried min(a + 1, v) drafts. Rows that verified nothing keep their counts."""
    seen_b = live_b & (verified_b > 0)
    accepted = jnp.minimum(accepted_b, verified_b).astype(jnp.float32)
    tried = jnp.minimum(accepted + 1.0, verified_b.astype(jnp.float32))
    return state.replace(accepted_b=jnp.where(seen_b, state.accepted_b * decay + accepted, state.accepted_b),
                         tried_b=jnp.where(seen_b, state.tried_b * decay + tried, state.tried_b),
                         behind=jnp.zeros_like(state.behind))


def age(state: PolicyState, steps, decay: float = OFF_DECAY) -> PolicyState:
    """The counts after `steps` plain steps (traced): they fade toward the prior, so a batch that
    stopped drafting because its acceptance was low is probed again once the evidence is old."""
    factor = jnp.asarray(decay, jnp.float32) ** jnp.asarray(steps, jnp.float32)
    return state.replace(accepted_b=state.accepted_b * factor, tried_b=state.tried_b * factor,
                         behind=state.behind + jnp.asarray(steps, jnp.float32))


def windows(alpha_b, live_b, plan) -> jax.Array:
    """Drafts each live row verifies in one step of `plan` = (k, budget): k for a standard window
    (budget None); for TETRIS, the row's share of the batch's `budget` slots with the highest
    expected acceptance alpha_b^j (a prefix of each row, as cumulative probabilities fall)."""
    k, budget = plan
    if budget is None or k == 0:
        return jnp.where(live_b, k, 0).astype(jnp.int32)
    reach_bk = jnp.where(live_b[:, None], alpha_b[:, None] ** jnp.arange(1, k + 1, dtype=jnp.float32)[None, :], -1.0)
    if budget == 0:
        return jnp.zeros(alpha_b.shape, jnp.int32)
    threshold = jax.lax.top_k(reach_bk.reshape(-1), min(budget, reach_bk.size))[0][-1]
    return jnp.sum((reach_bk >= threshold) & (reach_bk >= 0), axis=1).astype(jnp.int32)


def tokens_and_steps(alpha_b, live_b, plan, remaining_b=None) -> tuple[jax.Array, jax.Array]:
    """The live rows' expected tokens per step of `plan`, and (given each row's tokens left) the
    expected steps until the batch's slowest rows are done: the 90th percentile over the live
    rows of their tokens left over their tokens per step, rather than the maximum, as the single
    slowest row's estimate is the noisiest."""
    mean_b = expected_tokens_per_step(alpha_b, windows(alpha_b, live_b, plan))
    total = jnp.sum(jnp.where(live_b, mean_b, 0.0))
    if remaining_b is None:
        return total, None
    steps_b = jnp.sort(jnp.where(live_b, remaining_b / mean_b, -1.0))[::-1]
    return total, steps_b[jnp.floor((1.0 - DRAIN_QUANTILE) * jnp.sum(live_b)).astype(jnp.int32)]


def goodput(state: PolicyState, live_b, plans, seconds_j, remaining_b=None, draining=True,
            catch_up_seconds=0.0) -> jax.Array:
    """Expected tokens per predicted second of each plan (float32 [j]).

    With requests waiting for slots (`draining` false, or no `remaining_b`), a finished row is
    refilled at once: the rate is the live rows' tokens per step over the step's seconds. A
    draining batch (no request waits) is done when its slowest rows are: the rate is the tokens
    left over the time until then. A drafting plan also pays once for the drafter's catch-up
    (one forward of `catch_up_seconds` per `CATCH_UP_CHUNK` tokens it is behind), spread over
    the steps to the batch's end, or over `HORIZON` steps while requests wait."""
    alpha_b = state.alpha_b(live_b)
    seconds_j = jnp.asarray(seconds_j, jnp.float32)
    entry_j = jnp.where(jnp.asarray([k > 0 for k, _ in plans]),
                        jnp.ceil(state.behind / CATCH_UP_CHUNK) * catch_up_seconds, 0.0)
    per_plan = [tokens_and_steps(alpha_b, live_b, plan, remaining_b) for plan in plans]
    tokens_j = jnp.stack([tokens for tokens, _ in per_plan])
    refilled_j = tokens_j / (seconds_j + entry_j / HORIZON)
    if remaining_b is None:
        return refilled_j
    left = jnp.sum(jnp.where(live_b, remaining_b, 0).astype(jnp.float32))
    steps_j = jnp.maximum(jnp.stack([steps for _, steps in per_plan]), 1.0)
    return jnp.where(draining, left / (steps_j * seconds_j + entry_j), refilled_j)


def choose(state: PolicyState, live_b, plans, seconds_j, current=None, remaining_b=None, draining=True,
           catch_up_seconds=0.0, margin: float = MARGIN) -> jax.Array:
    """The plan the next steps run (int32 index into `plans`).

    Args:
      state: the acceptance estimate.
      live_b: rows still decoding.
      plans: static tuple of (k, budget) per plan.
      seconds_j: predicted seconds of one step of each plan at the batch's shape.
      current: the running plan (traced or static index), which is kept unless another promises
        more than `margin` more goodput; None: no plan is running (the opening choice).
      remaining_b: tokens each row has left, or None; draining (traced bool): no request waits
        for a slot, so the batch is judged by its slowest rows (`goodput`).
      catch_up_seconds: one forward of the drafter over the batch (`goodput`).
      margin: the hysteresis (`jaxspec.policy_sim` varies it to measure its worth).
    """
    goodput_j = goodput(state, live_b, plans, seconds_j, remaining_b, draining, catch_up_seconds)
    best = jnp.argmax(goodput_j).astype(jnp.int32)
    if current is None:
        return best
    current = jnp.asarray(current, jnp.int32)
    return jnp.where(goodput_j[best] > goodput_j[current] * (1.0 + margin), best, current)
