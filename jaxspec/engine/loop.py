"""The decode loop on device: one compiled program per plan over the step (`jaxspec.engine.step`).

`start_on_device` prefills a batch (target and drafter) and, under the goodput policy, makes the
opening choice; `run_on_device` runs steps of one plan in a `lax.while_loop` until every row is
done, a row finishes (continuous batching refills it), a step cap is reached, or the goodput
policy chooses another plan; `refill_on_device` prefills new requests into finished rows. The
host (`jaxspec.engine.decoder`) reads each segment's outputs once and starts the next.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import policy as policy_lib
from jaxspec.drafting.base import Drafter
from jaxspec.engine.step import DecodeState, StepPlan, initial_state, speculative_step
from jaxspec.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The step shapes a decode loop may run: one plan (a fixed policy runs it every step), or
    the goodput policy's candidates (`goodput=True`), each its own compiled program."""

    plans: tuple[StepPlan, ...]
    goodput: bool = False

    @property
    def drafts(self) -> bool:
        return any(plan.k > 0 for plan in self.plans)

    @property
    def policy_plans(self) -> tuple[tuple[int, int | None], ...]:
        """The plans as the policy sees them: (draft length, TETRIS budget or None); a tree plan
        as a window of its depth (its acceptance is counted per depth of the accepted path)."""
        return tuple((plan.tree.depth, None) if plan.tree is not None else (plan.k, plan.capacity)
                     for plan in self.plans)


_STATIC = ("target_graphdef", "drafter", "schedule", "sampling", "cache_len", "seq_len", "out_len", "mesh")


def _fresh_rows(target_graphdef, drafter: Drafter, schedule: Schedule, sampling: SamplingConfig, target_params,
                draft_params, tokens_bp, prompt_len_b, max_new_b, request_keys_b, eos_id, seconds=None, prior=None,
                draining=None, *, cache_len: int, seq_len: int, out_len: int, mesh=None) -> DecodeState:
    """Loop state for freshly prefilled rows: target and drafter caches and, under the goodput
    policy, the acceptance counts and the opening choice (`draining`: whether the batch drains,
    as in `run_on_device`). A batch that opens with plain decoding defers the drafter's prefill
    (`Drafter.init_deferred`): it catches up if and when drafting starts."""
    features = drafter.feature_layers if schedule.drafts else ()
    state, features_bpf = initial_state(target_graphdef, sampling, target_params, tokens_bp, prompt_len_b, max_new_b,
                                        request_keys_b, eos_id, cache_len=cache_len, seq_len=seq_len,
                                        out_len=out_len, mesh=mesh, features=features)
    drafts_now = True
    if schedule.goodput:
        policy = policy_lib.PolicyState.init(tokens_bp.shape[0], max(k for k, _ in schedule.policy_plans), prior)
        choice = _choose(policy, state, schedule, seconds, None, max_new_b, draining)
        drafts_now = jnp.asarray([plan.k > 0 for plan in schedule.plans])[choice]
        # Opening with plain decoding, the drafter skips its prefill: it is a prompt behind.
        behind = jnp.where(drafts_now, 0.0, jnp.max(prompt_len_b).astype(jnp.float32))
        state = state.replace(policy=policy.replace(choice=choice, behind=behind))
    if schedule.drafts:
        init = functools.partial(drafter.init, cache_len=cache_len)
        deferred = functools.partial(drafter.init_deferred, cache_len=cache_len)
        draft_state = (init(draft_params, tokens_bp, prompt_len_b) if drafts_now is True else
                       jax.lax.cond(drafts_now, init, deferred, draft_params, tokens_bp, prompt_len_b))
        if features:   # a drafter reading the target's features (EAGLE) takes in the prompt's now
            p = tokens_bp.shape[1]
            draft_state = drafter.absorb(draft_params, draft_state, features_bpf, state.seq_bl[:, 1:p + 1],
                                         prompt_len_b)
        state = state.replace(draft_state=draft_state)
    return state


def _choose(policy, state, schedule: Schedule, seconds, current, max_new_b, draining):
    """The policy's choice for this state; `seconds` = (each plan's predicted step seconds, one
    forward of the drafter over the batch: the catch-up's unit)."""
    seconds_j, catch_up = seconds
    return policy_lib.choose(policy, ~state.done_b, schedule.policy_plans, seconds_j, current,
                             max_new_b - state.n_out_b, draining, catch_up)


start_on_device = functools.partial(jax.jit, static_argnames=_STATIC)(_fresh_rows)


def prefill_schedule(schedule: Schedule) -> Schedule:
    """The schedule `start_on_device` compiles for: a fixed schedule's prefill depends only on
    whether it drafts, so decoders of every fixed draft length share one prefill program."""
    if schedule.goodput:
        return schedule
    return Schedule(plans=(StepPlan(k=1 if schedule.drafts else 0),))


@functools.partial(jax.jit, static_argnames=_STATIC + ("plan_index",), donate_argnums=(6,))
def run_on_device(target_graphdef, drafter: Drafter, schedule: Schedule, sampling: SamplingConfig, target_params,
                  draft_params, state: DecodeState, request_keys_b, max_new_b, eos_id, budget, stop_on_finish,
                  max_steps, seconds=None, draining=None, *, cache_len: int, seq_len: int, out_len: int, mesh=None,
                  plan_index: int = 0) -> DecodeState:
    """Steps of plan `schedule.plans[plan_index]` until every row is done; or, when the traced
    flag `stop_on_finish` is set, until one more row is done than at entry (continuous batching
    refills it; counted on device, so the host need not read the done flags first); or after
    `max_steps` steps (traced).

    Under the goodput policy the policy chooses after every drafting step, from the statistics the
    step updated, and after every `policy.CHOOSE_EVERY` plain steps (which observe nothing: the
    evidence is aged first, `policy.age`); the loop returns as soon as it has chosen another
    plan, whose program the host runs next. `seconds` = (the plans' predicted step seconds, the
    drafter's catch-up seconds per forward); `draining` (traced bool) says no request waits for a
    slot, so the batch drains (`policy.goodput`). The host reads nothing until the loop returns.
    """
    del cache_len, seq_len, mesh   # part of the program's static identity only
    b = state.seq_bl.shape[0]
    plan = schedule.plans[plan_index]
    entry_steps = state.steps
    entry_done = jnp.sum(state.done_b.astype(jnp.int32))
    stop_at_done = jnp.where(stop_on_finish > 0, entry_done + 1, b + 1)

    def step(state):
        return speculative_step(target_graphdef, drafter, plan, sampling, target_params, draft_params, state,
                                request_keys_b, max_new_b, eos_id, out_len, budget)

    def running(state):
        done = jnp.sum(state.done_b.astype(jnp.int32))
        return (done < b) & (done < stop_at_done) & (state.steps - entry_steps < max_steps)

    if not schedule.goodput:
        return jax.lax.while_loop(running, step, state)

    def chunk_then_choose(state):
        if plan.k:   # the outer loop's predicate has checked `running`
            state = step(state)
            policy = state.policy
        else:
            start = state.steps
            state = jax.lax.while_loop(lambda s: running(s) & (s.steps - start < policy_lib.CHOOSE_EVERY), step,
                                       state)
            policy = policy_lib.age(state.policy, state.steps - start)
        return state.replace(policy=policy.replace(choice=_choose(policy, state, schedule, seconds, plan_index,
                                                                  max_new_b, draining)))

    return jax.lax.while_loop(lambda s: running(s) & (s.policy.choice == plan_index), chunk_then_choose, state)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=(6,))
def refill_on_device(target_graphdef, drafter: Drafter, schedule: Schedule, sampling: SamplingConfig, target_params,
                     draft_params, state: DecodeState, slots_r, tokens_rp, prompt_len_r, max_new_r, request_keys_r,
                     eos_id, seconds=None, draining=None, *, cache_len: int, seq_len: int, out_len: int,
                     mesh=None) -> DecodeState:
    """Prefills new requests into rows `slots_r` of a running state (an out-of-range slot drops
    its row). Everything per row is replaced; new rows start from the prior acceptance, and the
    running plan carries on unless no row was running (the new rows' opening choice then decides)."""
    prior = None if state.policy is None else state.policy.prior
    fresh = _fresh_rows(target_graphdef, drafter, schedule, sampling, target_params, draft_params, tokens_rp,
                        prompt_len_r, max_new_r, request_keys_r, eos_id, seconds, prior, draining,
                        cache_len=cache_len, seq_len=seq_len, out_len=out_len, mesh=mesh)

    def put(old, new):
        return old.at[slots_r].set(new, mode="drop")

    per_row = dict(target_cache=jax.tree.map(put, state.target_cache, fresh.target_cache),
                   draft_state=jax.tree.map(put, state.draft_state, fresh.draft_state),
                   seq_bl=put(state.seq_bl, fresh.seq_bl), out_bo=put(state.out_bo, fresh.out_bo),
                   n_out_b=put(state.n_out_b, fresh.n_out_b), done_b=put(state.done_b, fresh.done_b),
                   counters=jax.tree.map(put, state.counters, fresh.counters))
    if state.policy is not None:
        policy = state.policy.reset_rows(slots_r)
        if fresh.policy is not None:   # the two-slice engine refills the target's rows only, and chooses itself
            policy = policy.replace(choice=jnp.where(jnp.all(state.done_b), fresh.policy.choice, policy.choice))
        per_row["policy"] = policy
    return state.replace(**per_row)


def cache_length(prompt_width: int, out_len: int, max_new: int, k: int) -> int:
    """Slots of a decode call's caches: the padded prompts, then at least max_new + k + 1 (a row
    with one token left verifies a window of k drafts past it), rounded up to 8. The output
    bucket, a power of two, mostly has that room already (a chain's inner level may write
    further; those writes are dropped and would hold only tokens past a row's budget)."""
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


def segment_outputs(state: DecodeState):
    """What the host reads after each segment (one transfer)."""
    return jax.device_get((state.done_b, state.out_bo, state.n_out_b, state.counters, state.steps,
                           None if state.policy is None else state.policy.choice))
