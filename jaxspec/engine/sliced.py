"""Host-driven stepping over two device slices: sequential split, and MineDraft's two-batch pipeline.

Shape key: b rows, l sequence-buffer slots, k draft tokens, v vocabulary.

The draft and the target live on disjoint meshes, so one step is two compiled programs, the two
halves the single-program loop composes: `step.draft_phase` on the draft slice, whose Proposal
`step.verify_phase` verifies on the target slice. Only token ids, lengths and (when sampling) the
draft distributions cross. Every call is dispatched asynchronously; the one host read per step is
a lane's done flags (whether to queue its next verification), copied to the host as soon as the
verification producing them is queued and read only after the lane's next drafting is queued, so
neither slice's queue runs dry while the host looks.

Pipelined (`SpecConfig(pipeline=True)`): the requests are split into two batches A and B with
balanced work. Each half-step queues verify(A) on the target slice and draft(B) on the draft slice,
which run at the same time; then the roles swap. When one batch has finished, the other continues
alone. Per-request RNG keys make pipelined, sequential and single-device runs emit the same tokens.

Under the goodput policy each verification also chooses its lane's next plan on the target slice
(with each plan's lane-step seconds, `plans.plan_seconds`); the choice reaches the host with the
done flags and sets the lane's next-but-one drafting.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.engine import loop, segments, step
from jaxspec.engine.loop import Control, choose_plan
from jaxspec.engine.plans import TARGET_ONLY, Program
from jaxspec.engine.step import Requests
from jaxspec.parallel import sharding as sharding_lib
from jaxspec.policy import goodput as policy_lib


@functools.partial(jax.jit, static_argnames=("program",))
def _target_start(program: Program, params, requests: Requests, control: Control):
    """The target slice's prefill; under the goodput policy, the opening choice of the lane's plan."""
    state = step.initial_state(program, params[0], requests)[0]
    return loop.open_policy(program, state, control) if program.schedule.goodput else state


@functools.partial(jax.jit, static_argnames=("program",))
def _draft_start(program: Program, draft_params, requests: Requests):
    return program.drafter.init(draft_params, requests.tokens_bp, requests.prompt_len_b, program.cache_len)


@functools.partial(jax.jit, static_argnames=("program", "plan_index"), donate_argnums=(2,))
def _draft(program: Program, draft_params, draft_state, view: step.DraftView, plan_index: int):
    proposal, draft_state = step.draft_phase(program, program.schedule.plans[plan_index], draft_params, draft_state,
                                             view)
    if program.sampling.greedy and program.schedule.plans[plan_index].tree is None:
        # Greedy acceptance never reads q: do not ship [b, k, v] floats across slices.
        proposal = proposal.replace(q_bkv=jnp.zeros(proposal.q_bkv.shape[:2] + (0,), jnp.float32))
    return proposal, draft_state


@functools.partial(jax.jit, static_argnames=("program", "width"), donate_argnums=(2,))
def _draft_catch_up(program: Program, draft_params, draft_state, view: step.DraftView, width: int):
    return program.drafter.catch_up(draft_params, draft_state, view.seq_bl, view.pending_b, width)


@functools.partial(jax.jit, static_argnames=("program",), donate_argnums=(2,))
def _draft_refill(program: Program, draft_params, draft_state, slots_r, requests: Requests):
    fresh = program.drafter.init(draft_params, requests.tokens_bp, requests.prompt_len_b, program.cache_len)
    return jax.tree.map(lambda old, new: old.at[slots_r].set(new, mode="drop"), draft_state, fresh)


@functools.partial(jax.jit, static_argnames=("program", "plan_index"), donate_argnums=(2,))
def _verify(program: Program, params, state, proposal, control: Control, plan_index: int):
    """Verification on the target slice; under the goodput policy followed by the lane's next choice."""
    plan = program.schedule.plans[plan_index]
    state = step.verify_phase(program, plan, params, state, proposal, control.budget)
    if not program.schedule.goodput:
        return state
    if not plan.k:
        state = state.replace(policy=policy_lib.age(state.policy, 1))
    return state.replace(policy=state.policy.replace(choice=choose_plan(program, state, control, plan_index)))


@dataclasses.dataclass
class Lane:
    """One batch of requests: its target-side state on the target slice, its draft state on the draft slice."""

    batch: object                  # its first PromptBatch (rows = slots)
    table: object                  # its batching.SlotTable: which request each row holds
    state: step.DecodeState
    draft_state: object
    keys_d: jax.Array              # request keys, on the draft slice (the state holds the target slice's)
    budgets: tuple                 # each plan's TETRIS budget C per step
    seed: int = 0
    eos: int = 0
    proposal: object = None
    finished: bool = False
    plan: int = 0                  # the plan (index into the runner's plans) of the lane's next drafting
    proposal_plan: int = 0         # the plan `proposal` was drafted for
    verifying_plan: int | None = None  # the plan of the verification in flight
    behind: int = 0                # plain steps queued since the drafter last drafted (`Drafter.catch_up`)


class SlicedRunner:
    """Decodes batches with the target on `target_mesh` and the drafter on `draft_mesh`, running
    `program` (one plan, or the goodput policy's candidates with `seconds` = {"pipelined": [j],
    "sequential": [j]} their predicted lane-step seconds, `plans.plan_seconds`)."""

    def __init__(self, target, drafter, program: Program, target_mesh, draft_mesh, seconds=None):
        self.target, self.drafter, self.program = target, drafter, program
        self.plans, self.goodput = program.schedule.plans, program.schedule.goodput
        self._t_rep, self._d_rep = sharding_lib.replicated(target_mesh), sharding_lib.replicated(draft_mesh)
        self._seconds = seconds
        self._controls: dict[tuple, Control] = {}
        self._mode = "sequential"
        self.trace: list[int] = []   # goodput: the draft length of each verification
        self.timings: dict[str, list[float]] | None = None   # as `SpeculativeDecoder.phase_timings`

    def _timed(self, phase: str, start: float, result) -> None:
        if self.timings is not None:
            jax.block_until_ready(result)
            self.timings[phase].append(time.perf_counter() - start)

    def _control(self, queue, budget: int = 0):
        """A program's control on the target slice, placed once per value (the drafter's catch-up
        after plain steps runs on its own slice: not charged)."""
        key = (budget, not len(queue), self._mode)
        if key not in self._controls:
            seconds = dict(seconds_j=self._seconds[self._mode]) if self.goodput else {}
            self._controls[key] = sharding_lib.put(Control.of(budget=budget, draining=key[1], **seconds), self._t_rep)
        return self._controls[key]

    def _requests(self, batch, seed: int, eos: int, sharding):
        return sharding_lib.put(Requests.of(batch, seed, eos), sharding)

    def start(self, table, batch, seed: int, eos: int, budgets: tuple[int, ...]) -> Lane:
        """Prefills one batch on both slices; `budgets`: each plan's TETRIS budget C (0 for
        standard); `table` (a batching.SlotTable) refills its finished rows from the shared queue."""
        state = _target_start(self.program, (self.target.params, ()), self._requests(batch, seed, eos, self._t_rep),
                              self._control(table.queue))
        plan = int(state.policy.choice) if self.goodput else 0
        state.done_b.copy_to_host_async()
        d_requests = self._requests(batch, seed, eos, self._d_rep)
        draft_state = (_draft_start(self.program, self.drafter.params, d_requests) if self.program.schedule.drafts
                       else ())
        return Lane(batch=batch, table=table, state=state, draft_state=draft_state, keys_d=d_requests.keys_b,
                    budgets=tuple(budgets), seed=seed, eos=eos, plan=plan)

    def _draft(self, lane: Lane) -> None:
        """Queues the lane's drafting (for plan `lane.plan`) on the draft slice, from its latest verified state."""
        lane.proposal_plan = lane.plan
        if self.plans[lane.plan].k == 0:
            lane.proposal = step.empty_proposal(lane.batch.tokens_bp.shape[0])
            return
        s = lane.state
        if self.timings is not None:
            jax.block_until_ready(s)
        start = time.perf_counter()
        view = step.DraftView(*jax.device_put((s.seq_bl, s.target_cache.lengths, s.n_out_b), self._d_rep),
                              keys_b=lane.keys_d)
        if lane.behind:   # each plain step emitted at most one token per row
            width = segments.catch_up_width(lane.behind, self.program.cache_len)
            lane.draft_state, lane.behind = _draft_catch_up(self.program, self.drafter.params, lane.draft_state, view,
                                                            width), 0
        proposal, lane.draft_state = _draft(self.program, self.drafter.params, lane.draft_state, view, lane.plan)
        lane.proposal = jax.device_put(proposal, self._t_rep)
        self._timed("draft", start, lane.proposal)

    def _verify(self, lane: Lane) -> None:
        """Queues the lane's verification on the target slice, unless every row has finished; when
        rows have finished and requests wait, the lane's rows are harvested and refilled first, and
        the lane drafts again (its drafts were made for the rows' previous occupants)."""
        done_b = np.asarray(lane.state.done_b)
        if self.goodput and lane.verifying_plan is not None:
            # The choice made with that verification: the lane's next drafting after the one queued.
            lane.plan = int(np.asarray(lane.state.policy.choice))
        if len(lane.table.queue) and np.any(done_b[:lane.table.slots] & (lane.table.request_at >= 0)):
            self._refill(lane)
            done_b = np.asarray(lane.state.done_b)
        if bool(np.all(done_b)):
            self.harvest(lane)
            if not len(lane.table.queue):
                lane.finished = True
                return
            self._refill(lane)
        start = time.perf_counter()
        j = lane.proposal_plan
        if self.goodput:
            self.trace.append(self.plans[j].k)
        lane.state = _verify(self.program, (self.target.params, ()), lane.state, lane.proposal,
                             self._control(lane.table.queue, lane.budgets[j]), j)
        if self.goodput:
            lane.state.policy.choice.copy_to_host_async()
        lane.verifying_plan = j
        lane.behind += 0 if self.plans[j].k else 1
        self._timed("verify", start, lane.state)
        lane.state.done_b.copy_to_host_async()

    def harvest(self, lane: Lane) -> None:
        """Records the lane's finished requests (one host read of its outputs)."""
        s = lane.state
        lane.table.harvest(*jax.device_get((s.done_b, s.out_bo, s.n_out_b, s.counters)))

    def _refill(self, lane: Lane) -> None:
        """Moves queued requests into the lane's finished rows on both slices, then re-drafts."""
        self.harvest(lane)
        refill = lane.table.refill()
        if refill is None:
            return
        slots_r, sub = refill
        # The target slice refills its rows only (the drafter's live on the other slice).
        lane.state = loop.refill_on_device(dataclasses.replace(self.program, schedule=TARGET_ONLY),
                                           (self.target.params, ()), lane.state,
                                           sharding_lib.put(slots_r, self._t_rep),
                                           self._requests(sub, lane.seed, lane.eos, self._t_rep),
                                           self._control(lane.table.queue))[0]
        lane.state.done_b.copy_to_host_async()
        if self.program.schedule.drafts:
            d_slots = sharding_lib.put(slots_r, self._d_rep)
            d_requests = self._requests(sub, lane.seed, lane.eos, self._d_rep)
            lane.draft_state = _draft_refill(self.program, self.drafter.params, lane.draft_state, d_slots, d_requests)
            lane.keys_d = lane.keys_d.at[d_slots].set(d_requests.keys_b, mode="drop")
        self._draft(lane)

    def run(self, lanes: list[Lane]) -> None:
        """Decodes one lane sequentially, or two pipelined, until every row is done."""
        if len(lanes) == 1:
            self._sequential(lanes[0])
        else:
            self._pipelined(*lanes)

    def _sequential(self, lane: Lane, drafted: bool = False) -> None:
        self._mode = "sequential"
        if not drafted:
            self._draft(lane)
        while not lane.finished:
            self._verify(lane)
            if not lane.finished:
                self._draft(lane)

    def _pipelined(self, a: Lane, b: Lane) -> None:
        # Prologue: A's first drafts; then the half-steps of the module docstring.
        self._mode = "pipelined"
        self._draft(a)
        verifying, drafting = a, b
        while not (a.finished or b.finished):
            self._verify(verifying)
            self._draft(drafting)
            verifying, drafting = drafting, verifying
        # The tail: the batch left runs alone; `verifying` already holds fresh drafts.
        rest = b if a.finished else a
        self._sequential(rest, drafted=rest is verifying)


def balanced_split(budgets: np.ndarray, real: int) -> tuple[np.ndarray, np.ndarray]:
    """Two row sets of equal size (+-1) whose token budgets are as equal as a greedy pass makes them
    (MineDraft's): requests in decreasing budget order each go to the batch with the smaller total
    so far (ties: the smaller batch), so both batches finish at about the same step."""
    order = sorted(range(real), key=lambda i: -int(budgets[i]))
    sets: tuple[list[int], list[int]] = ([], [])
    totals = [0, 0]
    half = -(-real // 2)
    for i in order:
        side = 0 if (totals[0], len(sets[0])) <= (totals[1], len(sets[1])) else 1
        if len(sets[side]) >= half:
            side = 1 - side
        sets[side].append(i)
        totals[side] += int(budgets[i])
    return tuple(np.asarray(sorted(s), np.int64) for s in sets)
