"""Host-driven stepping over two device slices: sequential split, and MineDraft's two-batch pipeline.

Shape key: b rows, l sequence-buffer slots, k draft tokens, v vocabulary.

The draft and the target live on disjoint meshes, so one step is two compiled programs, the same
two halves the single-program loop composes (`step.draft_phase`, `step.verify_phase`):

    draft(state) on the draft slice  ->  Proposal  ->  verify(state, Proposal) on the target slice

Between them only token ids, lengths and (when sampling) the draft distributions cross: the
draft side reads the target side's `seq_bl`, pending positions and emitted counts; the target side
reads the Proposal. Every call is dispatched asynchronously. The one host read per step is a lane's
done flags, which decide whether to queue its next verification: they are copied to the host
asynchronously as soon as the verification producing them is queued, and read only after the
lane's next drafting (which depends on that verification anyway) is queued, so neither slice's
queue runs dry while the host looks.

Pipelined (`SpecConfig(pipeline=True)`): the requests are split into two batches A and B with
balanced work. Each half-step queues verify(A) on the target slice and then draft(B) on the draft
slice; they depend on nothing of each other, so they run at the same time; then the roles swap.
When one batch has finished, the other continues alone with the plain sequential order (the
tail). Per-request RNG keys make each request's output independent of its batch, so pipelined,
sequential and single-device runs produce the same tokens.

Under the goodput policy each verification also chooses its lane's next plan on the target slice
(`policy.choose`, with each plan's lane-step seconds from the cost model: `lane_step_seconds`);
the choice reaches the host with the done flags and sets the lane's next-but-one drafting.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import policy as policy_lib
from jaxspec.engine import loop, step
from jaxspec.parallel import sharding as sharding_lib
from jaxspec.policy.cost import CostModel
from jaxspec.sampling import SamplingConfig


def lane_step_seconds(cost: CostModel, rows: int, plans, cache_len: int, pipelined: bool) -> np.ndarray:
    """Predicted seconds of one lane step of each plan (`step.StepPlan`s): its drafting on the
    draft slice plus its verification on the target slice, or pipelined the longer of the two
    (the other lane's half runs meanwhile)."""
    out = []
    for plan in plans:
        tokens = rows * (plan.k + 1) if plan.capacity is None else rows + plan.capacity
        draft = cost.draft_seconds(rows, plan.k, plan.tree)
        verify = (cost.step_seconds(rows, plan.k, cache_len, packed_tokens=tokens, tree=plan.tree) - draft)
        out.append(max(draft, verify) if pipelined else draft + verify)
    return np.asarray(out, np.float32)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "cache_len", "seq_len", "out_len", "mesh"))
def _target_start(graphdef, sampling, params, tokens_bp, prompt_len_b, max_new_b, keys_b, eos_id, *,
                  cache_len, seq_len, out_len, mesh):
    return step.initial_state(graphdef, sampling, params, tokens_bp, prompt_len_b, max_new_b, keys_b, eos_id,
                                cache_len=cache_len, seq_len=seq_len, out_len=out_len, mesh=mesh)[0]


@functools.partial(jax.jit, static_argnames=("drafter", "cache_len"))
def _draft_start(drafter, params, tokens_bp, prompt_len_b, *, cache_len):
    return drafter.init(params, tokens_bp, prompt_len_b, cache_len)


@functools.partial(jax.jit, static_argnames=("drafter", "k", "sampling", "tree"), donate_argnums=(4,))
def _draft(drafter, k, sampling: SamplingConfig, params, draft_state, seq_bl, pending_b, n_out_b, keys_b, tree=None):
    proposal, draft_state = step.draft_phase(drafter, k, sampling, params, draft_state, seq_bl, pending_b,
                                               n_out_b, keys_b, tree)
    if sampling.greedy and tree is None:
        # Greedy acceptance never reads q: do not ship [b, k, v] floats across slices.
        proposal = proposal.replace(q_bkv=jnp.zeros(proposal.q_bkv.shape[:2] + (0,), jnp.float32))
    return proposal, draft_state


@functools.partial(jax.jit, static_argnames=("drafter", "cache_len"), donate_argnums=(2,))
def _draft_refill(drafter, params, draft_state, slots_r, tokens_rp, prompt_len_r, *, cache_len):
    fresh = drafter.init(params, tokens_rp, prompt_len_r, cache_len)
    return jax.tree.map(lambda old, new: old.at[slots_r].set(new, mode="drop"), draft_state, fresh)


# The target slice's refill prefills only the target's rows (the drafter's live on the other slice).
_TARGET_ONLY = loop.Schedule(plans=(step.StepPlan(k=0),))


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "sampling", "out_len", "plans", "current"),
                   donate_argnums=(4,))
def _verify(graphdef, plan, sampling, params, state, proposal, keys_b, max_new_b, eos_id, budget, seconds_j=None,
            draining=None, catch_up=None, *, out_len, plans=None, current=0):
    """Verification on the target slice; under the goodput policy (`plans` given) followed by the
    lane's next choice."""
    state = step.verify_phase(graphdef, plan, sampling, params, state, proposal, keys_b, max_new_b, eos_id, out_len,
                              budget)
    if plans is None:
        return state
    policy = state.policy if plan.k else policy_lib.age(state.policy, 1)
    choice = policy_lib.choose(policy, ~state.done_b, plans, seconds_j, current, max_new_b - state.n_out_b, draining,
                               catch_up)
    return state.replace(policy=policy.replace(choice=choice))


@functools.partial(jax.jit, static_argnames=("plans",))
def _open(state, prior, seconds_j, max_new_b, draining, *, plans):
    """The goodput policy's state and opening choice for a lane's fresh rows."""
    policy = policy_lib.PolicyState.init(state.done_b.shape[0], max(k for k, _ in plans), prior)
    choice = policy_lib.choose(policy, ~state.done_b, plans, seconds_j, None, max_new_b - state.n_out_b, draining)
    return state.replace(policy=policy.replace(choice=choice))


@dataclasses.dataclass
class Lane:
    """One batch of requests: its target-side state on the target slice, its draft state on the draft slice."""

    batch: object                  # its first PromptBatch (rows = slots)
    table: object                  # its batching.SlotTable: which request each row holds
    state: step.DecodeState
    draft_state: object
    keys_t: jax.Array              # request keys and budgets, on the target slice
    max_new_t: jax.Array
    keys_d: jax.Array              # request keys, on the draft slice
    budgets_t: tuple               # each plan's TETRIS budget C per step, on the target slice
    seed: int = 0
    cache_len: int = 0
    proposal: object = None
    finished: bool = False
    plan: int = 0                  # the plan (index into the runner's plans) of the lane's next drafting
    proposal_plan: int = 0         # the plan `proposal` was drafted for
    verifying_plan: int | None = None  # the plan of the verification in flight


class SlicedRunner:
    """Decodes batches with the target on `target_mesh` and the drafter on `draft_mesh`.

    `schedule`: the step shapes (`loop.Schedule`): one plan (a fixed policy), or the goodput
    policy's candidates, with `seconds` = {"pipelined": [j], "sequential": [j]} their predicted
    lane-step seconds (`lane_step_seconds`).
    """

    def __init__(self, target, drafter, schedule: loop.Schedule, sampling: SamplingConfig, target_mesh, draft_mesh,
                 seconds=None):
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self._static_drafter = drafter.static()   # what the compiled programs keep
        self.plans = schedule.plans
        self.goodput = schedule.policy_plans if schedule.goodput else None
        self.drafts = schedule.drafts
        self.target_mesh, self.draft_mesh = target_mesh, draft_mesh
        self._t_rep = sharding_lib.replicated(target_mesh)
        self._d_rep = sharding_lib.replicated(draft_mesh)
        self._seconds = seconds
        self._mode = "sequential"
        self.trace: list[int] = []   # goodput: the draft length of each verification
        # Set to {"draft": [], "verify": []} to time each call alone (blocking after it: no
        # overlap); the mesh sweep uses it to measure the two halves of a step.
        self.timings: dict[str, list[float]] | None = None

    def _timed(self, phase: str, start: float, result) -> None:
        if self.timings is not None:
            jax.block_until_ready(result)
            self.timings[phase].append(time.perf_counter() - start)

    def _to_target(self, tree):
        return jax.device_put(tree, self._t_rep)

    def _to_draft(self, tree):
        return jax.device_put(tree, self._d_rep)

    def start(self, table, batch, seed: int, eos: int, cache_len: int, budgets: tuple[int, ...]) -> Lane:
        """Prefills one batch on both slices; `budgets`: each plan's TETRIS budget C (0 for
        standard); `table` (a batching.SlotTable) refills its finished rows from the shared queue."""
        from jaxspec.engine.generate import request_keys

        keys_b = request_keys(seed, batch.request_ids_b)
        t_in = sharding_lib.put((batch.tokens_bp, batch.lengths_b, batch.max_new_b, keys_b, np.int32(eos),
                                 tuple(np.int32(c) for c in budgets)), self._t_rep)
        state = _target_start(self.target.graphdef, self.sampling, self.target.params, *t_in[:5], cache_len=cache_len,
                              seq_len=cache_len, out_len=batch.out_len, mesh=self.target_mesh)
        plan = 0
        if self.goodput is not None:
            state = _open(state, *self._to_target((np.float32(policy_lib.PRIOR_ALPHA), self._seconds_j(),
                                                   batch.max_new_b, np.bool_(not len(table.queue)))),
                          plans=self.goodput)
            plan = int(state.policy.choice)
        state.done_b.copy_to_host_async()
        d_tokens, d_lengths, keys_d = sharding_lib.put((batch.tokens_bp, batch.lengths_b, keys_b), self._d_rep)
        draft_state = (_draft_start(self._static_drafter, self.drafter.params, d_tokens, d_lengths, cache_len=cache_len)
                       if self.drafts else ())
        return Lane(batch=batch, table=table, state=state, draft_state=draft_state, keys_t=t_in[3],
                    max_new_t=t_in[2], keys_d=keys_d, budgets_t=t_in[5], seed=seed, cache_len=cache_len, plan=plan)

    def _seconds_j(self) -> np.ndarray:
        return self._seconds[self._mode]

    def _draft(self, lane: Lane) -> None:
        """Queues the lane's drafting (for plan `lane.plan`) on the draft slice, from its latest
        verified state."""
        lane.proposal_plan = lane.plan
        k = self.plans[lane.plan].k
        if k == 0:
            lane.proposal = step.empty_proposal(lane.batch.tokens_bp.shape[0])
            return
        s = lane.state
        if self.timings is not None:
            jax.block_until_ready(s)
        start = time.perf_counter()
        view = self._to_draft((s.seq_bl, s.target_cache.lengths, s.n_out_b))
        proposal, lane.draft_state = _draft(self._static_drafter, k, self.sampling, self.drafter.params,
                                            lane.draft_state, *view, lane.keys_d, tree=self.plans[lane.plan].tree)
        lane.proposal = self._to_target(proposal)
        self._timed("draft", start, lane.proposal)

    def _verify(self, lane: Lane, eos) -> None:
        """Queues the lane's verification on the target slice, unless every row has finished.

        The done flags read here belong to the lane's previous verification, whose host copy was
        started when it was queued; the drafting queued since depends on it anyway. When rows have
        finished and requests are waiting, the lane's rows are harvested and refilled first, and
        the lane drafts again (its drafts were made for the rows' previous occupants).
        """
        done_b = np.asarray(lane.state.done_b)
        if self.goodput is not None and lane.verifying_plan is not None:
            # The choice made with that verification: the lane's next drafting after the one queued.
            lane.plan = int(np.asarray(lane.state.policy.choice))
        if len(lane.table.queue) and np.any(done_b[:lane.table.slots] & (lane.table.request_at >= 0)):
            self._refill(lane, eos)
            done_b = np.asarray(lane.state.done_b)
        if bool(np.all(done_b)):
            self.harvest(lane)
            if not len(lane.table.queue):
                lane.finished = True
                return
            self._refill(lane, eos)
        start = time.perf_counter()
        j = lane.proposal_plan
        args = (self.target.graphdef, self.plans[j], self.sampling, self.target.params, lane.state, lane.proposal,
                lane.keys_t, lane.max_new_t, eos, lane.budgets_t[j])
        if self.goodput is None:
            lane.state = _verify(*args, out_len=lane.batch.out_len)
        else:
            self.trace.append(self.plans[j].k)
            # (The drafter's catch-up after plain steps runs on its own slice: not charged here.)
            lane.state = _verify(*args, *self._to_target((self._seconds_j(), np.bool_(not len(lane.table.queue)),
                                                          np.float32(0.0))),
                                 out_len=lane.batch.out_len, plans=self.goodput, current=j)
            lane.state.policy.choice.copy_to_host_async()
        lane.verifying_plan = j
        self._timed("verify", start, lane.state)
        lane.state.done_b.copy_to_host_async()

    def harvest(self, lane: Lane) -> list[int]:
        """Records the lane's finished requests (one host read of its outputs); returns freed slots."""
        s = lane.state
        return lane.table.harvest(*jax.device_get((s.done_b, s.out_bo, s.n_out_b, s.counters)))

    def _refill(self, lane: Lane, eos) -> None:
        """Moves queued requests into the lane's finished rows on both slices, then re-drafts."""
        from jaxspec.engine.generate import request_keys

        self.harvest(lane)
        refill = lane.table.refill()
        if refill is None:
            return
        slots_r, sub = refill
        keys_r = request_keys(lane.seed, sub.request_ids_b)
        rows = (slots_r, sub.tokens_bp, sub.lengths_b, sub.max_new_b, keys_r)
        t_slots, t_tokens, t_lengths, t_max_new, t_keys = sharding_lib.put(rows, self._t_rep)
        lane.state = loop.refill_on_device(
            self.target.graphdef, self._static_drafter, _TARGET_ONLY, self.sampling, self.target.params, (), lane.state,
            t_slots, t_tokens, t_lengths, t_max_new, t_keys, eos, cache_len=lane.cache_len, seq_len=lane.cache_len,
            out_len=lane.batch.out_len, mesh=self.target_mesh)
        lane.state.done_b.copy_to_host_async()
        lane.keys_t = loop.put_rows(lane.keys_t, t_slots, t_keys)
        lane.max_new_t = loop.put_rows(lane.max_new_t, t_slots, t_max_new)
        if self.drafts:
            d_slots, d_tokens, d_lengths, d_keys = sharding_lib.put((slots_r, sub.tokens_bp, sub.lengths_b, keys_r),
                                                                    self._d_rep)
            lane.draft_state = _draft_refill(self._static_drafter, self.drafter.params, lane.draft_state, d_slots,
                                             d_tokens, d_lengths, cache_len=lane.cache_len)
            lane.keys_d = loop.put_rows(lane.keys_d, d_slots, d_keys)
        self._draft(lane)

    def run(self, lanes: list[Lane], eos: int) -> list[Lane]:
        """Decodes one lane sequentially, or two pipelined, until every row is done."""
        eos_t = self._to_target(jnp.int32(eos))
        self._mode = "pipelined" if len(lanes) == 2 else "sequential"
        if len(lanes) == 1:
            self._sequential(lanes[0], eos_t)
        else:
            self._pipelined(*lanes, eos_t)
        return lanes

    def _sequential(self, lane: Lane, eos) -> None:
        while not lane.finished:
            self._draft(lane)
            self._verify(lane, eos)

    def _pipelined(self, a: Lane, b: Lane, eos) -> None:
        # Prologue: A's first drafts. Then every half-step queues verify(one) and draft(other),
        # which touch disjoint slices and run concurrently; then the roles swap.
        self._draft(a)
        verifying, drafting = a, b
        while not (a.finished or b.finished):
            self._verify(verifying, eos)
            self._draft(drafting)
            verifying, drafting = drafting, verifying
        # The tail: the batch left runs sequentially; `verifying` already holds fresh drafts.
        rest = b if a.finished else a
        self._mode = "sequential"
        if rest is not verifying:
            self._draft(rest)
        while not rest.finished:
            self._verify(rest, eos)
            if not rest.finished:
                self._draft(rest)


def balanced_split(budgets: np.ndarray, real: int) -> tuple[np.ndarray, np.ndarray]:
    """Two row sets of equal size (+-1) whose token budgets are as equal as a greedy pass makes them.

    MineDraft's assignment: requests in decreasing budget order each go to the batch with the
    smaller total so far (ties: the smaller batch), so both batches finish at about the same step.
    """
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
