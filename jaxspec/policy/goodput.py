"""The goodput policy (TurboSpec / SmartSpec): each step runs the plan that maximises

    goodput(plan) = E[tokens the batch keeps] / predicted step seconds(plan)

Shape key: b rows, j plans, k draft positions.

- Plans are compiled step shapes `(k, budget)`: plain decoding (k = 0), standard windows (budget
  None) and TETRIS plans (the batch's best `budget` drafts).
- Expected tokens come from reach_bk, the chance that row b's j-th draft and its predecessors are
  accepted (`PolicyState.reach_bk`): a window of w drafts emits 1 + sum_{j<=w} reach_bk tokens.
- The rates are decayed counts on device (`PolicyState`): `observe` folds in each verified window;
  plain decoding observes nothing, so `age` fades them back toward an optimistic prior, and a
  batch that stopped drafting tries again.
- Predicted seconds come from a `CostModel` profiled on the machine that decodes.

`jaxspec.tools.policy_sim` runs these functions against simulated acceptance with a cost model as
the clock (`docs/results/policy_sim.md`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

PRIOR_ALPHA = 0.8   # acceptance assumed before a row has been observed (optimistic: drafting gets tried)
PRIOR_WEIGHT = 4.0  # trials the prior is worth (in the batch's rate; the batch's, in a row's and a slot's)
DECAY = 0.9         # per verified window: the counts are a moving average over about ten windows
OFF_DECAY = 0.97    # per plain step: how fast the evidence fades while nothing is observed
MARGIN = 0.04       # predicted gain a switch of plan must promise (a switch costs a host round trip)
DRAIN_QUANTILE = 0.9  # a draining batch is done when this share of its rows is (`tokens_and_steps`)
CHOOSE_EVERY = 4    # plain steps between two choices on device; a drafting plan chooses after every step
HORIZON = 16        # steps over which a plan's cost of starting (the drafter's catch-up) is spread while requests wait
CATCH_UP_CHUNK = 8  # tokens a drafter that fell behind feeds per forward (`drafting.base.feed_missing`)


def expected_tokens_per_step(alpha, k):
    """Tokens a row emits per verification with k drafts, each accepted with probability alpha:
    (1 - alpha^(k+1)) / (1 - alpha), the bonus/correction token included (k + 1 at alpha = 1)."""
    alpha = jnp.clip(jnp.asarray(alpha, jnp.float32), 0.0, 1.0)
    k = jnp.asarray(k, jnp.float32)
    safe = jnp.where(alpha < 1.0, alpha, 0.5)
    return jnp.where(alpha < 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe), k + 1.0)


@struct.dataclass
class PolicyState:
    """The policy's state on device (scalars: float32, but `choice`)."""

    accepted_b: jax.Array   # decayed accepted drafts per row
    tried_b: jax.Array      # decayed acceptance trials per row (accepted drafts plus the first rejection)
    accepted_k: jax.Array   # decayed accepted drafts per window slot, over the batch
    tried_k: jax.Array      # decayed trials per window slot (slot j is tried when all before it were accepted)
    prior: jax.Array        # the acceptance a row with no evidence is assumed to have
    behind: jax.Array       # tokens the drafter must feed before it drafts again (plain steps since it did)
    choice: jax.Array       # int32 index of the plan the next step runs
    free: PolicyState | None = None   # a hybrid drafter's: the counts of its free member's plans alone

    @classmethod
    def init(cls, b: int, slots: int, prior=PRIOR_ALPHA, free: bool = False) -> PolicyState:
        """Counts for `b` rows and windows of up to `slots` drafts (and apart for `free` plans)."""
        rows, window = jnp.zeros((b,), jnp.float32), jnp.zeros((max(slots, 1),), jnp.float32)
        return cls(accepted_b=rows, tried_b=rows, accepted_k=window, tried_k=window,
                   prior=jnp.asarray(prior, jnp.float32), behind=jnp.float32(0), choice=jnp.int32(0),
                   free=cls.init(b, slots, prior) if free else None)

    def alpha_b(self, live_b=None) -> jax.Array:
        """Each row's acceptance estimate: its counts shrunk toward the batch's (the live rows'
        mean counts, themselves shrunk toward the prior), as a row's few recent trials say little
        on their own. The batch's rate weighs one row's worth of evidence, so that it fades back to
        the prior after as many plain steps at any batch size."""
        live = jnp.ones(self.accepted_b.shape, bool) if live_b is None else live_b
        n = jnp.maximum(jnp.sum(live), 1)
        pooled = ((jnp.sum(jnp.where(live, self.accepted_b, 0.0)) / n + PRIOR_WEIGHT * self.prior)
                  / (jnp.sum(jnp.where(live, self.tried_b, 0.0)) / n + PRIOR_WEIGHT))
        return (self.accepted_b + PRIOR_WEIGHT * pooled) / (self.tried_b + PRIOR_WEIGHT)

    def reach_bk(self, live_b, k: int) -> jax.Array:
        """Probability that row b's j-th draft (j = 1..k) is accepted, its predecessors included: the
        cumulative product of alpha_b * slot_j / overall (deeper drafts are often harder), slot_j the
        batch's rate at slot j (shrunk toward overall) and overall its rate over every slot."""
        overall = ((jnp.sum(self.accepted_k) + PRIOR_WEIGHT * self.prior)
                   / (jnp.sum(self.tried_k) + PRIOR_WEIGHT))
        slot_k = (self.accepted_k + PRIOR_WEIGHT * overall) / (self.tried_k + PRIOR_WEIGHT)
        slot_k = jnp.concatenate([slot_k, jnp.full((max(k - slot_k.shape[0], 0),), overall)])[:k]
        accept_bk = jnp.clip(self.alpha_b(live_b)[:, None] * (slot_k / overall)[None, :], 0.0, 1.0)
        return jnp.cumprod(accept_bk, axis=1)

    def reset_rows(self, slots_r) -> PolicyState:
        """Rows `slots_r` hold new requests: they start from the prior (out-of-range slots: none)."""
        return self.replace(accepted_b=self.accepted_b.at[slots_r].set(0.0, mode="drop"),
                            tried_b=self.tried_b.at[slots_r].set(0.0, mode="drop"),
                            free=None if self.free is None else self.free.reset_rows(slots_r))


def observe(state: PolicyState, verified_b, accepted_b, live_b, decay: float = DECAY, free: bool = False):
    """Folds one verification into the counts: a row that verified v drafts and accepted a of
    them tried min(a + 1, v) drafts (slots 0..min(a, v - 1)). Rows that verified nothing keep
    their counts. A `free` plan's go to `state.free`; the costly drafters fall behind meanwhile."""
    if free:
        emitted = jnp.max(jnp.where(live_b, accepted_b + 1, 0)).astype(jnp.float32)
        return state.replace(free=observe(state.free, verified_b, accepted_b, live_b, decay),
                             behind=state.behind + emitted)
    seen_b = live_b & (verified_b > 0)
    accepted = jnp.minimum(accepted_b, verified_b).astype(jnp.float32)
    tried = jnp.minimum(accepted + 1.0, verified_b.astype(jnp.float32))
    slot_k = jnp.arange(state.tried_k.shape[0], dtype=jnp.float32)[None, :]
    seen = jnp.any(seen_b)
    return state.replace(accepted_b=jnp.where(seen_b, state.accepted_b * decay + accepted, state.accepted_b),
                         tried_b=jnp.where(seen_b, state.tried_b * decay + tried, state.tried_b),
                         accepted_k=jnp.where(seen, state.accepted_k * decay, state.accepted_k)
                         + jnp.sum((slot_k < accepted[:, None]) & seen_b[:, None], axis=0),
                         tried_k=jnp.where(seen, state.tried_k * decay, state.tried_k)
                         + jnp.sum((slot_k < tried[:, None]) & seen_b[:, None], axis=0),
                         behind=jnp.zeros_like(state.behind))


def age(state: PolicyState, steps, decay: float = OFF_DECAY) -> PolicyState:
    """The counts after `steps` plain steps (traced): they fade toward the prior, so a batch that
    stopped drafting because its acceptance was low is probed again once the evidence is old."""
    factor = jnp.asarray(decay, jnp.float32) ** jnp.asarray(steps, jnp.float32)
    return state.replace(accepted_b=state.accepted_b * factor, tried_b=state.tried_b * factor,
                         accepted_k=state.accepted_k * factor, tried_k=state.tried_k * factor,
                         behind=state.behind + jnp.asarray(steps, jnp.float32),
                         free=None if state.free is None else age(state.free, steps, decay))


def windows(reach_bk, live_b, plan) -> jax.Array:
    """Drafts each live row verifies in one step of `plan` = (k, budget): k for a standard window
    (budget None); for TETRIS, the row's share of the batch's `budget` slots of highest expected
    acceptance reach_bk[b, j] (`PolicyState.reach_bk`; a prefix of each row, as it falls along it)."""
    k, budget = plan
    if budget is None or k == 0:
        return jnp.where(live_b, k, 0).astype(jnp.int32)
    if budget == 0:
        return jnp.zeros(live_b.shape, jnp.int32)
    reach_bk = jnp.where(live_b[:, None], reach_bk[:, :k], -1.0)
    threshold = jax.lax.top_k(reach_bk.reshape(-1), min(budget, reach_bk.size))[0][-1]
    return jnp.sum((reach_bk >= threshold) & (reach_bk >= 0), axis=1).astype(jnp.int32)


def tokens_and_steps(reach_bk, live_b, plan, remaining_b=None) -> tuple[jax.Array, jax.Array]:
    """The live rows' expected tokens per step of `plan` (each 1 + sum of reach_bk over its
    window), and (given each row's tokens left) the expected steps until the batch's slowest rows
    are done: the `DRAIN_QUANTILE` over the live rows of tokens left over tokens per step (the
    single slowest row's estimate is the noisiest)."""
    window_b = windows(reach_bk, live_b, plan)
    j = jnp.arange(reach_bk.shape[1])[None, :]
    mean_b = 1.0 + jnp.sum(jnp.where(j < window_b[:, None], reach_bk, 0.0), axis=1)
    total = jnp.sum(jnp.where(live_b, mean_b, 0.0))
    if remaining_b is None:
        return total, None
    steps_b = jnp.sort(jnp.where(live_b, remaining_b / mean_b, -1.0))[::-1]
    return total, steps_b[jnp.floor((1.0 - DRAIN_QUANTILE) * jnp.sum(live_b)).astype(jnp.int32)]


def goodput(state: PolicyState, live_b, plans, seconds_j, remaining_b=None, draining=True, *,
            catch_up_seconds=0.0, free=(), forecast_bk=None) -> jax.Array:
    """Expected tokens per predicted second of each plan (float32 [j]).

    With requests waiting for slots (`draining` false, or no `remaining_b`), a finished row is
    refilled at once: the rate is the live rows' tokens per step over the step's seconds. A
    draining batch (no request waits) is done when its slowest rows are: the rate is the tokens
    left over the time until then. A drafting plan also pays once for the drafter's catch-up
    (one forward of `catch_up_seconds` per `CATCH_UP_CHUNK` tokens it is behind), spread over
    the steps to the batch's end, or over `HORIZON` steps while requests wait. `free` marks the plans
    of a hybrid drafter's free member alone: their own counts, no catch-up. `forecast_bk`, a free
    drafter's own estimate for its next drafts (`Drafter.forecast`), caps the reach of its plans (the
    free ones of a hybrid): where it proposes nothing or doubts, drafting is not worth its step."""
    free = tuple(free) or (False,) * len(plans)
    reach = [s.reach_bk(live_b, max(max(k for k, _ in plans), 1)) if s is not None else None
             for s in (state, state.free)]
    if forecast_bk is not None:
        capped = 0 if state.free is None else 1
        reach[capped] = jnp.minimum(reach[capped], forecast_bk[:, :reach[capped].shape[1]])
    seconds_j = jnp.asarray(seconds_j, jnp.float32)
    entry_j = jnp.where(jnp.asarray([k > 0 and not f for (k, _), f in zip(plans, free)]),
                        jnp.ceil(state.behind / CATCH_UP_CHUNK) * catch_up_seconds, 0.0)
    per_plan = [tokens_and_steps(reach[f], live_b, plan, remaining_b) for plan, f in zip(plans, free)]
    refilled_j = jnp.stack([tokens for tokens, _ in per_plan]) / (seconds_j + entry_j / HORIZON)
    if remaining_b is None:
        return refilled_j
    left = jnp.sum(jnp.where(live_b, remaining_b, 0).astype(jnp.float32))
    steps_j = jnp.maximum(jnp.stack([steps for _, steps in per_plan]), 1.0)
    return jnp.where(draining, left / (steps_j * seconds_j + entry_j), refilled_j)


def choose(state: PolicyState, live_b, plans, seconds_j, current=None, *, remaining_b=None, draining=True,
           catch_up_seconds=0.0, margin: float = MARGIN, free=(), forecast_bk=None) -> jax.Array:
    """The plan the next steps run (int32 index into `plans`, static (k, budget) pairs): the one of
    most `goodput`, but the running plan `current` (None: the opening choice) is kept unless another
    promises more than `margin` more (`jaxspec.tools.policy_sim` varies it to measure its worth)."""
    goodput_j = goodput(state, live_b, plans, seconds_j, remaining_b, draining, catch_up_seconds=catch_up_seconds,
                        free=free, forecast_bk=forecast_bk)
    best = jnp.argmax(goodput_j).astype(jnp.int32)
    if current is None:
        return best
    current = jnp.asarray(current, jnp.int32)
    return jnp.where(goodput_j[best] > goodput_j[current] * (1.0 + margin), best, current)
