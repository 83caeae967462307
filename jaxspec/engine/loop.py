"""The decode loop on device: the compiled programs around the step (`jaxspec.engine.step`).

Each takes the static `plans.Program`, params = (target params, draft params), and small pytrees:

  start_on_device(program, params, requests, control)                 prefill a batch
  run_on_device(program, params, state, control, plan_index)          steps of one plan
  refill_on_device(program, params, state, slots_r, requests, control)  prefill new requests into rows

`run_on_device` loops until every row is done, a row finishes (continuous batching refills it), a
step cap is reached, or the goodput policy chooses another plan. The host
(`jaxspec.engine.decoder`) reads each segment's outputs once (`segment_outputs`) and starts the next.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.engine.plans import Program
from jaxspec.engine.step import DecodeState, Requests, initial_state, speculative_step
from jaxspec.policy import goodput as policy_lib

NO_CAP = 2 ** 30   # a segment's step cap when none is wanted


@struct.dataclass
class Control:
    """The host's traced inputs to a program besides params, state and requests."""

    budget: jax.Array          # the running plan's TETRIS budget C (0: standard)
    stop_on_finish: jax.Array  # 1: return as soon as one more row is done (to refill or hand it over)
    max_steps: jax.Array       # at most this many steps
    draining: jax.Array        # no request waits for a slot: the batch drains (`policy.goodput`)
    seconds_j: jax.Array       # goodput: each plan's predicted step seconds (`plans.plan_seconds`)
    catch_up: jax.Array        # goodput: one drafter forward over the batch, the catch-up's unit

    @classmethod
    def of(cls, *, budget=0, stop_on_finish=0, max_steps=NO_CAP, draining=True, seconds_j=(0.0,),
           catch_up=0.0) -> Control:
        """Host values (numpy: a compiled call transfers them itself)."""
        return cls(budget=np.int32(budget), stop_on_finish=np.int32(stop_on_finish), max_steps=np.int32(max_steps),
                   draining=np.bool_(draining), seconds_j=np.asarray(seconds_j, np.float32),
                   catch_up=np.float32(catch_up))


def choose_plan(program: Program, state: DecodeState, control: Control, current):
    """The policy's choice of plan for this state (`current`: the running plan's index or None)."""
    return policy_lib.choose(state.policy, ~state.done_b, program.schedule.policy_plans, control.seconds_j, current,
                             remaining_b=state.max_new_b - state.n_out_b, draining=control.draining,
                             catch_up_seconds=control.catch_up)


def open_policy(program: Program, state: DecodeState, control: Control, prior=policy_lib.PRIOR_ALPHA):
    """The state with the goodput policy's counts for its rows (from `prior`) and its opening choice."""
    state = state.replace(policy=policy_lib.PolicyState.init(state.done_b.shape[0], program.schedule.max_k, prior))
    return state.replace(policy=state.policy.replace(choice=choose_plan(program, state, control, None)))


def _fresh_rows(program: Program, params, requests: Requests, control: Control,
                prior=policy_lib.PRIOR_ALPHA) -> DecodeState:
    """Loop state for freshly prefilled rows: target and drafter caches and, under the goodput
    policy, the acceptance counts (from `prior`) and the opening choice. A batch that opens with
    plain decoding defers the drafter's prefill (`Drafter.init_deferred`): it catches up if and
    when drafting starts."""
    schedule, drafter = program.schedule, program.drafter
    tokens_bp, prompt_len_b = requests.tokens_bp, requests.prompt_len_b
    state, features_bpf = initial_state(program, params[0], requests)
    drafts_now = True
    if schedule.goodput:
        state = open_policy(program, state, control, prior)
        drafts_now = jnp.asarray([plan.k > 0 for plan in schedule.plans])[state.policy.choice]
        # Opening with plain decoding, the drafter skips its prefill: it is a prompt behind.
        behind = jnp.where(drafts_now, 0.0, jnp.max(prompt_len_b).astype(jnp.float32))
        state = state.replace(policy=state.policy.replace(behind=behind))
    if schedule.drafts:
        init = functools.partial(drafter.init, cache_len=program.cache_len)
        deferred = functools.partial(drafter.init_deferred, cache_len=program.cache_len)
        draft_state = (init(params[1], tokens_bp, prompt_len_b) if drafts_now is True else
                       jax.lax.cond(drafts_now, init, deferred, params[1], tokens_bp, prompt_len_b))
        if program.features:   # a drafter reading the target's features (EAGLE) takes in the prompt's now
            p = tokens_bp.shape[1]
            draft_state = drafter.absorb(params[1], draft_state, features_bpf, state.seq_bl[:, 1:p + 1],
                                         prompt_len_b)
        state = state.replace(draft_state=draft_state)
    return state


@functools.partial(jax.jit, static_argnames=("program",))
def start_on_device(program: Program, params, requests: Requests, control: Control) -> DecodeState:
    """Prefills a batch: target and drafter, and under the goodput policy the opening choice."""
    return _fresh_rows(program, params, requests, control)


@functools.partial(jax.jit, static_argnames=("program", "plan_index"), donate_argnums=(2,))
def run_on_device(program: Program, params, state: DecodeState, control: Control, plan_index: int) -> DecodeState:
    """Steps of plan `program.schedule.plans[plan_index]` until every row is done; or, when
    `control.stop_on_finish` is set, until one more row is done than at entry (continuous batching
    refills it; counted on device, so the host need not read the done flags first); or after
    `control.max_steps` steps.

    Under the goodput policy the policy chooses after every drafting step, from the statistics the
    step updated, and after every `policy.CHOOSE_EVERY` plain steps (which observe nothing: the
    evidence is aged first, `policy.age`); the loop returns as soon as it has chosen another
    plan, whose program the host runs next. The host reads nothing until the loop returns.
    """
    b = state.seq_bl.shape[0]
    plan = program.schedule.plans[plan_index]
    entry_steps = state.steps
    entry_done = jnp.sum(state.done_b.astype(jnp.int32))
    stop_at_done = jnp.where(control.stop_on_finish > 0, entry_done + 1, b + 1)

    def step(state):
        return speculative_step(program, plan, params, state, control.budget)

    def running(state):
        done = jnp.sum(state.done_b.astype(jnp.int32))
        return (done < b) & (done < stop_at_done) & (state.steps - entry_steps < control.max_steps)

    if not program.schedule.goodput:
        return jax.lax.while_loop(running, step, state)

    def chunk_then_choose(state):
        if plan.k:   # the outer loop's predicate has checked `running`
            state = step(state)
        else:
            start = state.steps
            state = jax.lax.while_loop(lambda s: running(s) & (s.steps - start < policy_lib.CHOOSE_EVERY), step,
                                       state)
            state = state.replace(policy=policy_lib.age(state.policy, state.steps - start))
        return state.replace(policy=state.policy.replace(choice=choose_plan(program, state, control, plan_index)))

    return jax.lax.while_loop(lambda s: running(s) & (s.policy.choice == plan_index), chunk_then_choose, state)


@functools.partial(jax.jit, static_argnames=("program",), donate_argnums=(2,))
def refill_on_device(program: Program, params, state: DecodeState, slots_r, requests: Requests,
                     control: Control) -> DecodeState:
    """Prefills new requests into rows `slots_r` of a running state (an out-of-range slot drops
    its row). Everything per row is replaced; new rows start from the prior acceptance, and the
    running plan carries on unless no row was running (the new rows' opening choice then decides)."""
    prior = policy_lib.PRIOR_ALPHA if state.policy is None else state.policy.prior
    fresh = _fresh_rows(program, params, requests, control, prior)

    def put(old, new):
        return old.at[slots_r].set(new, mode="drop")

    per_row = {name: jax.tree.map(put, getattr(state, name), getattr(fresh, name))
               for name in ("target_cache", "draft_state", "seq_bl", "out_bo", "n_out_b", "done_b", "counters",
                            "max_new_b", "keys_b")}
    if state.policy is not None:
        policy = state.policy.reset_rows(slots_r)
        if program.schedule.goodput:   # (the two-slice engine refills the target's rows only, and chooses itself)
            policy = policy.replace(choice=jnp.where(jnp.all(state.done_b), fresh.policy.choice, policy.choice))
        per_row["policy"] = policy
    return state.replace(**per_row)


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


def segment_outputs(state: DecodeState):
    """What the host reads after each segment (one transfer)."""
    return jax.device_get((state.done_b, state.out_bo, state.n_out_b, state.counters, state.steps,
                           None if state.policy is None else state.policy.choice))
