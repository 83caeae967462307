"""Host-driven stepping over two device slices: sequential split, and MineDraft's two-batch pipeline.

Shape key: b rows, l sequence-buffer slots, k draft tokens, v vocabulary.

The draft and the target live on disjoint meshes, so one step is two compiled programs, the same
two halves the single-program loop composes (`engine.draft_phase`, `engine.verify_phase`):

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

Under the goodput policy each verification also chooses its lane's next plan on the target slice;
the choice reaches the host with the done flags and sets the lane's next-but-one drafting
(`jaxspec.parallel.goodput`).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import engine
from jaxspec.parallel import goodput as goodput_lib
from jaxspec.parallel import sharding as sharding_lib
from jaxspec.sampling import SamplingConfig


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "cache_len", "seq_len", "out_len", "mesh"))
def _target_start(graphdef, sampling, params, tokens_bp, prompt_len_b, max_new_b, keys_b, eos_id, *,
                  cache_len, seq_len, out_len, mesh):
    return engine.initial_state(graphdef, sampling, params, tokens_bp, prompt_len_b, max_new_b, keys_b, eos_id,
                                cache_len=cache_len, seq_len=seq_len, out_len=out_len, mesh=mesh)


@functools.partial(jax.jit, static_argnames=("drafter", "cache_len"))
def _draft_start(drafter, params, tokens_bp, prompt_len_b, *, cache_len):
    return drafter.init(params, tokens_bp, prompt_len_b, cache_len)


@functools.partial(jax.jit, static_argnames=("drafter", "k", "sampling"), donate_argnums=(4,))
def _draft(drafter, k, sampling: SamplingConfig, params, draft_state, seq_bl, pending_b, n_out_b, keys_b):
    proposal, draft_state = engine.draft_phase(drafter, k, sampling, params, draft_state, seq_bl, pending_b,
                                               n_out_b, keys_b)
    if sampling.greedy:
        # Greedy acceptance never reads q: do not ship [b, k, v] floats across slices.
        proposal = proposal.replace(q_bkv=jnp.zeros(proposal.q_bkv.shape[:2] + (0,), jnp.float32))
    return proposal, draft_state


@functools.partial(jax.jit, static_argnames=("drafter", "cache_len"), donate_argnums=(2,))
def _draft_refill(drafter, params, draft_state, slots_r, tokens_rp, prompt_len_r, *, cache_len):
    fresh = drafter.init(params, tokens_rp, prompt_len_r, cache_len)
    return jax.tree.map(lambda old, new: old.at[slots_r].set(new, mode="drop"), draft_state, fresh)


# The target slice's refill prefills only the target's rows (the drafter's live on the other slice).
_TARGET_ONLY = engine.Schedule(plans=(engine.StepPlan(k=0),))


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "sampling", "out_len"), donate_argnums=(4,))
def _verify(graphdef, plan, sampling, params, state, proposal, keys_b, max_new_b, eos_id, budget, *, out_len):
    return engine.verify_phase(graphdef, plan, sampling, params, state, proposal, keys_b, max_new_b, eos_id,
                               out_len, budget)


@dataclasses.dataclass
class Lane:
    """One batch of requests: its target-side state on the target slice, its draft state on the draft slice."""

    batch: object                  # its first PromptBatch (rows = slots)
    table: object                  # its batching.SlotTable: which request each row holds
    state: engine.DecodeState
    draft_state: object
    keys_t: jax.Array              # request keys and budgets, on the target slice
    max_new_t: jax.Array
    keys_d: jax.Array              # request keys, on the draft slice
    budget_t: jax.Array            # its TETRIS budget C per step, on the target slice
    seed: int = 0
    cache_len: int = 0
    proposal: object = None
    finished: bool = False
    plan: int = 0                  # the plan (index into the runner's plans) of the lane's next drafting
    proposal_plan: int = 0         # the plan `proposal` was drafted for
    verifying_plan: int | None = None  # the plan of the verification in flight
    policy: object = None          # goodput: the lane's acceptance counts and choice, on the target slice


class SlicedRunner:
    """Decodes batches with the target on `target_mesh` and the drafter on `draft_mesh`.

    `plans`: the step shapes: one (a fixed policy), or the goodput policy's (draft lengths, and
    with TETRIS its plan), whose host side `goodput` (a `goodput.SlicedGoodput`) picks each lane's.
    """

    def __init__(self, target, drafter, plans, sampling: SamplingConfig, target_mesh, draft_mesh, goodput=None):
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.plans = tuple(plans)
        self.goodput = goodput
        self.drafts = any(plan.k > 0 for plan in self.plans)
        self.target_mesh, self.draft_mesh = target_mesh, draft_mesh
        self._t_rep = sharding_lib.replicated(target_mesh)
        self._d_rep = sharding_lib.replicated(draft_mesh)
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

    def start(self, table, batch, seed: int, eos: int, cache_len: int, budget: int) -> Lane:
        """Prefills one batch on both slices; `budget` is its TETRIS budget C (0 for standard);
        `table` (a batching.SlotTable) refills its finished rows from the shared queue."""
        from jaxspec.generate import request_keys

        keys_b = request_keys(seed, batch.request_ids_b)
        t_in = sharding_lib.put((batch.tokens_bp, batch.lengths_b, batch.max_new_b, keys_b, np.int32(eos),
                                 np.int32(budget)), self._t_rep)
        state = _target_start(self.target.graphdef, self.sampling, self.target.params, *t_in[:5], cache_len=cache_len,
                              seq_len=cache_len, out_len=batch.out_len, mesh=self.target_mesh)
        state.done_b.copy_to_host_async()
        d_tokens, d_lengths, keys_d = sharding_lib.put((batch.tokens_bp, batch.lengths_b, keys_b), self._d_rep)
        draft_state = (_draft_start(self.drafter, self.drafter.params, d_tokens, d_lengths, cache_len=cache_len)
                       if self.drafts else ())
        lane = Lane(batch=batch, table=table, state=state, draft_state=draft_state, keys_t=t_in[3],
                    max_new_t=t_in[2], keys_d=keys_d, budget_t=t_in[5], seed=seed, cache_len=cache_len,
                    plan=0)
        if self.goodput is not None:
            # Rows start from the acceptance the decoder's earlier calls measured, if any.
            lane.policy = goodput_lib.fresh_policy(self._t_rep)(self.goodput.acceptance, batch.max_new_b > 0,
                                                                rows=batch.tokens_bp.shape[0],
                                                                positions=self.goodput.positions)
        return lane

    def measure_plans(self, lane: Lane, eos, passes: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Seconds of each plan's drafting (with the proposal's transfer to the target slice) and
        verification at this lane's shape, and of the TETRIS plan's verification at each of its
        budgets (forced by the budgets' seconds), on copies of the lane's state, each call timed
        alone and blocking: a first pass compiles, then the median over `passes` passes, each in
        another order (the machine's speed drifts), made non-decreasing in the draft length and
        the budget (`goodput.nondecreasing`: a longer window is no less work; over 3 passes at
        batch 8 on this CPU k = 4's verification came out below k = 3's, and the policy drafted 4
        where 3 was best). The TETRIS plan's own verification is its budget nearest N * k."""
        control, tetris = self.goodput, self.goodput.tetris
        jobs = [(j, None) for j in range(len(self.plans))]
        if tetris is not None:
            jobs += [(tetris.index, c) for c in range(len(tetris.capacities))]
        times = np.zeros((passes, len(jobs), 2))
        for p in range(passes + 1):
            order = np.roll(np.arange(len(jobs)), p) if p % 2 else np.roll(np.arange(len(jobs)), -p)[::-1]
            for i in order:
                times[max(p - 1, 0), i] = self._time_halves(lane, eos, *jobs[i])
        medians = np.median(times, axis=0)
        plans = len(self.plans)
        draft_j = goodput_lib.nondecreasing(medians[:plans, 0])
        verify_j, verify_c = medians[:plans, 1].copy(), goodput_lib.nondecreasing(medians[plans:, 1])
        standard = [j for j in range(plans) if tetris is None or j != tetris.index]
        verify_j[standard] = goodput_lib.nondecreasing(verify_j[standard])
        if tetris is not None:
            budget = lane.batch.tokens_bp.shape[0] * control.ks[tetris.index]
            verify_j[tetris.index] = verify_c[np.argmin(np.abs(np.asarray(tetris.capacities) - budget))]
        return draft_j, verify_j, verify_c

    def _time_halves(self, lane: Lane, eos, j: int, capacity: int | None) -> tuple[float, float]:
        """One drafting and verification of plan j (at its `capacity`-th budget, for TETRIS) from a
        copy of the lane's state, timed."""
        control = self.goodput
        seconds_c = control.capacity_seconds_device
        if capacity is not None:   # the budget the plan picks by goodput: make this one the only cheap one
            seconds_c = self._to_target(np.where(np.arange(len(control.tetris.capacities)) == capacity, 1e-6,
                                                 1e6).astype(np.float32))
        state, draft_state = jax.block_until_ready(jax.tree.map(jnp.copy, (lane.state, lane.draft_state)))
        k = self.plans[j].k
        start = time.perf_counter()
        proposal = engine.empty_proposal(lane.batch.tokens_bp.shape[0])
        if k:
            view = self._to_draft((state.seq_bl, state.target_cache.lengths, state.n_out_b))
            proposal, _ = _draft(self.drafter, k, self.sampling, self.drafter.params, draft_state, *view, lane.keys_d)
            proposal = jax.block_until_ready(self._to_target(proposal))
        middle = time.perf_counter()
        jax.block_until_ready(goodput_lib.verify_and_choose(
            self.target.graphdef, self.plans[j], self.sampling, self.target.params, state, proposal, lane.keys_t,
            lane.max_new_t, eos, lane.budget_t, lane.policy, control.seconds_device, seconds_c,
            control.draining_device, out_len=lane.batch.out_len, ks=control.ks, current=j, tetris=control.tetris))
        return middle - start, time.perf_counter() - middle

    def _open(self, lanes: list[Lane], eos) -> None:
        """Goodput: times the plans where this shape has not been timed, then each lane's opening
        plan (the best at the optimistic estimate of its rows' seeded acceptance)."""
        control = self.goodput
        if control.needs_measuring:
            control.measured(*self.measure_plans(lanes[0], eos))
        for lane in lanes:
            lane.plan = goodput_lib.opening_choice(control.acceptance, lane.batch.max_new_b,
                                                   not len(lane.table.queue), control.seconds_j(), control.seconds_c(),
                                                   control.ks, control.positions, control.tetris)

    def _draft(self, lane: Lane) -> None:
        """Queues the lane's drafting (for plan `lane.plan`) on the draft slice, from its latest
        verified state."""
        lane.proposal_plan = lane.plan
        k = self.plans[lane.plan].k
        if self.goodput is not None:
            self.goodput.queued("draft", lane.plan, program=k > 0)
        if k == 0:
            lane.proposal = engine.empty_proposal(lane.batch.tokens_bp.shape[0])
            return
        s = lane.state
        if self.timings is not None:
            jax.block_until_ready(s)
        start = time.perf_counter()
        view = self._to_draft((s.seq_bl, s.target_cache.lengths, s.n_out_b))
        proposal, lane.draft_state = _draft(self.drafter, k, self.sampling, self.drafter.params,
                                            lane.draft_state, *view, lane.keys_d)
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
        control = self.goodput
        if control is not None and lane.verifying_plan is not None:
            # The choice made with that verification: the lane's next drafting after the one queued.
            control.read(time.perf_counter(), lane.verifying_plan)
            lane.plan = int(np.asarray(lane.policy.choice))
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
                lane.keys_t, lane.max_new_t, eos, lane.budget_t)
        if control is None:
            lane.state = _verify(*args, out_len=lane.batch.out_len)
        else:
            control.queued("verify", j)
            control.set_draining(not len(lane.table.queue))
            lane.state, lane.policy = goodput_lib.verify_and_choose(
                *args, lane.policy, control.seconds_device, control.capacity_seconds_device, control.draining_device,
                out_len=lane.batch.out_len, ks=control.ks, current=j, tetris=control.tetris)
            lane.policy.choice.copy_to_host_async()
        lane.verifying_plan = j
        self._timed("verify", start, lane.state)
        lane.state.done_b.copy_to_host_async()

    def harvest(self, lane: Lane) -> list[int]:
        """Records the lane's finished requests (one host read of its outputs); returns freed slots."""
        s = lane.state
        if self.goodput is not None:
            self.goodput.event()
        return lane.table.harvest(*jax.device_get((s.done_b, s.out_bo, s.n_out_b, s.counters)))

    def _refill(self, lane: Lane, eos) -> None:
        """Moves queued requests into the lane's finished rows on both slices, then re-drafts."""
        from jaxspec.generate import request_keys

        self.harvest(lane)
        refill = lane.table.refill()
        if refill is None:
            return
        slots_r, sub = refill
        keys_r = request_keys(lane.seed, sub.request_ids_b)
        rows = (slots_r, sub.tokens_bp, sub.lengths_b, sub.max_new_b, keys_r)
        t_slots, t_tokens, t_lengths, t_max_new, t_keys = sharding_lib.put(rows, self._t_rep)
        lane.state = engine.refill_on_device(
            self.target.graphdef, self.drafter, _TARGET_ONLY, self.sampling, self.target.params, (), lane.state,
            t_slots, t_tokens, t_lengths, t_max_new, t_keys, eos, {"plans": None, "capacities": None},
            cache_len=lane.cache_len, seq_len=lane.cache_len, out_len=lane.batch.out_len, mesh=self.target_mesh)
        lane.state.done_b.copy_to_host_async()
        lane.keys_t = engine.put_rows(lane.keys_t, t_slots, t_keys)
        lane.max_new_t = engine.put_rows(lane.max_new_t, t_slots, t_max_new)
        if lane.policy is not None:
            lane.policy = goodput_lib.reseed_rows(lane.policy, t_slots)
        if self.drafts:
            d_slots, d_tokens, d_lengths, d_keys = sharding_lib.put((slots_r, sub.tokens_bp, sub.lengths_b, keys_r),
                                                                    self._d_rep)
            lane.draft_state = _draft_refill(self.drafter, self.drafter.params, lane.draft_state, d_slots, d_tokens,
                                             d_lengths, cache_len=lane.cache_len)
            lane.keys_d = engine.put_rows(lane.keys_d, d_slots, d_keys)
        self._draft(lane)

    def run(self, lanes: list[Lane], eos: int) -> list[Lane]:
        """Decodes one lane sequentially, or two pipelined, until every row is done."""
        eos_t = self._to_target(jnp.int32(eos))
        if self.goodput is not None:
            self._open(lanes, eos_t)
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
        if self.goodput is not None:
            self.goodput.to_sequential()
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
