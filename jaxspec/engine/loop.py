"""The decode loops on device, each one compiled program over the step (`jaxspec.engine.step`).

`start_on_device` prefills a batch (target and drafter) and, under the goodput policy, makes the
opening choice; `run_on_device` runs steps in a `lax.while_loop` (a fixed policy's whole call, or
one goodput segment of one plan); `refill_on_device` prefills new requests into finished rows;
`plain_call_on_device` is a goodput call that decodes plainly throughout, in one program, and
`drafting_call_on_device` one that runs one standard drafting plan throughout.
Statistics are counters in the loop state, read once a segment. Under the goodput policy each
plan of a `Schedule` is a program of its own, and the policy chooses the next one on device at
the end of a segment's steps. `time_steps` times one step in such a loop, for the profiler.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import policy as policy_lib
from jaxspec import prompts as prompts_lib
from jaxspec.drafters import Drafter
from jaxspec.engine.step import DecodeState, StepPlan, initial_state, plain_step, speculative_step
from jaxspec.generate import request_keys
from jaxspec.models.model import Model
from jaxspec.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which step shapes a decode loop may run.

    One plan: every step runs it (fixed policy). Several: the goodput policy picks the plan of each
    segment (each plan is a program of its own: `run_on_device`); `predict_ks` is the draft length
    each plan stands for in the goodput prediction.
    """

    plans: tuple[StepPlan, ...]
    predict_ks: tuple[int, ...] | None = None
    choose_every: int = 4   # goodput: a drafting segment's steps between choices (`SpecConfig.choose_every`)
    # Goodput: draft positions whose acceptance the policy tracks (`PolicyState.profile_p`); 0: none.
    positions: int = 0

    @property
    def drafts(self) -> bool:
        return any(plan.k > 0 for plan in self.plans)

    @property
    def tetris_index(self) -> int | None:
        """The goodput policy's TETRIS plan (the one that searches budgets), if any."""
        return next((j for j, plan in enumerate(self.plans) if plan.capacities is not None), None)

_STATIC = ("target_graphdef", "drafter", "schedule", "sampling", "cache_len", "seq_len", "out_len", "mesh")


def _fresh_rows(target_graphdef, drafter: Drafter, schedule: Schedule, sampling: SamplingConfig, target_params,
                draft_params, tokens_bp, prompt_len_b, max_new_b, request_keys_b, eos_id, seconds, next_choice=None,
                acceptance=None, draining=None, *, cache_len: int, seq_len: int, out_len: int,
                mesh=None) -> DecodeState:
    """Loop state for freshly prefilled rows: target and drafter caches, policy counts, and the
    policy's first choice.

    Goodput policy: `acceptance` = (alpha, weight[, memory trials]) seeds the live rows' acceptance counts
    (`policy.seed_acceptance`; None: the bare prior); `draining` (traced bool; None: unset) says
    no request waits for a slot, so the opening plan is judged by when the slowest row will be
    done (`policy.drain_tokens_per_step`). When the next plan is plain decoding (the opening
    choice, or `next_choice`, the running batch's, for rows refilled into it; negative: no row is
    running, the opening choice decides) the drafter starts
    from `init_deferred` and catches up if and when drafting starts.
    """
    state = initial_state(target_graphdef, sampling, target_params, tokens_bp, prompt_len_b, max_new_b,
                          request_keys_b, eos_id, cache_len=cache_len, seq_len=seq_len, out_len=out_len, mesh=mesh)
    if schedule.predict_ks is not None:
        drain = _drain(state.n_out_b, max_new_b, draining)
        policy = policy_lib.PolicyState.init(tokens_bp.shape[0], 0, seed=acceptance, live_b=~state.done_b,
                                             positions=schedule.positions)
        # Drafting from the start costs the drafter's prefill of the prompts (plain decoding defers it).
        backlog_b = prompt_len_b
        policy = policy.replace(choice=policy_lib.opening_choice(
            policy, ~state.done_b, schedule.predict_ks, seconds["plans"], drain,
            entry_seconds=policy_lib.draft_entry_seconds(seconds["position"], backlog_b, ~state.done_b),
            switch_seconds=seconds["round_trip"], tetris=_tetris_plan(schedule, seconds)))
        state = state.replace(policy=_with_hold(policy, ~state.done_b, schedule, seconds, backlog_b, drain))
        next_choice = policy.choice if next_choice is None else jnp.where(next_choice < 0, policy.choice,
                                                                           next_choice)
    if schedule.drafts:
        init = functools.partial(drafter.init, cache_len=cache_len)
        if schedule.predict_ks is None:
            draft_state = init(draft_params, tokens_bp, prompt_len_b)
        else:
            draft_state = jax.lax.cond(jnp.asarray(schedule.predict_ks)[next_choice] > 0, init,
                                       functools.partial(drafter.init_deferred, cache_len=cache_len),
                                       draft_params, tokens_bp, prompt_len_b)
        state = state.replace(draft_state=draft_state)
    return state


def _tetris_plan(schedule: Schedule, seconds) -> policy_lib.TetrisPlan | None:
    """The goodput policy's view of the schedule's TETRIS plan (`policy.goodput_of_ks`), if any."""
    j = schedule.tetris_index
    if j is None:
        return None
    plan = schedule.plans[j]
    return policy_lib.TetrisPlan(j, plan.k, plan.capacities, seconds["capacities"])


def _drain(n_out_b, max_new_b, draining):
    """The goodput policy's view of a draining batch (`policy.goodput_of_ks`), None if unset."""
    return None if draining is None else (max_new_b - n_out_b, draining)


def _with_hold(policy: policy_lib.PolicyState, live_b, schedule: Schedule, seconds, backlog_b,
               drain=None) -> policy_lib.PolicyState:
    """Sets `policy.hold` (how long a plain segment may run) when the next plan is plain decoding;
    `backlog_b`: the drafter's (`Drafter.backlog`), which each plain step lengthens."""
    plain = jnp.asarray(schedule.predict_ks)[policy.choice] == 0

    def horizon():
        return policy_lib.plain_horizon(policy, live_b, schedule.predict_ks, seconds["plans"], drain=drain,
                                        switch_seconds=seconds["round_trip"], entry=(seconds["position"], backlog_b),
                                        tetris=_tetris_plan(schedule, seconds)).astype(jnp.int32)

    # A branch: the look-ahead costs about 0.9 ms at batch 1 on XLA:CPU, and a drafting plan has no hold.
    return policy.replace(hold=jax.lax.cond(plain, horizon, lambda: jnp.int32(0)))


start_on_device = functools.partial(jax.jit, static_argnames=_STATIC)(_fresh_rows)


def prefill_schedule(schedule: Schedule) -> Schedule:
    """The schedule `start_on_device` compiles for. A fixed schedule's prefill depends only on
    whether it drafts (the drafter's prefill), so decoders of every fixed draft length and
    selection share one prefill program per shape (and the profiler's shapes, one per cache): at
    the qwen2.5-1.5b / 0.5b shapes a program takes about 18 s to compile on an H200."""
    if schedule.predict_ks is not None:
        return schedule
    return Schedule(plans=(StepPlan(k=1 if schedule.drafts else 0),))


# A goodput branch runs at least this many steps before the loop returns to switch branches, so a
# policy that changes its mind every step costs a host round trip every few steps, not every step.
MIN_SEGMENT = policy_lib.PROBE_STEPS


@functools.partial(jax.jit, static_argnames=_STATIC + ("plan_index",), donate_argnums=(6,))
def run_on_device(target_graphdef, drafter: Drafter, schedule: Schedule, sampling: SamplingConfig, target_params,
                  draft_params, state: DecodeState, request_keys_b, max_new_b, eos_id, budget, seconds,
                  stop_on_finish, max_steps, draining=None, follow=None, *, cache_len: int, seq_len: int, out_len: int,
                  mesh=None, plan_index: int = 0) -> DecodeState:
    """Decode steps with plan `schedule.plans[plan_index]` until every row is done, or, when the
    traced flag `stop_on_finish` is set, until one more row is done than at entry (continuous
    batching stops there to refill the finished slot; counted on device, so the host need not
    read the done flags first), or after `max_steps` steps (traced; the goodput policy returns
    now and then so the host can correct the cost model with measured times). A negative
    `stop_on_finish` returns at once (compile only).

    Under the goodput policy, after a drafting plan's MIN_SEGMENT-th step and every
    `schedule.choose_every` steps after it, the policy chooses the next step's plan on device from
    the statistics that step has just updated; while it keeps choosing this plan
    the loop goes on, and once it has chosen another (and this plan ran MIN_SEGMENT steps) the
    loop returns so the host can run the chosen plan's program. A plain decoding plan (k = 0)
    observes nothing, so its steps skip the policy entirely (the loop body is the autoregressive
    loop's but for a few bookkeeping operations: 288 against 283 XLA:CPU operations at batch 1 of
    the tiny-8L pair; on an H200 those plain steps took 14 us more than the autoregressive loop's
    223 us, by the method of `scripts/policy_overhead.py`) and it chooses once, on return, after
    ageing the evidence for the steps run (`policy.age`): plain decoding again, or a probe of
    speculation (`policy.probe_choice`).
    Each plan is its own program: choosing among branches inside one loop (`lax.switch`) made
    XLA copy the loop state, caches included, every step (1.3-1.4x the step time at batch 64,
    scripts/switch_overhead.py). A call runs one plan, so the host counts its steps from
    `state.steps`.

    `draining` (traced bool; None: unset): no request waits for a slot, so the policy judges plans
    by when the slowest row will be done (`policy.drain_tokens_per_step`).

    `follow` (traced bool; None: unset): the host dispatched this plan before reading the policy's
    choice (a run's opening, queued behind the prefill, so the device does not wait on a host round
    trip between the two). The segment then runs only if the choice is this plan (else no step, and
    the policy is left as it was, for the host to read), and a plain plan runs for the policy's
    `hold` instead of `max_steps`.
    """
    b = state.seq_bl.shape[0]
    plan = schedule.plans[plan_index]
    goodput = schedule.predict_ks is not None
    choose_each_step = goodput and plan.k > 0
    entry_steps = state.steps
    entry_done = jnp.sum(state.done_b.astype(jnp.int32))
    stop_at_done = jnp.where(stop_on_finish > 0, entry_done + 1, jnp.where(stop_on_finish < 0, 0, b + 1))
    missed = jnp.bool_(False)
    if follow is not None:
        missed = follow & (state.policy.choice != plan_index)
        if plan.k == 0:
            max_steps = jnp.where(follow, state.policy.hold, max_steps)
        max_steps = jnp.where(missed, 0, max_steps)

    def choose(policy, done_b, n_out_b):
        return policy.replace(choice=policy_lib.choose_k(
            policy, ~done_b, schedule.predict_ks, seconds["plans"], False, plan_index,
            drain=_drain(n_out_b, max_new_b, draining),
            switch_seconds=seconds["round_trip"], tetris=_tetris_plan(schedule, seconds)))

    def step(state):
        return speculative_step(target_graphdef, drafter, plan, sampling, target_params, draft_params, state,
                                request_keys_b, max_new_b, eos_id, out_len, budget, seconds["capacities"])

    def running(state):
        done = jnp.sum(state.done_b.astype(jnp.int32))
        return (done < b) & (done < stop_at_done) & (state.steps - entry_steps < max_steps)

    if not choose_each_step:
        state = jax.lax.while_loop(running, step, state)
    else:
        # The choice can end the segment only from MIN_SEGMENT steps on, and it is made every
        # `choose_every` steps from there (see `SpecConfig.choose_every`). The steps between two
        # choices are an inner loop and the choice follows it unconditionally: chosen by a
        # `lax.cond` in every step, the branch's predicate is read on the host each step on a GPU
        # (XLA's conditional), which drains the device's queue. The last run of steps (ended by
        # the step cap or finished rows) is also followed by a choice: the one the host reads.
        def steps_then_choose(state):
            ran = state.steps - entry_steps
            due = jnp.where(ran < MIN_SEGMENT, MIN_SEGMENT, ran + schedule.choose_every)
            state = jax.lax.while_loop(lambda s: running(s) & (s.steps - entry_steps < due), step, state)
            return state.replace(policy=choose(state.policy, state.done_b, state.n_out_b))

        def keeps_plan(state):
            return running(state) & ((state.policy.choice == plan_index) | (state.steps - entry_steps < MIN_SEGMENT))

        state = jax.lax.while_loop(keeps_plan, steps_then_choose, state)
    if not goodput:
        return state
    if not choose_each_step:
        state = state.replace(policy=policy_lib.age(state.policy, state.steps - entry_steps))

    def plan_next(policy):
        # Drafting after plain steps first catches the drafter up on them (`Drafter.backlog`).
        backlog_b = drafter.backlog(state.draft_state, state.target_cache.lengths)
        drain = _drain(state.n_out_b, max_new_b, draining)
        if not choose_each_step:   # a drafting plan's loop ends on a choice (above)
            policy = policy.replace(choice=policy_lib.probe_choice(
                policy, ~state.done_b, schedule.predict_ks, seconds["plans"], drain=drain,
                switch_seconds=seconds["round_trip"], tetris=_tetris_plan(schedule, seconds),
                entry_seconds=policy_lib.draft_entry_seconds(seconds["position"], backlog_b, ~state.done_b)))
        return _with_hold(policy, ~state.done_b, schedule, seconds, backlog_b, drain)

    # Once every row is done there is nothing to plan for (a refill plans for its new rows:
    # `refill_on_device`), and the look-ahead of `plain_horizon` cost about 0.9 ms at batch 1 on
    # XLA:CPU, 1.4% of a 96-token call that ended in one plain segment.
    return state.replace(policy=jax.lax.cond(jnp.all(state.done_b) | missed, lambda policy: policy, plan_next,
                                             state.policy))


@functools.partial(jax.jit, static_argnames=("target_graphdef", "sampling", "cache_len", "seq_len", "out_len",
                                             "mesh"))
def plain_call_on_device(target_graphdef, sampling: SamplingConfig, target_params, tokens_bp, prompt_len_b,
                         max_new_b, request_keys_b, eos_id, *, cache_len: int, seq_len: int, out_len: int,
                         mesh=None):
    """Goodput: a whole call of plain decoding in one program, the prefill and then `plain_step`
    until every row is done, as the autoregressive loop runs it (the same tokens as the general
    path's plain steps: each is drawn from its request's key and position). Returns what the
    host reads (done flags, outputs, counts, counters, steps), no caches.

    The call a decoder makes when it knows the call will decode plainly throughout
    (`GoodputControl.lean_call`). Split into `start_on_device` and a plain `run_on_device`
    segment, a plain call cost 6-9 ms more than the autoregressive loop at the qwen2.5 shapes on an
    H200 (batch 4), none of it per step: the policy's opening and closing choices, 7 conditionals
    whose predicates the host reads, each of the target's 56 cache arrays transposed into the
    attention's layout before the segment's loop and back after it (the cache crosses a program
    boundary), and a read of 23 arrays. In one program, as here, the caches never leave it."""
    state = initial_state(target_graphdef, sampling, target_params, tokens_bp, prompt_len_b, max_new_b,
                          request_keys_b, eos_id, cache_len=cache_len, seq_len=seq_len, out_len=out_len, mesh=mesh)

    def step(state):
        return plain_step(target_graphdef, sampling, target_params, state, request_keys_b, max_new_b, eos_id,
                          out_len)

    state = jax.lax.while_loop(lambda state: ~jnp.all(state.done_b), step, state)
    return state.done_b, state.out_bo, state.n_out_b, state.counters, state.steps


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter", "plan", "sampling", "cache_len", "seq_len",
                                             "out_len", "mesh"))
def drafting_call_on_device(target_graphdef, drafter: Drafter, plan: StepPlan, sampling: SamplingConfig,
                            target_params, draft_params, tokens_bp, prompt_len_b, max_new_b, request_keys_b, eos_id,
                            *, cache_len: int, seq_len: int, out_len: int, mesh=None):
    """Goodput: a whole call of one standard drafting plan in one program, the prefill (target and
    drafter) and then `speculative_step` until every row is done, as a fixed-k decoder's call runs
    (the same tokens as the general path's steps of that plan). Returns what the host reads (done
    flags, outputs, counts, counters, steps), no caches.

    The call a decoder makes when the calls before ran this plan throughout and the step times and
    remembered acceptance still rank it first (`GoodputControl.lean_call`): none of the policy's
    on-device choices, conditionals or reads, and the caches never cross a program boundary. Not
    for TETRIS plans, whose selection reads the policy's calibration."""
    schedule = Schedule(plans=(plan,))
    state = _fresh_rows(target_graphdef, drafter, schedule, sampling, target_params, draft_params, tokens_bp,
                        prompt_len_b, max_new_b, request_keys_b, eos_id, None, cache_len=cache_len, seq_len=seq_len,
                        out_len=out_len, mesh=mesh)

    def step(state):
        return speculative_step(target_graphdef, drafter, plan, sampling, target_params, draft_params, state,
                                request_keys_b, max_new_b, eos_id, out_len)

    state = jax.lax.while_loop(lambda state: ~jnp.all(state.done_b), step, state)
    return state.done_b, state.out_bo, state.n_out_b, state.counters, state.steps


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=(6,))
def refill_on_device(target_graphdef, drafter: Drafter, schedule: Schedule, sampling: SamplingConfig, target_params,
                     draft_params, state: DecodeState, slots_r, tokens_rp, prompt_len_r, max_new_r, request_keys_r,
                     eos_id, seconds, *, cache_len: int, seq_len: int, out_len: int, mesh=None) -> DecodeState:
    """Prefills new requests into rows `slots_r` of a running state (an out-of-range slot drops
    its row). Everything per row is replaced; the step counter, the calibration of draft
    confidence and the policy's next choice carry over, and a new row's acceptance counts start
    from the batch's pooled acceptance (`policy.seed_acceptance`)."""
    running = state.policy
    # With no row running, the running plan means nothing (`run_on_device` does not plan once
    # every row is done): the new rows open on their own plan, as a run's first rows do.
    idle = jnp.all(state.done_b)
    fresh = _fresh_rows(target_graphdef, drafter, schedule, sampling, target_params, draft_params, tokens_rp,
                        prompt_len_r, max_new_r, request_keys_r, eos_id, seconds,
                        jnp.where(idle, -1, running.choice) if running is not None else None,
                        None if running is None else policy_lib.seed_acceptance(
                            running.accepted_b + running.seed_accepted_b, running.evidence_b()),
                        cache_len=cache_len, seq_len=seq_len, out_len=out_len, mesh=mesh)

    def put(old, new):
        return old.at[slots_r].set(new, mode="drop")

    per_row = dict(target_cache=jax.tree.map(put, state.target_cache, fresh.target_cache),
                   draft_state=jax.tree.map(put, state.draft_state, fresh.draft_state),
                   seq_bl=put(state.seq_bl, fresh.seq_bl), out_bo=put(state.out_bo, fresh.out_bo),
                   n_out_b=put(state.n_out_b, fresh.n_out_b), done_b=put(state.done_b, fresh.done_b),
                   counters=jax.tree.map(put, state.counters, fresh.counters))
    if state.policy is not None:
        rows_of = {name: put(getattr(state.policy, name), getattr(fresh.policy, name))
                   for name in ("seed_accepted_b", "seed_trials_b")}
        counts_2b = state.policy.counts_2b.at[:, slots_r].set(fresh.policy.counts_2b, mode="drop")
        per_row["policy"] = state.policy.replace(**rows_of, counts_2b=counts_2b,
                                                 choice=jnp.where(idle, fresh.policy.choice, running.choice),
                                                 hold=jnp.where(idle, fresh.policy.hold, running.hold))
    return state.replace(**per_row)


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter", "plan", "sampling", "out_len"),
                   donate_argnums=(6,))
def _steps_loop(target_graphdef, drafter: Drafter, plan: StepPlan, sampling: SamplingConfig, target_params,
                draft_params, state, request_keys_b, max_new_b, eos_id, iterations, *, out_len: int):
    def body(_, state):
        return speculative_step(target_graphdef, drafter, plan, sampling, target_params, draft_params, state,
                                request_keys_b, max_new_b, eos_id, out_len)

    return jax.lax.fori_loop(0, iterations, body, state)   # traced count: one program for any count


def time_steps(target: Model, drafter: Drafter, k: int, batch: int, cache_len: int, *, repeats: int = 3,
               iterations: int = 6, seed: int = 0) -> float:
    """Median seconds of one speculative step with k drafts per row (k = 0: a plain decoding
    step), measured as the decode loop runs it: over `batch` rows with a cache of `cache_len`
    slots (filled with a prompt up to what the steps need), after a warm-up, with
    `block_until_ready`, as the difference between a compiled loop of 1 + `iterations` steps and
    one of 1 step, over `iterations`: a call's own cost besides its steps (the round trip, and on
    XLA:CPU about 1.3 ms more for a drafting program at batch 1) is not a step's (see
    `control.MEASURE_STEPS`). Where a stall makes that difference implausibly small, a tenth of the
    long loop's average step stands in. The cost model's profiler fits its coefficients to these times."""
    run = _step_timer(target, drafter, k, batch, cache_len, iterations, seed)

    def step() -> tuple[float, float]:
        long = run(1 + iterations)
        return (long - run(1)) / iterations, long / (1 + iterations)

    step()
    times, averages = zip(*(step() for _ in range(repeats)), strict=True)
    # A stall in the one-step loop can make the difference near zero or negative (a loaded
    # machine); a step is never cheaper than a tenth of the long loop's average step.
    return max(float(np.median(times)), 0.1 * float(np.median(averages)), 1e-9)


def warm_steps(target: Model, drafter: Drafter, k: int, batch: int, cache_len: int, *, iterations: int = 6,
               seed: int = 0) -> None:
    """Compiles and runs once the programs `time_steps` times at this shape (its prefill and its
    loop of steps), so that the profiler can compile its grid's programs side by side first."""
    _step_timer(target, drafter, k, batch, cache_len, iterations, seed)(1)


def _step_timer(target: Model, drafter: Drafter, k: int, batch: int, cache_len: int, iterations: int, seed: int):
    """Prefills `batch` rows for `time_steps` and returns a function timing `steps` steps from them."""
    sampling = SamplingConfig()
    out_len = prompts_lib.bucket_length((iterations + 1) * (k + 1) + 2)
    seq_len = cache_len
    prompt_len = seq_len - out_len - prompts_lib.bucket_length(k + 2, 8)
    if prompt_len < 1:
        raise ValueError(f"cache_len={cache_len} is too small to time {iterations} steps with k={k}; "
                         f"it needs more than {seq_len - prompt_len} slots")
    rng = np.random.default_rng(seed)
    tokens_bp = jnp.asarray(rng.integers(0, target.config.vocab_size, (batch, prompt_len)), jnp.int32)
    lengths_b = jnp.full((batch,), prompt_len, jnp.int32)
    max_new_b = jnp.full((batch,), out_len, jnp.int32)   # no row finishes within the timed steps
    keys_b = request_keys(seed, np.arange(batch))
    plan = StepPlan(k=k, cache_len=seq_len)
    schedule = Schedule(plans=(plan,))
    eos = jnp.int32(-1)   # never emitted

    # One prefill serves every timed run: each run gets a copy, as the loop donates its state (at
    # SmolLM2 shapes and batch 64 a prefill of the cache took longer than the steps it sets up).
    prefilled = start_on_device(target.graphdef, drafter, prefill_schedule(schedule), sampling, target.params,
                                drafter.params, tokens_bp, lengths_b, max_new_b, keys_b, eos, {}, cache_len=seq_len,
                                seq_len=seq_len, out_len=out_len)

    def run(steps: int) -> float:
        state = jax.block_until_ready(jax.tree.map(jnp.copy, prefilled))
        start = time.perf_counter()
        jax.block_until_ready(_steps_loop(target.graphdef, drafter, plan, sampling, target.params, drafter.params,
                                          state, keys_b, max_new_b, eos, np.int32(steps), out_len=out_len))
        return time.perf_counter() - start

    return run


def cache_length(prompt_width: int, out_len: int, max_new: int, k: int) -> int:
    """Slots of a decode call's caches: the padded prompts, then at least max_new + k + 1 (a row
    with one token left verifies a window of k drafts past it), rounded up to 8. The output
    bucket, a power of two, mostly has that room already, and then the cache is no larger than
    the autoregressive loop's: 8 slots more (200 against 192, the window added on top of the
    bucket as before) made every step of an autoregressive loop 2.8% slower at batch 16 on
    XLA:CPU, 256 slots 6%. (A chain's inner level may write further; those writes are dropped
    and would hold only tokens past a row's budget.)"""
    return prompt_width + max(out_len, -(-(max_new + k + 1) // 8) * 8)


def put_rows(array, slots_r, new):
    """Host-side twin of the refill scatter, for per-row inputs that live outside the state
    (a numpy array stays one; an out-of-range slot drops its row)."""
    if isinstance(array, np.ndarray):
        slots_r, new = np.asarray(slots_r), np.asarray(new)
        keep = (slots_r >= 0) & (slots_r < array.shape[0])
        array = array.copy()
        array[slots_r[keep]] = new[keep]
        return array
    return array.at[slots_r].set(new, mode="drop")


def side_by_side(jobs) -> list:
    """Runs zero-argument callables in threads, one per host core at most, and returns their
    results in order (the first exception, if any, is raised). JAX's compilation and dispatch are
    thread-safe, and one compilation leaves cores idle: a goodput decoder's first call (7 plans,
    tiny-8L, batch 4) spent 69 s of CPU in 50 s on 2 cores compiling one program after another,
    and 67 s in 40 s side by side."""
    jobs = list(jobs)
    if len(jobs) < 2:
        return [job() for job in jobs]
    # The cores this process may run on: a container's or a job scheduler's share of the host,
    # which `os.cpu_count()` (every core of the machine) overstates.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(jobs), cores)) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [future.result() for future in futures]


def compile_ahead(programs) -> None:
    """Compiles jitted calls side by side (`side_by_side`), ahead of their first calls, which then
    find them compiled (jit keeps one cache for both ways in).

    `programs`: (jitted function, positional args, keyword args) as the call will pass them. A
    goodput decoder's warm-up compiles one program per plan: at batch 4 of the tiny-8L pair with
    k = 6, 7 plans' programs took 26 s of a 41 s first call on 2 cores, one after another; a
    program at the qwen2.5 shapes takes about 18 s on an H200's host (16 cores). A function
    without `lower` (a wrapper put in by instrumentation, as `scripts/policy_overhead.py` does) is
    left to compile at its first call."""
    side_by_side([functools.partial(lambda fn, args, kwargs: fn.lower(*args, **kwargs).compile(), fn, args, kwargs)
                  for fn, args, kwargs in programs if hasattr(fn, "lower")])


def segment_outputs(state: DecodeState, max_new_b=None):
    """What the host reads after each segment (one transfer)."""
    return jax.device_get((state.done_b, state.out_bo, state.n_out_b, state.counters, state.steps, state.policy,
                           max_new_b))
