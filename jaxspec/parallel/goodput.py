"""The goodput policy on two device slices: each lane step's draft length, chosen on the target slice.

Shape key: b rows, j candidate plans (draft lengths 0..k).

On one device the goodput policy runs segments of one plan each and chooses the next on device
(`jaxspec.engine.control`). On two slices every step is already stepped from the host
(`pipeline.SlicedRunner`), which reads each lane's done flags once a step, asynchronously. The
policy rides along: the lane's acceptance counts (`policy.PolicyState`) live on the target slice,
each verification updates them and, in the same program, chooses the lane's next draft length
(`policy.choose_k`); the choice is copied to the host with the done flags and decides the draft
length of the lane's next-but-one drafting, which is queued before that verification ends. So no
step waits for a host round trip, and the statistics behind a choice are one step older than on
one device. A plain step observes nothing and ages the counts (`policy.age`), so the optimism that
re-probes drafting grows back as on one device.

Step time per plan, per lane step (`lane_step_seconds`): sequentially, a lane drafts and then
verifies, so its step is the sum of the two; pipelined, one lane's verification runs while the
other lane drafts, so a half-step (one lane's step) takes the longer of the two, and drafting is
free up to the verification's time. The cost model's predictions are corrected online from the
wall time between the host's reads of consecutive verifications (`cost.StepTimeTracker`, one
correction per kind: drafting or not), taken only where every call in flight ran one plan and no
refill or first compilation fell in the interval.
"""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np

from jaxspec import cost as cost_lib
from jaxspec import engine
from jaxspec import policy as policy_lib
from jaxspec.sampling import SamplingConfig

# How far the corrected step times may move before the device's copy is replaced (a host-to-device
# copy per change; the choice is a ratio of goodputs and moves little below this).
RESEND = 0.02
# Observations skipped after a refill, a harvest or a program's first call: the interval then holds
# host work or a compilation, not steps.
SKIP_AFTER_EVENT = 2


def lane_step_seconds(cost: cost_lib.CostModel, rows: int, ks, cache_len: int, pipelined: bool) -> np.ndarray:
    """Predicted seconds of one lane step of each draft length in `ks`, `rows` rows a lane.

    The drafter's side is its k positions plus what any drafting step pays besides (the cost
    model's speculation terms: the catch-up, the draft sampling); the target's side is the
    verification of rows * (k + 1) tokens. Sequentially the two add up; pipelined, a lane's step is
    a half-step during which the other lane drafts, as long as the longer of the two.
    """
    seconds = []
    for k in ks:
        draft = (cost.draft_seconds(rows, k) + cost.speculation_fixed + cost.speculation_per_row * rows) if k else 0.0
        verify = cost.verify_seconds(rows * (k + 1), rows * cache_len, rows * (k + 1) * cache_len)
        seconds.append(max(draft, verify) if pipelined else draft + verify)
    return np.asarray(seconds, np.float64)


@functools.partial(jax.jit, static_argnames=("ks",))
def opening_choice(policy: policy_lib.PolicyState, live_b, seconds_j, *, ks):
    """The draft length a lane opens on: the best goodput at the prior's optimistic estimate."""
    return policy_lib.choose_k(policy, live_b, ks, seconds_j, optimistic=True)


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "sampling", "out_len", "ks"), donate_argnums=(4,))
def verify_and_choose(graphdef, plan, sampling: SamplingConfig, params, state, proposal, keys_b, max_new_b, eos_id,
                      budget, policy: policy_lib.PolicyState, seconds_j, *, out_len: int, ks: tuple[int, ...]):
    """A lane's verification (`engine.verify_phase`, observing acceptance into `policy`), then its
    next draft length: the running plan's is kept unless another's predicted goodput beats it by
    the switch margin; while decoding plainly the estimate is the optimistic one (`choose_k`)."""
    state = engine.verify_phase(graphdef, plan, sampling, params, state.replace(policy=policy), proposal, keys_b,
                                max_new_b, eos_id, out_len, budget)
    policy = state.policy if plan.k else policy_lib.age(state.policy, 1)
    choice = policy_lib.choose_k(policy, ~state.done_b, ks, seconds_j, optimistic=plan.k == 0,
                                 current=ks.index(plan.k))
    return state.replace(policy=None), policy.replace(choice=choice)


@functools.partial(jax.jit, donate_argnums=(0,))
def reseed_rows(policy: policy_lib.PolicyState, slots_r) -> policy_lib.PolicyState:
    """Refilled rows start from the lane's pooled acceptance (`policy.seed_acceptance`), as a
    refill on one device does (`engine.refill_on_device`)."""
    alpha, weight = policy_lib.seed_acceptance(policy.accepted_b + policy.seed_accepted_b, policy.evidence_b())
    return policy.replace(counts_2b=policy.counts_2b.at[:, slots_r].set(0.0, mode="drop"),
                          seed_accepted_b=policy.seed_accepted_b.at[slots_r].set(alpha * weight, mode="drop"),
                          seed_trials_b=policy.seed_trials_b.at[slots_r].set(weight, mode="drop"))


class SlicedGoodput:
    """The host's side of the goodput policy on two slices, for one decode call.

    Args:
      ks: the candidate draft lengths (0..k).
      predicted: per mode ("pipelined", "sequential"), `lane_step_seconds` of each draft length.
        A pipelined call runs its tail (one lane left) sequentially (`to_sequential`).
      trackers: per mode, the decoder's `cost.StepTimeTracker` for this shape (kept across calls),
        or None to plan with the cost model alone (`SpecConfig.measure_plans=False`).
      put: places a host value on the target slice (replicated).
    """

    def __init__(self, ks: tuple[int, ...], predicted: dict[str, np.ndarray],
                 trackers: dict[str, cost_lib.StepTimeTracker] | None, put):
        self.ks, self.predicted, self.trackers, self._put = tuple(ks), predicted, trackers, put
        self.mode = "pipelined" if "pipelined" in predicted else "sequential"
        self.trace: list[int] = []                  # the draft length of each queued verification
        # Draft lengths of the last calls queued, drafts and verifies: a read's interval is one
        # lane step of plan k where all of them ran k (pipelined, the other lane's drafting ran
        # during it).
        self._recent = collections.deque(maxlen=4)
        self._last_read: float | None = None
        self._skip = SKIP_AFTER_EVENT
        self._used: set[tuple[str, int]] = set()
        self.observed = 0
        self._send(self.seconds_j())

    @property
    def tracker(self) -> cost_lib.StepTimeTracker | None:
        return None if self.trackers is None else self.trackers[self.mode]

    def seconds_j(self) -> np.ndarray:
        """Seconds per lane step of each draft length the policy plans with now."""
        return self.tracker.corrected() if self.tracker is not None else self.predicted[self.mode]

    def _send(self, seconds_j: np.ndarray) -> None:
        self._sent_j = seconds_j
        self.seconds_device = self._put(np.asarray(seconds_j, np.float32))

    def to_sequential(self) -> None:
        """The pipelined call's tail: one lane left, drafting and verifying in turn."""
        if self.mode != "sequential":
            self.mode = "sequential"
            self.event()
            self._send(self.seconds_j())

    def queued(self, phase: str, k: int, program: bool = True) -> None:
        """Notes a call queued (`program`: a compiled call, not a k = 0 drafting that runs
        nothing); a program's first call (its compilation on the host) spoils the next intervals."""
        self._recent.append(k)
        if program and (phase, k) not in self._used:
            self._used.add((phase, k))
            self.event()
        if phase == "verify":
            self.trace.append(k)

    def event(self) -> None:
        """Host work between steps (a refill, a harvest): the next intervals are not steps alone."""
        self._skip = SKIP_AFTER_EVENT

    def read(self, now: float, k: int) -> None:
        """The host has just read a lane's last verification (plan `k`) at `now`: the time since
        the previous read is one lane step of plan k when every call in flight ran k."""
        last, self._last_read = self._last_read, now
        if self._skip:
            self._skip -= 1
            return
        if self.tracker is None or last is None or any(r != k for r in self._recent):
            return
        self.tracker.observe(self.ks.index(k), 1, now - last)
        self.observed += 1
        seconds_j = self.tracker.corrected()
        if np.max(np.abs(seconds_j / self._sent_j - 1.0)) > RESEND:
            self._send(seconds_j)
