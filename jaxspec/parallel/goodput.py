"""The goodput policy on two device slices: each lane step's plan, chosen on the target slice.

Shape key: b rows, j candidate plans (draft lengths 0..k, or with TETRIS 0..k + extra - 1 and
the TETRIS plan), c TETRIS budgets.

On one device the goodput policy runs segments of one plan each and chooses the next on device
(`jaxspec.engine.control`). On two slices every step is already stepped from the host
(`pipeline.SlicedRunner`), which reads each lane's done flags once a step, asynchronously. The
policy rides along: the lane's acceptance counts (`policy.PolicyState`) live on the target slice,
each verification updates them and, in the same program, chooses the lane's next plan
(`policy.choose_k`); the choice is copied to the host with the done flags and decides the plan of
the lane's next-but-one drafting, which is queued before that verification ends. So no step waits
for a host round trip, and the statistics behind a choice are one step older than on one device.
A plain step observes nothing and ages the counts (`policy.age`), so the optimism that re-probes
drafting grows back as on one device.

Step time per plan, per lane step: sequentially, a lane drafts and then verifies, so its step is
the sum of the two; pipelined, one lane's verification runs while the other lane drafts, so a
half-step (one lane's step) takes the longer of the two, plus whatever part of the shorter the
slices fail to overlap (`SliceTiming.overlap_miss`, learnt). The halves come from the cost model
(`lane_step_seconds`) or, by default, are timed on the slices at a shape's first call
(`SlicedRunner.measure_plans`), and then corrected online from the wall time between the host's
reads of consecutive verifications (`cost.StepTimeTracker`, one correction
per kind: drafting or not), taken only where every call in flight ran one plan and no refill or
first compilation fell in the interval.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import cost as cost_lib
from jaxspec import engine
from jaxspec import policy as policy_lib
from jaxspec.sampling import SamplingConfig

# How far the corrected step times may move before the device's copy is replaced, and the fewest
# timed lane steps between two copies: each is a host-to-device copy (0.1-0.4 ms of host time on
# XLA:CPU), and sent whenever a noisy lane step moved the times by 2%, they went out in 32 of 42
# steps of a pipelined call at batch 8 of the tiny-8L pair.
RESEND = 0.02
RESEND_EVERY = 8
# Observations skipped after a refill, a harvest or a program's first call: the interval then holds
# host work or a compilation, not steps.
SKIP_AFTER_EVENT = 2
# Weight of each timed pipelined lane step in the moving average of the overlap (`SliceTiming`),
# once 1 / OVERLAP_RATE of them have been averaged alike.
OVERLAP_RATE = 0.1


def lane_step_seconds(cost: cost_lib.CostModel, rows: int, ks, cache_len: int, pipelined: bool,
                      packed=None) -> np.ndarray:
    """Predicted seconds of one lane step of each draft length in `ks`, `rows` rows a lane.

    The drafter's side is its k positions plus what any drafting step pays besides (the cost
    model's speculation terms: the catch-up, the draft sampling); the target's side is the
    verification of rows * (k + 1) tokens (or, TETRIS, `packed[i]` tokens where given: the rows'
    pending tokens and the budget, attention still over k + 1 slots a row). Sequentially the two
    add up; pipelined, a lane's step is a half-step during which the other lane drafts, as long as
    the longer of the two.
    """
    seconds = []
    for i, k in enumerate(ks):
        tokens = rows * (k + 1) if packed is None or packed[i] is None else packed[i]
        draft = (cost.draft_seconds(rows, k) + cost.speculation_fixed + cost.speculation_per_row * rows) if k else 0.0
        verify = cost.verify_seconds(tokens, rows * cache_len, rows * (k + 1) * cache_len)
        seconds.append(max(draft, verify) if pipelined else draft + verify)
    return np.asarray(seconds, np.float64)


def nondecreasing(x) -> np.ndarray:
    """The least-squares non-decreasing fit to `x` (pool adjacent violators): each run of values
    that decreases is replaced by its mean."""
    blocks: list[list[float]] = []   # [mean, count]
    for value in np.asarray(x, np.float64):
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return np.concatenate([np.full(int(n), m) for m, n in blocks]) if blocks else np.zeros((0,))


@functools.lru_cache(maxsize=None)
def fresh_policy(sharding):
    """A jitted `PolicyState.init(rows, 0, seed=seed, live_b=live_b, positions=positions)` whose
    counts land with `sharding` (the target slice, replicated; None: where the inputs are): one
    program instead of a transfer per field."""
    def init(seed, live_b, *, rows, positions):
        return policy_lib.PolicyState.init(rows, 0, seed=seed, live_b=live_b, positions=positions)
    return jax.jit(init, static_argnames=("rows", "positions"), out_shardings=sharding)


class Tetris(NamedTuple):
    """The TETRIS plan among a two-slice goodput decoder's plans (static): its index, its draft
    length and the budgets C it chooses among (`policy.TetrisPlan` less the traced seconds)."""

    index: int
    draft_len: int
    capacities: tuple[int, ...]

    def plan(self, seconds_c) -> policy_lib.TetrisPlan:
        return policy_lib.TetrisPlan(self.index, self.draft_len, self.capacities, seconds_c)


@functools.partial(jax.jit, static_argnames=("ks", "tetris"))
def _opening(policy: policy_lib.PolicyState, live_b, seconds_j, seconds_c, remaining_b, draining, *, ks, tetris):
    return policy_lib.choose_k(policy, live_b, ks, seconds_j, optimistic=True, drain=(remaining_b, draining),
                               tetris=None if tetris is None else tetris.plan(seconds_c))


def opening_choice(seed, remaining_b, draining: bool, seconds_j, seconds_c, ks: tuple[int, ...], positions: int = 0,
                   tetris: Tetris | None = None) -> int:
    """The index of the plan a lane opens on (`ks`: the draft length each stands for): the best
    goodput at the optimistic estimate of rows seeded with `seed` (`policy.choose_k`; `positions`:
    as in `PolicyState.init`; `tetris`, with its budgets' seconds `seconds_c`, as in `choose_k`),
    judged, when `draining` (no request waits), by the rows' `remaining_b` tokens as the steps
    after it are (the drain rule; padding rows have none and are not live).

    Computed on the host's own device (this process's last CPU device: the host of a GPU or TPU
    machine, a device the meshes leave free on a CPU-only one) so that reading it waits for nothing
    queued on the slices: on the target slice it waited for the lanes' prefills."""
    host = jax.local_devices(backend="cpu")[-1]
    remaining_b = np.asarray(remaining_b, np.int32)
    seed, live_b, seconds_j, seconds_c, remaining_b, draining = jax.device_put(
        (np.asarray(seed, np.float32), remaining_b > 0, np.asarray(seconds_j, np.float32),
         np.asarray(seconds_c, np.float32), remaining_b, np.bool_(draining)), host)
    policy = fresh_policy(None)(seed, live_b, rows=live_b.shape[0], positions=positions)
    return int(_opening(policy, live_b, seconds_j, seconds_c, remaining_b, draining, ks=tuple(ks), tetris=tetris))


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "sampling", "out_len", "ks", "current", "tetris"),
                   donate_argnums=(4,))
def verify_and_choose(graphdef, plan, sampling: SamplingConfig, params, state, proposal, keys_b, max_new_b, eos_id,
                      budget, policy: policy_lib.PolicyState, seconds_j, seconds_c, draining, *, out_len: int,
                      ks: tuple[int, ...], current: int, tetris: Tetris | None = None):
    """A lane's verification by plan `current` (`engine.verify_phase`, observing acceptance into
    `policy`; the TETRIS plan picks its budget by goodput from `seconds_c`), then its next plan:
    the running one is kept unless another's predicted goodput beats it by the switch margin;
    while decoding plainly the estimate is the optimistic one (`choose_k`; `ks`: the draft length
    each plan stands for).
    `draining` (traced bool): no request waits for a slot, so a draft length is worth what it
    brings until the lane's slowest row is done (`policy.drain_tokens_per_step`): at batch 8 of
    the tiny-8L pair, 64 tokens a row, k = 1, 2 and 4 were within 4% of each other per step, and
    k = 4 took 15% longer over the call, most of it its last steps, where a few rows drafted on."""
    state = engine.verify_phase(graphdef, plan, sampling, params, state.replace(policy=policy), proposal, keys_b,
                                max_new_b, eos_id, out_len, budget,
                                capacity_seconds_j=seconds_c if plan.capacities is not None else None)
    policy = state.policy if plan.k else policy_lib.age(state.policy, 1)
    remaining_b = jnp.maximum(max_new_b - state.n_out_b, 0)
    choice = policy_lib.choose_k(policy, ~state.done_b, ks, seconds_j, optimistic=plan.k == 0, current=current,
                                 drain=(remaining_b, draining),
                                 tetris=None if tetris is None else tetris.plan(seconds_c))
    return state.replace(policy=None), policy.replace(choice=choice)


@functools.partial(jax.jit, donate_argnums=(0,))
def reseed_rows(policy: policy_lib.PolicyState, slots_r) -> policy_lib.PolicyState:
    """Refilled rows start from the lane's pooled acceptance (`policy.seed_acceptance`), as a
    refill on one device does (`engine.refill_on_device`)."""
    alpha, weight = policy_lib.seed_acceptance(policy.accepted_b + policy.seed_accepted_b, policy.evidence_b())
    return policy.replace(counts_2b=policy.counts_2b.at[:, slots_r].set(0.0, mode="drop"),
                          seed_accepted_b=policy.seed_accepted_b.at[slots_r].set(alpha * weight, mode="drop"),
                          seed_trials_b=policy.seed_trials_b.at[slots_r].set(weight, mode="drop"))


@dataclasses.dataclass
class SliceTiming:
    """What a decoder measured of one shape on its slices, kept across its calls.

    Attributes:
      draft_j, verify_j: each plan's drafting and verification, timed alone
        (`SlicedRunner.measure_plans`), seconds.
      verify_c: the TETRIS plan's verification at each of its budgets (empty without one); its
        drafting is the plan's.
      kinds: per plan, whether it drafts (the trackers' kinds).
      tetris: the TETRIS plan's index, or None.
      overlap_miss: the part of the shorter half a pipelined lane step does not hide behind the
        longer, learnt from timed lane steps: 0 where the slices really run at once (disjoint
        accelerators), near 1 where they share the host's cores. A moving average.
      trackers: per mode, the corrections of the planned lane-step times (`cost.StepTimeTracker`).
    """

    draft_j: np.ndarray
    verify_j: np.ndarray
    verify_c: np.ndarray
    kinds: tuple[bool, ...]
    modes: tuple[str, ...]
    tetris: int | None = None
    overlap_miss: float = 0.0
    overlap_steps: int = 0
    trackers: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.trackers = {mode: cost_lib.StepTimeTracker(self.planned(mode), kinds=list(self.kinds),
                                                        measured=[True] * len(self.kinds)) for mode in self.modes}

    def _combine(self, mode: str, draft, verify):
        """A lane step from its two halves: their sum sequentially; pipelined, the longer plus the
        unhidden part of the shorter."""
        if mode == "sequential":
            return draft + verify
        return np.maximum(draft, verify) + self.overlap_miss * np.minimum(draft, verify)

    def planned(self, mode: str) -> np.ndarray:
        """Seconds per lane step of each plan before the trackers' corrections."""
        return self._combine(mode, self.draft_j, self.verify_j)

    def capacities(self, mode: str) -> np.ndarray:
        """Seconds per lane step of the TETRIS plan at each budget, corrected as its plan is."""
        if self.tetris is None:
            return np.zeros((0,))
        tracker = self.trackers[mode]
        return self._combine(mode, self.draft_j[self.tetris], self.verify_c) * tracker.ratio()[self.tetris]

    def observe_overlap(self, j: int, seconds: float) -> None:
        """A pipelined lane step of plan j took `seconds`: moves `overlap_miss` toward what it
        shows, and re-plans the pipelined times with it (the tracker keeps what it measured)."""
        longer, shorter = max(self.draft_j[j], self.verify_j[j]), min(self.draft_j[j], self.verify_j[j])
        if shorter <= 0:
            return
        sample = float(np.clip((seconds - longer) / shorter, 0.0, 1.0))
        self.overlap_steps += 1
        self.overlap_miss += max(OVERLAP_RATE, 1.0 / self.overlap_steps) * (sample - self.overlap_miss)
        self.trackers["pipelined"].repredict(self.planned("pipelined"))


class SlicedGoodput:
    """The host's side of the goodput policy on two slices, for one decode call.

    Args:
      plans: the step plans (`StepPlan`s: draft lengths 0..k, or with TETRIS 0..k + extra - 1
        and the TETRIS plan).
      ks: the draft length each plan stands for in the goodput prediction (`Schedule.predict_ks`).
      cost: per mode ("pipelined", "sequential"), the cost model's `lane_step_seconds` of each
        plan. A pipelined call runs its tail (one lane left) sequentially (`to_sequential`).
      cost_c: per mode, the cost model's lane-step seconds of the TETRIS plan at each budget.
      put: places a host value on the target slice (replicated).
      timing: what the decoder measured of this shape at an earlier call (`SliceTiming`), or None.
      measure: with no timing, time each plan's two halves on the slices before the first step
        (`SlicedRunner.measure_plans`, then `measured`) and correct the lane-step times from the
        lane steps timed during the run. False: the cost model alone, as given
        (`SpecConfig.measure_plans=False`).
      acceptance: the seed of the lanes' rows (`policy.AcceptanceMemory.seed(positions)`).
      positions: draft positions whose acceptance is tracked (`Schedule.positions`; 0: none, the
        geometric model).
    """

    def __init__(self, plans, ks: tuple[int, ...], cost: dict[str, np.ndarray], cost_c: dict[str, np.ndarray], put,
                 *, timing: SliceTiming | None = None, measure: bool = True, acceptance=None, positions: int = 0):
        self.plans, self.ks, self.cost, self.cost_c = tuple(plans), tuple(ks), cost, cost_c
        self.timing, self._put = timing, put
        index = next((j for j, plan in enumerate(self.plans) if plan.capacities is not None), None)
        self.tetris = None if index is None else Tetris(index, self.plans[index].k, self.plans[index].capacities)
        self.positions = positions
        self.needs_measuring = measure and timing is None
        self.acceptance = acceptance
        self.mode = "pipelined" if "pipelined" in cost else "sequential"
        self.trace: list[int] = []                  # the draft length of each queued verification
        # Plans of the last calls queued, drafts and verifies: a read's interval is one lane step
        # of plan j where all of them ran j (pipelined, the other lane's drafting ran during it).
        self._recent = collections.deque(maxlen=4)
        self._last_read: float | None = None
        self._skip = SKIP_AFTER_EVENT
        self._used: set[tuple[str, int]] = set()
        self.observed = dict.fromkeys(cost, 0)   # lane steps timed per mode
        self._send()
        self.draining, self.draining_device = False, put(np.bool_(False))

    def set_draining(self, draining: bool) -> None:
        """Whether requests still wait for a slot (the drain rule, `verify_and_choose`)."""
        if draining != self.draining:
            self.draining, self.draining_device = draining, self._put(np.bool_(draining))

    def measured(self, draft_j, verify_j, verify_c) -> None:
        """Plans with the two halves' measured seconds (`SlicedRunner.measure_plans`) instead of the
        cost model's, from now on corrected from timed lane steps (a `SliceTiming`, which the
        decoder keeps for this shape's next calls)."""
        self.timing = SliceTiming(np.asarray(draft_j, np.float64), np.asarray(verify_j, np.float64),
                                  np.asarray(verify_c, np.float64), tuple(plan.k > 0 for plan in self.plans),
                                  tuple(self.cost), tetris=None if self.tetris is None else self.tetris.index)
        self.needs_measuring = False
        self._send()

    @property
    def tracker(self) -> cost_lib.StepTimeTracker | None:
        return None if self.timing is None else self.timing.trackers[self.mode]

    def seconds_j(self) -> np.ndarray:
        """Seconds per lane step of each plan the policy plans with now."""
        return self.tracker.corrected() if self.tracker is not None else self.cost[self.mode]

    def seconds_c(self) -> np.ndarray:
        """Seconds per lane step of the TETRIS plan at each budget the policy plans with now."""
        return self.timing.capacities(self.mode) if self.timing is not None else self.cost_c[self.mode]

    def report(self) -> dict[str, dict]:
        """Per mode: the cost model's seconds per lane step of each plan, those planned before
        corrections (from the halves measured on the slices at this shape's first call, where
        measured), the corrected ones, how many lane steps this call timed and the median relative
        error of the time the policy planned each of them at (measured / planned - 1); and the
        halves and the learnt overlap."""
        report = {}
        for mode, cost in self.cost.items():
            tracker = None if self.timing is None else self.timing.trackers[mode]
            errors = [measured / planned - 1.0 for _, _, planned, measured in (tracker.history if tracker else ())]
            report[mode] = {"cost_model": cost.tolist(),
                            "planned": (cost if tracker is None else tracker.predicted_j).tolist(),
                            "corrected": (cost if tracker is None else tracker.corrected()).tolist(),
                            "timed_steps": self.observed[mode],
                            "step_error": float(np.median(errors)) if errors else None}
            if self.tetris is not None:
                report[mode]["capacities"] = (self.cost_c[mode] if self.timing is None
                                              else self.timing.capacities(mode)).tolist()
        if self.timing is not None:
            report["halves"] = {"draft": self.timing.draft_j.tolist(), "verify": self.timing.verify_j.tolist(),
                                "verify_capacities": self.timing.verify_c.tolist(),
                                "overlap_miss": self.timing.overlap_miss}
        return report

    def _send(self) -> None:
        self._sent_j, self._since_sent = self.seconds_j(), 0
        self.seconds_device = self._put(np.asarray(self._sent_j, np.float32))
        self.capacity_seconds_device = self._put(np.asarray(self.seconds_c(), np.float32))

    def to_sequential(self) -> None:
        """The pipelined call's tail: one lane left, drafting and verifying in turn."""
        if self.mode != "sequential":
            self.mode = "sequential"
            self.event()
            self._send()

    def queued(self, phase: str, j: int, program: bool = True) -> None:
        """Notes a call of plan j queued (`program`: a compiled call, not a k = 0 drafting that runs
        nothing); a program's first call (its compilation on the host) spoils the next intervals."""
        self._recent.append(j)
        if program and (phase, j) not in self._used:
            self._used.add((phase, j))
            self.event()
        if phase == "verify":
            self.trace.append(self.plans[j].k)

    def event(self) -> None:
        """Host work between steps (a refill, a harvest): the next intervals are not steps alone."""
        self._skip = SKIP_AFTER_EVENT

    def read(self, now: float, j: int) -> None:
        """The host has just read a lane's last verification (plan j) at `now`: the time since
        the previous read is one lane step of plan j when every call in flight ran j."""
        last, self._last_read = self._last_read, now
        if self._skip:
            self._skip -= 1
            return
        if self.tracker is None or last is None or any(r != j for r in self._recent):
            return
        self.tracker.observe(j, 1, now - last)   # judged by the times planned with until now
        if self.mode == "pipelined":
            self.timing.observe_overlap(j, now - last)
        self.observed[self.mode] += 1
        self._since_sent += 1
        if self._since_sent >= RESEND_EVERY:
            if np.max(np.abs(self.seconds_j() / self._sent_j - 1.0)) > RESEND:
                self._send()
