"""The decode loop on device: the compiled programs around the step (`jaxspec.engine.step`).

Each takes the static `plans.Program`, params = (target params, draft params) and small pytrees,
and returns the state and a `Report`, the few arrays the host reads (copies: the state may be
donated to the next program first). A segment's loop has a static trip count and no branch: rows
that finish inside it are masked and wait for its end.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.engine import kernels
from jaxspec.engine.plans import Program
from jaxspec.engine.step import DecodeState, Requests, initial_state, speculative_step
from jaxspec.models import attention
from jaxspec.policy import goodput as policy_lib


@struct.dataclass
class Control:
    """The host's traced inputs to a program besides params, state and requests."""

    budget: jax.Array          # the running plan's TETRIS budget C (0: standard)
    draining: jax.Array        # no request waits for a slot: the batch drains (`policy.goodput`)
    seconds_j: jax.Array       # goodput: each plan's predicted step seconds (`plans.plan_seconds`)
    catch_up: jax.Array        # goodput: one drafter forward over the batch, the catch-up's unit

    @classmethod
    def of(cls, *, budget=0, draining=True, seconds_j=(0.0,), catch_up=0.0) -> Control:
        """Host values (numpy: a compiled call transfers them itself)."""
        return cls(budget=np.int32(budget), draining=np.bool_(draining),
                   seconds_j=np.asarray(seconds_j, np.float32), catch_up=np.float32(catch_up))


@dataclasses.dataclass(frozen=True)
class Segment:
    """The static shape of one segment: `steps` steps of plan `plan` (an index into the schedule's
    plans), no cache row attended longer than `live` slots (`attention.live_slots`; None: the buffer)."""

    plan: int
    steps: int = 1
    live: int | None = None


@struct.dataclass
class Report:
    """What the host reads after a program: one transfer."""

    done_b: jax.Array
    out_bo: jax.Array
    n_out_b: jax.Array
    counters: object
    steps: jax.Array
    choice: jax.Array          # goodput: the plan the policy chose for the next segment (else 0)
    lag: jax.Array             # the most tokens a row's drafter has not taken in (`Drafter.lag`)
    longest: jax.Array         # the most tokens a row has emitted (`segments.Host.next_segment`)
    left: jax.Array            # the most tokens a live row has left


def _report(program: Program, state: DecodeState) -> Report:
    lag = 0
    if program.schedule.goodput and program.schedule.drafts:
        lag = jnp.max(program.drafter.lag(state.draft_state, state.seq_bl, state.target_cache.lengths))
    choice = state.policy.choice if program.schedule.goodput else 0
    copy = functools.partial(jnp.array, copy=True)
    return Report(*jax.tree.map(copy, (state.done_b, state.out_bo, state.n_out_b, state.counters, state.steps)),
                  choice=copy(choice), lag=jnp.asarray(lag, jnp.int32), longest=jnp.max(state.n_out_b),
                  left=jnp.max(jnp.where(state.done_b, 0, state.max_new_b - state.n_out_b)))


def choose_plan(program: Program, state: DecodeState, control: Control, current, draft_params=None):
    """The policy's choice of plan for this state (`current`: the running plan's index or None), with
    a free drafter's forecast of its next drafts where its `draft_params` are at hand."""
    plans, forecast = program.schedule.policy_plans, None
    if draft_params is not None and program.schedule.drafts and not any(p.tree for p in program.schedule.plans):
        forecast = program.drafter.forecast(draft_params, state.seq_bl, state.target_cache.lengths,
                                            max(k for k, _ in plans))
    return policy_lib.choose(state.policy, ~state.done_b, plans, control.seconds_j, current,
                             remaining_b=state.max_new_b - state.n_out_b, draining=control.draining,
                             catch_up_seconds=control.catch_up, free=program.schedule.free_plans,
                             forecast_bk=forecast)


def open_policy(program: Program, state: DecodeState, control: Control, prior=policy_lib.PRIOR_ALPHA,
                draft_params=None):
    """The state with the goodput policy's counts for its rows (from `prior`) and its opening choice."""
    longest = max(k for k, _ in program.schedule.policy_plans)
    state = state.replace(policy=policy_lib.PolicyState.init(state.done_b.shape[0], longest, prior,
                                                             any(program.schedule.free_plans)))
    return state.replace(policy=state.policy.replace(choice=choose_plan(program, state, control, None, draft_params)))


def _fresh_rows(program: Program, params, requests: Requests, control: Control,
                prior=policy_lib.PRIOR_ALPHA) -> DecodeState:
    """Loop state for freshly prefilled rows: target and drafter caches and, under the goodput policy, the
    acceptance counts (from `prior`) and opening choice (the drafter's prefill deferred: `init_deferred`)."""
    schedule, drafter = program.schedule, program.drafter
    tokens_bp, prompt_len_b = requests.tokens_bp, requests.prompt_len_b
    state, features_bpf = initial_state(program, params[0], requests)
    if schedule.goodput:
        state = open_policy(program, state, control, prior, params[1] if schedule.drafts else None)
        behind = jnp.max(prompt_len_b).astype(jnp.float32) if schedule.drafts and not program.features else 0.0
        state = state.replace(policy=state.policy.replace(behind=jnp.asarray(behind, jnp.float32)))
    if schedule.drafts:
        init = drafter.init_deferred if schedule.goodput else drafter.init
        draft_state = init(params[1], tokens_bp, prompt_len_b, program.cache_len)
        if program.features:   # a drafter reading the target's features (EAGLE) takes in the prompt's now
            p = tokens_bp.shape[1]
            draft_state = drafter.absorb(params[1], draft_state, features_bpf, state.seq_bl[:, 1:p + 1],
                                         prompt_len_b)
        state = state.replace(draft_state=draft_state)
    return state


@functools.partial(kernels.Probed, static_argnames=("program",))
def start_on_device(program: Program, params, requests: Requests, control: Control):
    """Prefills a batch: target and drafter, and under the goodput policy the opening choice."""
    state = _fresh_rows(program, params, requests, control)
    return state, _report(program, state)


@functools.partial(kernels.Probed, static_argnames=("program", "segment"), donate_argnums=(2,))
def run_on_device(program: Program, params, state: DecodeState, control: Control, segment: Segment):
    """`segment.steps` steps of plan `program.schedule.plans[segment.plan]`; under the goodput
    policy, plain steps age the acceptance counts and the policy chooses the next plan at the end."""
    plan, entry_steps = program.schedule.plans[segment.plan], state.steps
    with attention.live_slots(segment.live):
        state = jax.lax.fori_loop(0, segment.steps, lambda _, s: speculative_step(program, plan, params, s,
                                                                                  control.budget), state)
    if program.schedule.goodput:
        if not plan.k:   # plain steps observe nothing: the evidence ages
            state = state.replace(policy=policy_lib.age(state.policy, state.steps - entry_steps))
        choice = choose_plan(program, state, control, segment.plan, params[1] if program.schedule.drafts else None)
        state = state.replace(policy=state.policy.replace(choice=choice))
    return state, _report(program, state)


@functools.partial(kernels.Probed, static_argnames=("program", "width"), donate_argnums=(2,))
def catch_up_on_device(program: Program, params, state: DecodeState, width: int):
    """The drafter takes in up to `width` unseen tokens per row (`Drafter.catch_up`): after plain steps,
    or a deferred prefill."""
    state = state.replace(draft_state=program.drafter.catch_up(params[1], state.draft_state, state.seq_bl,
                                                               state.target_cache.lengths, width))
    return state, _report(program, state)


@functools.partial(kernels.Probed, static_argnames=("program",), donate_argnums=(2,))
def refill_on_device(program: Program, params, state: DecodeState, slots_r, requests: Requests, control: Control):
    """Prefills new requests into rows `slots_r` of a running state (an out-of-range slot drops its
    row); the running plan carries on unless no row was running (the new rows' choice decides)."""
    prior = policy_lib.PRIOR_ALPHA if state.policy is None else state.policy.prior
    fresh = _fresh_rows(program, params, requests, control, prior)
    per_row = {name: jax.tree.map(lambda old, new: old.at[slots_r].set(new, mode="drop"), getattr(state, name),
                                  getattr(fresh, name))
               for name in ("target_cache", "draft_state", "seq_bl", "out_bo", "n_out_b", "done_b", "counters",
                            "max_new_b", "keys_b")}
    if state.policy is not None:
        policy = state.policy.reset_rows(slots_r)
        if program.schedule.goodput:   # (the two-slice engine refills the target's rows only, and chooses itself)
            idle = jnp.all(state.done_b)
            policy = policy.replace(choice=jnp.where(idle, fresh.policy.choice, policy.choice),
                                    behind=jnp.maximum(policy.behind, fresh.policy.behind))
        per_row["policy"] = policy
    state = state.replace(**per_row)
    return state, _report(program, state)
