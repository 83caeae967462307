"""The speculative decode step and loop, and `SpeculativeDecoder`.

Shape key: b rows, p padded prompt length, l sequence-buffer slots, k draft tokens, o output slots,
v vocabulary.

One step, for every row at its own length, in one fixed-shape function:
  1. draft: the drafter proposes k tokens (and the distributions they came from);
  2. select and verify: standard selection scores [pending, d_1 .. d_k] in one padded forward over
     the target cache; TETRIS picks each row's window across the batch and scores exactly those
     tokens in a packed forward of b + C tokens;
  3. accept: greedy matching or lossless rejection sampling picks a prefix plus one token;
  4. bookkeeping: emitted tokens go to the output and sequence buffers (cut at eos and at the
     row's budget); the target cache commits exactly the tokens it has processed and kept.
     Rolling back the rest is not writing them: `lengths` simply does not cover them.
The loop is a `lax.while_loop` on device; statistics are counters in its state, read once. Under
the goodput policy each iteration runs one of a few compiled step shapes (`Schedule`), chosen on
device at the end of the previous step.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import batching, tetris
from jaxspec import cost as cost_lib
from jaxspec import policy as policy_lib
from jaxspec import prompts as prompts_lib
from jaxspec.drafters import Drafter, ModelDrafter, NgramDrafter, Proposal, draft_logprob
from jaxspec.generate import check_eos, prefill, request_keys
from jaxspec.models.cache import KVCache
from jaxspec.models.model import Model, forward, forward_packed
from jaxspec.parallel import sharding as sharding_lib
from jaxspec.parallel.mesh import MeshConfig
from jaxspec.results import GenerationResult, GenerationStats, decode_texts
from jaxspec.sampling import SamplingConfig, probabilities, row_keys, sample
from jaxspec.spec import SpecConfig
from jaxspec.verify import accept

_DRAFT_TAG, _ACCEPT_TAG = 1, 2


@struct.dataclass
class Counters:
    """Per-row statistics accumulated on device."""

    row_steps: jax.Array      # steps in which the row was live
    drafted: jax.Array        # real draft tokens proposed
    verified: jax.Array       # draft slots sent to the target
    accepted: jax.Array       # draft tokens accepted
    emitted: jax.Array        # tokens emitted
    tried: jax.Array          # acceptance trials: accepted drafts plus the first rejection (`policy.observe`)

    @classmethod
    def zeros(cls, b: int) -> Counters:
        z = jnp.zeros((b,), jnp.int32)
        return cls(row_steps=z, drafted=z, verified=z, accepted=z, emitted=z, tried=z)


@struct.dataclass
class DecodeState:
    target_cache: KVCache
    draft_state: object
    seq_bl: jax.Array         # prompt + emitted tokens of each row
    out_bo: jax.Array         # emitted tokens only
    n_out_b: jax.Array        # tokens emitted so far
    done_b: jax.Array
    counters: Counters
    steps: jax.Array
    # Only when this decoder drafts for a higher level (a chain): the distribution each emitted
    # token was drawn from, which the level above needs for rejection sampling, and its
    # acceptance surrogate for TETRIS.
    probs_bov: jax.Array | None = None
    logprob_bo: jax.Array | None = None
    # Only under the goodput policy: acceptance tracking and the next step's choice.
    policy: policy_lib.PolicyState | None = None


def emit_and_commit(state: DecodeState, window_bk1, emit_count_b, max_new_b, eos_id, out_len: int,
                    record=None):
    """Writes each row's first `emit_count_b` window tokens (cut at eos and the budget)."""
    b, width = window_bk1.shape
    j = jnp.arange(width)[None, :]
    live_b = ~state.done_b
    count_b = jnp.minimum(emit_count_b, max_new_b - state.n_out_b)
    is_eos_bk = (window_bk1 == eos_id) & (j < count_b[:, None])
    first_eos_b = jnp.argmax(is_eos_bk, axis=1)
    count_b = jnp.where(jnp.any(is_eos_bk, axis=1), first_eos_b + 1, count_b)
    count_b = jnp.where(live_b, count_b, 0).astype(jnp.int32)
    writes_bk = j < count_b[:, None]
    rows_bk = jnp.broadcast_to(jnp.arange(b)[:, None], (b, width))
    out_at = jnp.where(writes_bk, state.n_out_b[:, None] + j, out_len)       # out of range: dropped
    pending_b = state.target_cache.lengths
    seq_at = jnp.where(writes_bk, pending_b[:, None] + 1 + j, state.seq_bl.shape[1])
    out_bo = state.out_bo.at[rows_bk, out_at].set(window_bk1, mode="drop")
    seq_bl = state.seq_bl.at[rows_bk, seq_at].set(window_bk1, mode="drop")
    if record is not None:
        probs_bk1v, logprob_bk1 = record
        state = state.replace(probs_bov=state.probs_bov.at[rows_bk, out_at].set(probs_bk1v, mode="drop"),
                              logprob_bo=state.logprob_bo.at[rows_bk, out_at].set(logprob_bk1, mode="drop"))
    n_out_b = state.n_out_b + count_b
    hit_eos_b = jnp.any(is_eos_bk & writes_bk, axis=1)
    done_b = state.done_b | hit_eos_b | (n_out_b >= max_new_b)
    # The target processed pending and the accepted drafts: keep exactly the emitted ones.
    cache = state.target_cache.commit(pending_b + count_b)
    return state.replace(target_cache=cache, seq_bl=seq_bl, out_bo=out_bo, n_out_b=n_out_b, done_b=done_b), count_b


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The static shape of one speculative step (a compiled branch).

    Attributes:
      k: draft tokens proposed per row (k + extra under TETRIS; 0 = a plain decoding step).
      capacity: None for standard selection (every row verifies all its drafts in a padded
        [b, k + 1] pass); else TETRIS, compiled for this many selected drafts at most.
      capacities: goodput policy with TETRIS: candidate budgets searched every step, each with its
        own packed verification size (capacity is then their maximum).
      cache_len: the cache size, for cost predictions.
      threshold: confidence-threshold drafting (SpecConfig.threshold).
      calibrate: goodput policy: whether the step counts draft confidence against acceptance (the
        calibration that TETRIS and threshold drafting read, `policy.calibrated_logprobs`). A
        schedule with neither skips it: the count and the drafter's log-probabilities it reads
        were 23 of the 33 kernels a goodput step at batch 1 ran more than a fixed-k step
        (`scripts/step_kernels.py`), each a few microseconds on XLA:CPU.
    """

    k: int
    capacity: int | None = None
    capacities: tuple[int, ...] | None = None
    cache_len: int = 0
    threshold: float | None = None
    calibrate: bool = True


def empty_proposal(b: int) -> Proposal:
    """The proposal of a step that does not draft (k = 0)."""
    return Proposal(tokens_bk=jnp.zeros((b, 0), jnp.int32), q_bkv=jnp.zeros((b, 0, 1), jnp.float32),
                    num_drafts_b=jnp.zeros((b,), jnp.int32), logprob_bk=jnp.zeros((b, 0), jnp.float32))


def draft_phase(drafter: Drafter, k: int, sampling: SamplingConfig, draft_params, draft_state, seq_bl, pending_b,
                n_out_b, request_keys_b) -> tuple[Proposal, object]:
    """Step part 1, the drafter's side: propose k tokens per row.

    It reads only token ids and lengths of the target's side (`seq_bl`, the pending positions, the
    emitted counts that seed the RNG), so it can run on another device slice than the target
    (`jaxspec.parallel`); its output, the Proposal, is all the target's side needs.
    """
    if k == 0:
        return empty_proposal(seq_bl.shape[0]), draft_state
    step_key_b = row_keys(request_keys_b, n_out_b)
    draft_key_b = jax.vmap(jax.random.fold_in, (0, None))(step_key_b, _DRAFT_TAG)
    return drafter.propose(draft_params, draft_state, seq_bl, pending_b, k, draft_key_b, sampling)


def verify_phase(target_graphdef, plan: StepPlan, sampling: SamplingConfig, target_params, state: DecodeState,
                 proposal: Proposal, request_keys_b, max_new_b, eos_id, out_len: int, budget=None,
                 capacity_seconds_j=None) -> DecodeState:
    """Step part 2, the target's side: select -> verify -> accept -> commit, for every row.

    Args:
      plan: the step's static shape (StepPlan); plan.k must equal the proposal's length.
      proposal: what `draft_phase` proposed from this same state.
      budget: traced number of drafts TETRIS may select (<= plan.capacity; default all of it).
      capacity_seconds_j: predicted step time of each of plan.capacities, when the step searches
        TETRIS budgets by goodput.
    """
    b, k = state.seq_bl.shape[0], plan.k
    if k == 0 and state.probs_bov is None:
        return plain_step(target_graphdef, sampling, target_params, state, request_keys_b, max_new_b, eos_id,
                          out_len)
    pending_b = state.target_cache.lengths
    pending_tok_b = jnp.take_along_axis(state.seq_bl, pending_b[:, None], axis=1)[:, 0]
    step_key_b = row_keys(request_keys_b, state.n_out_b)
    live_b = ~state.done_b
    if plan.threshold is not None and k > 0:
        # Threshold drafting: each row's window ends where its cumulative confidence drops below
        # the threshold (a prefix: the cumulative estimate never increases along a row).
        estimate_bk = proposal.logprob_bk
        if state.policy is not None:
            estimate_bk = policy_lib.calibrated_logprobs(state.policy, estimate_bk)
        above_b = jnp.sum(tetris.cumulative_logprobs(estimate_bk) >= jnp.log(plan.threshold), axis=1)
        proposal = proposal.replace(num_drafts_b=jnp.minimum(proposal.num_drafts_b, above_b).astype(jnp.int32))
    drafts_bk = proposal.tokens_bk
    window_bk1 = jnp.concatenate([pending_tok_b[:, None], drafts_bk], axis=1)
    if plan.capacity is None:
        # Standard: the target scores the pending token and every draft in one padded pass.
        verify_b = proposal.num_drafts_b
        logits_bk1v, target_cache = forward(target_graphdef, target_params, window_bk1, state.target_cache)
        verified_b = jnp.full((b,), k, jnp.int32)
    else:
        verify_b, logits_bk1v, target_cache = _tetris_verify(target_graphdef, target_params, plan, state, proposal,
                                                             window_bk1, max_new_b, budget, capacity_seconds_j)
        verified_b = verify_b
    accept_key_b = jax.vmap(jax.random.fold_in, (0, None))(step_key_b, _ACCEPT_TAG)
    accepted_b, next_b = accept(accept_key_b, drafts_bk, proposal.q_bkv, logits_bk1v, verify_b, sampling)
    # Emitted this step: d_1 .. d_a, then the correction / bonus token.
    j = jnp.arange(k + 1)[None, :]
    drafts_pad_bk1 = jnp.concatenate([drafts_bk, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted_bk1 = jnp.where(j < accepted_b[:, None], drafts_pad_bk1, next_b[:, None])
    state = state.replace(target_cache=target_cache)
    if state.policy is not None and k > 0:   # a plain step observes nothing (see `policy.age`)
        state = state.replace(policy=policy_lib.observe(state.policy, proposal.logprob_bk, verify_b, accepted_b,
                                                        live_b, calibrate=plan.calibrate))
    record = _record_for_level_above(logits_bk1v, emitted_bk1, sampling) if state.probs_bov is not None else None
    state, count_b = emit_and_commit(state, emitted_bk1, accepted_b + 1, max_new_b, eos_id, out_len, record)
    live = live_b.astype(jnp.int32)
    c = state.counters
    counters = Counters(row_steps=c.row_steps + live, drafted=c.drafted + live * proposal.num_drafts_b,
                        verified=c.verified + live * verified_b, accepted=c.accepted + live * accepted_b,
                        emitted=c.emitted + count_b,
                        tried=c.tried + live * jnp.minimum(accepted_b + 1, verify_b))
    # A step over finished rows only (a host-driven loop may run one) is not counted.
    return state.replace(counters=counters, steps=state.steps + jnp.any(live_b).astype(jnp.int32))


def plain_step(target_graphdef, sampling: SamplingConfig, target_params, state: DecodeState, request_keys_b,
               max_new_b, eos_id, out_len: int) -> DecodeState:
    """A step without drafts (k = 0), as lean as the autoregressive loop's: the general path's
    window bookkeeping (eos search over the window, cut at the budget, masked scatters, draft
    counters) cost 5% of a plain step at batch 16 on XLA:CPU (11.85 against 11.27 ms), which the
    goodput policy paid wherever it turned speculation off. It draws the token exactly as the
    general path's acceptance does with no drafts (the resample key of `verify.rejection_accept`,
    from p itself), so a request's tokens do not depend on which path emitted them.
    """
    rows = jnp.arange(state.seq_bl.shape[0])
    live_b = ~state.done_b
    pending_b = state.target_cache.lengths
    pending_tok_b = state.seq_bl[rows, pending_b]
    logits_b1v, cache = forward(target_graphdef, target_params, pending_tok_b[:, None], state.target_cache)
    if sampling.greedy:
        token_b = jnp.argmax(logits_b1v[:, 0], axis=-1).astype(jnp.int32)
    else:
        key_b = jax.vmap(jax.random.fold_in, (0, None))(row_keys(request_keys_b, state.n_out_b), _ACCEPT_TAG)
        resample_key_b = jax.vmap(lambda key: jax.random.split(key)[1])(key_b)
        p_bv = probabilities(logits_b1v[:, 0], sampling)
        p_bv = p_bv / jnp.sum(p_bv, axis=-1, keepdims=True)    # as the general path renormalises
        token_b = jax.vmap(sample)(resample_key_b, p_bv)
    live = live_b.astype(jnp.int32)
    # A finished row writes nothing: its index is out of range, and the write is dropped.
    out_bo = state.out_bo.at[rows, jnp.where(live_b, state.n_out_b, out_len)].set(token_b, mode="drop")
    seq_bl = state.seq_bl.at[rows, jnp.where(live_b, pending_b + 1, state.seq_bl.shape[1])].set(token_b, mode="drop")
    n_out_b = state.n_out_b + live
    done_b = state.done_b | (live_b & (token_b == eos_id)) | (n_out_b >= max_new_b)
    c = state.counters
    counters = c.replace(row_steps=c.row_steps + live, emitted=c.emitted + live)
    return state.replace(target_cache=cache.commit(pending_b + live), seq_bl=seq_bl, out_bo=out_bo, n_out_b=n_out_b,
                         done_b=done_b, counters=counters, steps=state.steps + jnp.any(live_b).astype(jnp.int32))


def speculative_step(target_graphdef, drafter: Drafter, plan: StepPlan, sampling: SamplingConfig,
                     target_params, draft_params, state: DecodeState, request_keys_b, max_new_b, eos_id,
                     out_len: int, budget=None, capacity_seconds_j=None) -> DecodeState:
    """One draft -> select -> verify -> accept -> commit step for every row (static shapes).

    The composition of `draft_phase` and `verify_phase`; the pipelined engine runs the same two
    functions on two device slices.
    """
    proposal, draft_state = draft_phase(drafter, plan.k, sampling, draft_params, state.draft_state, state.seq_bl,
                                        state.target_cache.lengths, state.n_out_b, request_keys_b)
    return verify_phase(target_graphdef, plan, sampling, target_params, state.replace(draft_state=draft_state),
                        proposal, request_keys_b, max_new_b, eos_id, out_len, budget, capacity_seconds_j)


def _tetris_verify(target_graphdef, target_params, plan: StepPlan, state: DecodeState, proposal: Proposal,
                   window_bk1, max_new_b, budget, capacity_seconds_j):
    """TETRIS: choose each row's window across the batch, then verify exactly those tokens, packed.

    A slot is usable if it is a real proposal, its row is live, and what it could emit fits in the
    row's remaining token budget. Returns (window lengths, logits [b, k + 1, v], target cache).
    """
    b, k = window_bk1.shape[0], plan.k
    j = jnp.arange(k)[None, :]
    remaining_b = max_new_b - state.n_out_b
    usable_bk = (j < proposal.num_drafts_b[:, None]) & ~state.done_b[:, None] & (j + 2 <= remaining_b[:, None])
    logprob_bk = tetris.acceptance_logprobs(proposal, usable_bk)
    if state.policy is not None:
        logprob_bk = policy_lib.calibrated_logprobs(state.policy, logprob_bk)
    if plan.capacities is None:
        verify_b = tetris.select(logprob_bk, plan.capacity, budget)
        logits_bk1v, cache = forward_packed(target_graphdef, target_params, window_bk1, verify_b + 1,
                                            state.target_cache, b + plan.capacity)
        return verify_b, logits_bk1v, cache
    # Goodput: the budget with the most expected tokens per predicted second; each candidate has
    # its own compiled packed size.
    goodput_j = policy_lib.goodput_of_capacities(tetris.cumulative_logprobs(logprob_bk).reshape(-1),
                                                 jnp.sum(~state.done_b), plan.capacities, capacity_seconds_j)
    choice = jnp.argmax(goodput_j)
    verify_b = tetris.select(logprob_bk, plan.capacity, jnp.asarray(plan.capacities)[choice])
    branches = [functools.partial(_packed_branch, packed_len=b + c) for c in plan.capacities]
    logits_bk1v, cache = jax.lax.switch(choice, branches, target_graphdef, target_params, window_bk1, verify_b + 1,
                                        state.target_cache)
    return verify_b, logits_bk1v, cache


def _packed_branch(graphdef, params, window_bw, counts_b, cache, *, packed_len: int):
    return forward_packed(graphdef, params, window_bw, counts_b, cache, packed_len)


def _record_for_level_above(logits_bk1v, emitted_bk1, sampling: SamplingConfig):
    """What a chain level reports for each emitted token: the distribution p it follows exactly
    (the level above's q), and the acceptance surrogate TETRIS ranks (see `draft_logprob`)."""
    p_bk1v = probabilities(logits_bk1v, sampling)
    logprob_bk1 = jax.vmap(draft_logprob, (1, 1, 1, None, None), 1)(logits_bk1v, emitted_bk1, p_bk1v, sampling,
                                                                    sampling.greedy)
    return p_bk1v, logprob_bk1


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


def initial_state(target_graphdef, sampling: SamplingConfig, target_params, tokens_bp, prompt_len_b, max_new_b,
                  request_keys_b, eos_id, *, cache_len: int, seq_len: int, out_len: int, mesh=None) -> DecodeState:
    """The target's prefill and first token, and the loop state before the first step (no drafter).

    `mesh`: a jax Mesh to lay the target's KV cache out on (rows over data, kv heads over tensor).
    """
    b, p = tokens_bp.shape
    cache, first_b, n_out_b, done_b = prefill(target_graphdef, target_params, tokens_bp, prompt_len_b, max_new_b,
                                              request_keys_b, eos_id, sampling, cache_len)
    if mesh is not None:
        cache = sharding_lib.constrain_cache(cache, mesh)
    rows = jnp.arange(b)
    seq_bl = jnp.zeros((b, seq_len), jnp.int32).at[:, :p].set(tokens_bp)
    seq_bl = seq_bl.at[rows, prompt_len_b].set(first_b)
    out_bo = jnp.zeros((b, out_len), jnp.int32).at[:, 0].set(first_b)
    return DecodeState(target_cache=cache, draft_state=(), seq_bl=seq_bl, out_bo=out_bo, n_out_b=n_out_b,
                       done_b=done_b, counters=Counters.zeros(b).replace(emitted=n_out_b), steps=jnp.int32(0))


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
# ... and at most this many: each return lets the host correct the step times from the segment's
# measured time (`cost.StepTimeTracker`), and costs a round trip (1-2 ms on XLA:CPU, a third of a
# step at batch 1). A first segment planned by the profile alone (`measure_plans=False`) is kept
# short so its correction comes early; plans timed at warm-up need none that soon (the device
# still switches plans within the segment when the acceptance it sees asks for it).
FIRST_SEGMENT_CAP = MIN_SEGMENT
# A timing trial (`StepTimeTracker.explore`) runs at most this many steps: enough to time its plan
# (at batch 1 of the tiny-8L pair, 16 plain steps take 10 ms against a 1 ms round trip), then the
# policy takes over again. A trial of MAX_SEGMENT_CAP steps (the rule before) is two thirds of a
# 96-token call at batch 1 or more: in a batch-1 diagnostic the trials of k = 4 and 5 each ran a
# whole call.
TRIAL_STEPS = 16
# A call may instead open on a plan tied with the one it would run (within the switch margin) whose
# last timing is TIE_RETIME segments old, for a whole segment (`StepTimeTracker.retime_tie`).
TIE_RETIME = 4
# Lean calls (`SpeculativeDecoder._lean_call`) after a call that decoded plainly throughout before
# a call lets the device choose its plan again.
LEAN_CALLS = 3
# How far the corrected step times may have moved in drafting's favour since the call that
# qualified lean calls (a drafting plan's time relative to plain decoding's) before the next call
# lets the device choose instead: half the policy's switch margin.
LEAN_DRIFT = 0.02
# Distinct openings whose counts a decoder keeps (`SpeculativeDecoder._opening_tokens`).
OPENING_MEMO_SIZE = 64
# A drafting segment re-chooses its plan every `SpecConfig.choose_every` steps (from MIN_SEGMENT
# on; 4 by default), not every step: the choice is a few hundred small operations (the drain rule's
# expected maximum over rows, the judgement of a stop over the rows' remaining tokens), which
# XLA:CPU runs one by one. Every step it cost 1.8-3.5% of a batch-1 call of the tiny-8L pair at
# k = 4 (a 2 ms step); a switch the acceptance asks for comes at most choose_every - 1 steps later.
MAX_SEGMENT_CAP = 64
# Goodput warm-up with `SpecConfig.measure_plans` (`SpeculativeDecoder._warm_up`): after one
# untimed step, each plan is timed in passes of up to MEASURE_STEPS steps, as many as make about
# MEASURE_PASS_SECONDS by the cost model for the first pass and by that pass's time after it (at
# batch 64 a k = 6 step takes 0.2 s: one step a pass is enough there, and more would add seconds
# to the first call; a sub-millisecond step timed one at a time is lost in the round trip's
# jitter, and a cost model far off sized it so). Passes of at most 3 steps timed the cheap plans
# slow, the cheapest most: at batch 16 the plain step by 14-17% (13.3-13.5 ms against 11.3-12.3
# in the run's long segments) and k = 1 by 7%, which tilted near-ties toward drafting; with up
# to 8 steps the plain step was timed at 11.4-11.6 ms, and the first call took no longer (the
# passes' length is bounded by MEASURE_PASS_SECONDS). At batch 1, where the cap and not the
# seconds bounds a pass, passes of up to 8 steps timed the drafting plans' line too steep: over 5
# warm-ups of the tiny-8L pair (96 tokens) the slope per drafted token came out 0.129 of a k = 1
# step on average (sd 0.042), and a steep line tilts the pick toward shorter drafts (k = 4 where
# fixed k = 5-6 ran faster). Passes of up to 32 steps: 0.086 (sd 0.018) in the same process; in
# another 0.084, against 0.098 with 16 and 0.075 with 64 (the longer the pass, the less the
# slope). The call's jitter (about a millisecond) is spread over 31 steps instead of 7, for
# about a second more of the first call there; a batch-1 benchmark then ran the best fixed k in
# all of its 32 calls. MEASURE_PASSES passes go round
# the plans, more (up to MEASURE_MAX_PASSES) while the timing has taken under MEASURE_SECONDS:
# small shapes, whose few-millisecond steps are the noisiest, are timed more often at little cost.
# Each pass makes every plan's 1-step call, then every plan's longer call, and a plan's step time
# is the difference of its two calls over the steps the longer one added: on XLA:CPU a drafting
# program's call costs about 1.3 ms besides its steps and the round trip (tiny-8L pair, batch 1:
# k = 2 timed at 2.1 / 1.56 / 1.32 ms a step in loops of 2 / 6 / 24 steps), which over 8 steps
# had timed drafting 15-25% dear at batch 1 and kept a run in plain decoding where k = 2-3 was
# faster. That cost goes into the round trip instead (the median, over the passes, of a 1-step
# call less its step). A plan whose rows have too few tokens left for its next pass restarts from
# a copy of the prefilled rows (after an untimed step): a pass that ran the rows out was timed
# with the call's own cost in it, and at batch 1 the drafting plans' fourth and fifth passes did
# (k = 3 at 2.56-2.71 ms a step where its other passes took 1.74-2.34 and a fixed k = 3 run's
# steps 1.8), which tilted a near-tie toward plain decoding.
MEASURE_STEPS = 32
MEASURE_PASS_SECONDS = 0.1
MEASURE_PASSES = 3
MEASURE_MAX_PASSES = 8
MEASURE_SECONDS = 0.5
# A segment's round trip (a call that runs no step, and the fetch of its outputs) is the median of
# ROUND_TRIPS such calls, going round the plans as the run's segments do. The fastest of three
# calls of one plan (the rule before) was 1.4 ms where the tiny-8L pair's 1-step segments at batch
# 1 took 2.0-2.2 ms besides their step: the drain rule then switched to plain decoding for a row's
# last token, a switch that saved 1.6 ms of drafting and cost a 2 ms round trip.
ROUND_TRIPS = 9


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
    (`SpeculativeDecoder._lean_call`). Split into `start_on_device` and a plain `run_on_device`
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
    `MEASURE_STEPS`). Where a stall makes that difference implausibly small, a tenth of the long
    loop's average step stands in. The cost model's profiler fits its coefficients to these times."""
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

    def step() -> tuple[float, float]:
        long = run(1 + iterations)
        return (long - run(1)) / iterations, long / (1 + iterations)

    step()
    times, averages = zip(*(step() for _ in range(repeats)), strict=True)
    # A stall in the one-step loop can make the difference near zero or negative (a loaded
    # machine); a step is never cheaper than a tenth of the long loop's average step.
    return max(float(np.median(times)), 0.1 * float(np.median(averages)), 1e-9)


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


def _on_host(tree):
    """`put` on one device: values stay on the host until a compiled call takes them."""
    return tree


class SpeculativeDecoder:
    """Batched speculative decoding of a target model with a drafter.

    Args:
      target: the jaxspec.Model whose distribution the output follows exactly.
      draft: a smaller Model with the same vocabulary, a drafter such as
        `jaxspec.NgramDrafter(max_ngram=3)`, or another SpeculativeDecoder (a multi-level chain).
      spec: SpecConfig (k, selection, policy, ...).
      sampling: SamplingConfig used by target and draft alike.
      mesh: a `jaxspec.MeshConfig`: the target sharded over its (data, tensor) mesh and the draft
        on its own slice (or on the target's mesh when draft_tp=0). None: the default device.
    """

    def __init__(self, target: Model, draft, spec: SpecConfig | None = None,
                 sampling: SamplingConfig | None = None, mesh=None):
        self.spec = spec if spec is not None else SpecConfig()
        self.sampling = sampling if sampling is not None else SamplingConfig()
        if not isinstance(self.spec, SpecConfig):
            raise ValueError(f"spec must be a jaxspec.SpecConfig, got {type(self.spec).__name__}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(f"sampling must be a jaxspec.SamplingConfig, got {type(self.sampling).__name__}")
        if not isinstance(target, Model):
            raise ValueError(f"target must be a jaxspec.Model, got {type(target).__name__}")
        if mesh is not None and not isinstance(mesh, MeshConfig):
            raise ValueError(f"mesh must be None or a jaxspec.MeshConfig, got {type(mesh).__name__}")
        self.mesh = mesh
        self._sliced = self.spec.pipeline or (mesh is not None and mesh.separate_draft)
        if self._sliced and self.spec.policy != "fixed":
            raise ValueError("policy='goodput' runs as one on-device program and cannot yet be combined with "
                             "pipeline=True or a separate draft slice (MeshConfig.draft_tp > 0)")
        if mesh is not None:
            if isinstance(draft, SpeculativeDecoder):
                raise ValueError("a multi-level chain draft cannot be placed on a MeshConfig yet; pass mesh=None")
            mesh.check(target.config, draft.config if isinstance(draft, Model) else None)
            self._target_mesh, self._draft_mesh = mesh.target_mesh(), mesh.draft_mesh()
            target = sharding_lib.place_params(target, self._target_mesh)
            if isinstance(draft, Model):
                draft = sharding_lib.place_params(draft, self._draft_mesh)
        elif self._sliced:
            self._target_mesh = self._draft_mesh = MeshConfig(target_tp=1, draft_tp=0).target_mesh()
        else:
            self._target_mesh = self._draft_mesh = None
        self.target = target
        self.drafter = _as_drafter(draft, target.config.vocab_size, self.spec)
        self.draft = draft
        # Two-slice engines only: set to {"draft": [], "verify": []} to record the seconds of each
        # draft and verify call, each timed alone (blocking: no overlap; for measurements).
        self.phase_timings: dict[str, list[float]] | None = None
        self._warm: dict = {}   # goodput: per compiled shape, what `_warm_up` measured
        # Goodput: per compiled shape, the step times measured by the runs so far
        # (`cost.StepTimeTracker`): each call starts from what the calls before it measured.
        self._trackers: dict = {}
        # Goodput: the acceptance measured by warm-ups and at the end of runs; seeds a run's rows.
        self._acceptance = policy_lib.AcceptanceMemory()
        # Goodput: per compiled shape, the plan the last call opened on (the next call's first
        # segment is dispatched on it before the device's choice is read; see `run_on_device`).
        self._openings: dict = {}
        # Goodput: per compiled shape, the streak of lean calls since the last call that decoded
        # plainly in one segment, while the next call may be lean (`_lean_call`).
        self._lean: dict[tuple, _LeanStreak] = {}
        # Goodput: the openings' counts of tokens per step, by what they depend on (`_opening_tokens`).
        self._opening_memo: dict = {}

    def __repr__(self):
        return f"SpeculativeDecoder(target={self.target!r}, draft={self.draft!r}, spec={self.spec!r})"

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size

    def generate(self, prompts, max_new_tokens=64, seed: int = 0, eos_token_id: int | None = None,
                 batch_size: int | None = None, on_finish=None, request_ids=None) -> GenerationResult:
        """Speculative generation; same arguments and result as `jaxspec.generate`.

        Args:
          batch_size: rows decoded at once (slots). None: every prompt at once. With more prompts
            than slots, a finished row is refilled with the next queued prompt (continuous
            batching); each request's output is the same as generating it alone.
          on_finish: called on the host as `on_finish(index, tokens, counters)` as soon as the
            request at `prompts[index]` finishes (counters: its row_steps, drafted, verified,
            accepted and emitted). The loop then returns to the host once per finished request
            (not per token), so a batch job can save each result as it comes.
          request_ids: distinct ints naming each prompt's RNG stream (default: its index), as in
            `jaxspec.generate`.
        """
        cfg, k = self.target.config, self.spec.draft_len
        eos = check_eos(eos_token_id, cfg.vocab_size)
        batch = prompts_lib.prepare(prompts, self.target.tokenizer, vocab_size=cfg.vocab_size,
                                    max_positions=cfg.max_position_embeddings, max_new_tokens=max_new_tokens,
                                    request_ids=request_ids)
        cache_len = cache_length(batch.tokens_bp.shape[1], batch.out_len, int(np.max(batch.max_new_b)), k)
        if self._sliced:
            return self._generate_sliced(batch, seed, eos, cache_len, batch_size, on_finish)
        multiple = self.mesh.target_dp if self.mesh is not None else 1
        slots = prompts_lib.bucket_batch(batching.check_batch_size(batch_size, batch.num_prompts))
        slots = -(-slots // multiple) * multiple
        queue = batching.RequestQueue(batch, on_finish=on_finish)
        table = batching.SlotTable(queue, slots, multiple)
        first = table.first_batch(queue.pop(slots))
        schedule, budget = self._schedule(slots, first.num_prompts, cache_len)
        goodput = schedule.predict_ks is not None
        predicted = self._predicted_seconds(schedule, slots, cache_len)
        static = dict(cache_len=cache_len, seq_len=cache_len, out_len=batch.out_len, mesh=self._target_mesh)
        graphdef, params, dparams = self.target.graphdef, self.target.params, self.drafter.params
        # On a mesh host values are placed replicated. On one device they go to the compiled calls
        # as numpy arrays: jit's own transfer of a few small arrays costs microseconds, where an
        # eager `jax.device_put` of them cost 0.1-0.4 ms of host time each (tiny-8L pair, XLA:CPU),
        # before the prefill and after each segment, while the device sits idle.
        put = (functools.partial(sharding_lib.put, sharding=sharding_lib.replicated(self._target_mesh))
               if self._target_mesh is not None else _on_host)
        keys_b = request_keys(seed, first.request_ids_b)
        *rows_in, eos_t, budget_t = put((first.tokens_bp, first.lengths_b, first.max_new_b, keys_b, np.int32(eos),
                                         np.int32(budget)))
        tracker = None
        if goodput:
            shape_key = (slots, cache_len, batch.out_len, schedule)
            if shape_key not in self._warm:
                warm = self._warm_up(schedule, rows_in, eos_t, budget_t, predicted, static, put)
                if warm.acceptance is not None:
                    self._acceptance.remember(*warm.acceptance)
                if warm.plan_seconds is not None:
                    predicted = _with_measured(predicted, warm.plan_seconds, schedule)
                # What a switch of plans costs, and what starting to draft costs a position: the
                # device weighs them against the time a switch saves.
                predicted["round_trip"] = np.float32(warm.round_trip)
                predicted["position"] = np.float32(warm.position_seconds)
                # Kept with the warm-up: rebuilding it every call (the line fit included) cost
                # 0.3 ms of host time a call, 0.5% of a 96-token call at batch 1 on XLA:CPU.
                self._warm[shape_key] = warm._replace(predicted=predicted)
            warm = self._warm[shape_key]
            predicted = warm.predicted
            # Step times corrected as segments are measured (passed traced: no recompile), from
            # where the calls before at this shape left them: a call of one segment (plain
            # decoding at large batches) would otherwise be judged by the warm-up's times alone.
            if shape_key not in self._trackers:
                self._trackers[shape_key] = cost_lib.StepTimeTracker(
                    predicted["plans"], kinds=[p.k > 0 for p in schedule.plans], round_trip=warm.round_trip,
                    measured=None if warm.plan_seconds is None else np.isfinite(warm.plan_seconds))
            tracker = self._trackers[shape_key]
            tracker.new_call()
            # Goodput: the first segment is queued behind the prefill on a guess of the opening plan
            # (the last call's at this shape; `follow` below); on XLA:CPU waiting for the device's
            # choice first cost 1-1.5 ms a call, 2% of a 96-token call at batch 1. A wrong guess runs
            # no step and costs what that wait did. A call that opens on a timing trial runs the
            # trial's plan instead (the drafter prefilled if it drafts), timed once the prefill is done.
            plan_index = self._openings.get(shape_key, schedule.predict_ks.index(0))
            remembered = self._acceptance.seed(schedule.positions)   # (alpha, weight, evidence, spread, profile...)
            trial, whole = self._opening_trial(schedule, tracker, plan_index, remembered,
                                               np.asarray(first.max_new_b)[:first.num_prompts], not len(queue))
            incumbent = plan_index   # what a trial stands in for (`_after_trial`)
            plan_index = plan_index if trial is None else trial
            opening_trial = trial
            longest = int(np.max(np.asarray(first.max_new_b)[:first.num_prompts]))
            opening_ratio_j = tracker.ratio()
            if (trial is None and on_finish is None and not len(queue) and self._target_mesh is None
                    and self._lean_call(shape_key, schedule, plan_index, longest, opening_ratio_j)):
                return self._generate_lean(schedule, shape_key, tracker, warm, plan_index, batch, queue, table,
                                           rows_in, eos_t, static, slots)
            # The acceptance last measured seeds the rows; whether requests wait for slots.
            seconds, next_choice, acceptance, draining = put((
                _as_arrays(_scaled(predicted, opening_ratio_j, schedule)), np.int32(-1 if trial is None else trial),
                remembered, np.bool_(not len(queue))))
        else:
            seconds, next_choice, acceptance, draining = put(_as_arrays(predicted)), None, None, None
            plan_index, trial, whole = 0, None, False
        start = time.perf_counter()
        state = start_on_device(graphdef, self.drafter, prefill_schedule(schedule), self.sampling, params, dparams,
                                *rows_in, eos_t, seconds, next_choice, acceptance, draining, **static)
        max_new_b, keys_b = rows_in[2], rows_in[3]
        opening = goodput and trial is None
        if trial is not None:
            jax.block_until_ready(state)
        hold = 0
        no_cap = put(np.int32(batch.out_len + 1))
        step_ks: list[int] = []
        segment_cap = (FIRST_SEGMENT_CAP if goodput and warm.plan_seconds is None and not tracker.segments
                       else MAX_SEGMENT_CAP)
        while True:
            # With requests waiting (or a caller waiting for each result), stop as soon as one
            # more row is done, to refill it or hand it over.
            stop = 1 if len(queue) or (on_finish is not None and table.active > 1) else 0
            # A plain segment runs until the policy would probe speculation again
            # (`policy.plain_horizon`): no round trips in between.
            plain = goodput and trial is None and schedule.plans[plan_index].k == 0 and hold > 0
            drains = not len(queue)
            segment_start = time.perf_counter()
            if goodput:
                steps_cap = hold if plain else (TRIAL_STEPS if trial is not None and not whole else segment_cap)
                flags = put((np.int32(stop), np.int32(steps_cap), np.bool_(drains),
                             np.bool_(opening)))
            else:
                flags = (put(np.int32(stop)), no_cap, None, None)
            state = run_on_device(graphdef, self.drafter, schedule, self.sampling, params, dparams, state, keys_b,
                                  max_new_b, eos_t, budget_t, seconds, *flags, **static, plan_index=plan_index)
            done_b, out_bo, n_out_b, counters, steps, policy, max_new = _segment_outputs(state, max_new_b)
            segment_seconds = time.perf_counter() - segment_start
            segment_steps = int(steps) - len(step_ks)
            idle = bool(done_b.all())
            if opening:
                opening = False
                if segment_steps == 0 and not idle:   # the guess was wrong: run the device's choice
                    plan_index, hold = int(policy.choice), int(policy.hold)
                    self._openings[shape_key] = plan_index
                    continue
                self._openings[shape_key] = plan_index
                # Timed from the opening's dispatch: the segment started when the prefill ended.
                segment_seconds = time.perf_counter() - start - (warm.opening_seconds - warm.round_trip)
            step_ks += [schedule.plans[plan_index].k] * segment_steps
            if goodput:
                tracker.observe(plan_index, segment_steps, max(segment_seconds, 0.0),
                                trial=trial is not None and not whole)
                segment_cap, whole = MAX_SEGMENT_CAP, False
            if goodput and not idle:   # another segment follows: plan it
                seconds = put(_as_arrays(_corrected(predicted, tracker, schedule)))
                plan_index, hold, trial, incumbent = self._plan_segment(
                    schedule, tracker, policy, done_b, max_new - n_out_b, drains, trial, plan_index, incumbent)
            table.harvest(done_b, out_bo, n_out_b, counters)
            refill = table.refill()
            if refill is None:
                if table.active == 0 and not len(queue):
                    break
                continue
            slots_r, sub = refill
            keys_r = request_keys(seed, sub.request_ids_b)
            new_in = put((slots_r, sub.tokens_bp, sub.lengths_b, sub.max_new_b, keys_r))
            if goodput and idle:
                seconds = put(_as_arrays(_corrected(predicted, tracker, schedule)))
            state = refill_on_device(graphdef, self.drafter, schedule, self.sampling, params, dparams, state,
                                     *new_in, eos_t, seconds, **static)
            max_new_b, keys_b = put_rows(max_new_b, new_in[0], new_in[3]), put_rows(keys_b, new_in[0], new_in[4])
            if goodput and idle:
                # Every row was done: the refilled rows opened on their own plan (the read also
                # waits for the refill, as below).
                policy, done_b, n_out_b, max_new = jax.device_get((state.policy, state.done_b, state.n_out_b,
                                                                   max_new_b))
                plan_index, hold, trial, incumbent = self._plan_segment(
                    schedule, tracker, policy, done_b, max_new - n_out_b, not len(queue), trial, plan_index,
                    incumbent)
            elif goodput:
                jax.block_until_ready(state)   # so the next segment's wall time is its steps alone
        seconds_taken = time.perf_counter() - start
        tokens = queue.results()
        stats = _stats(Counters(**queue.counters), batch.num_prompts, int(steps), seconds_taken, step_ks, self.drafter)
        stats.extra["slots"] = slots
        if goodput:
            # A call that ran one plain segment from its opening to its end makes the next calls at
            # the shape lean (`_lean_call`); any other call ends a streak of them.
            plain_through = (len(tracker.history) == 1 and schedule.plans[tracker.history[0][0]].k == 0
                             and opening_trial is None)
            if plain_through:
                self._lean[shape_key] = _LeanStreak(calls=0, longest=longest, ratio_j=opening_ratio_j)
            else:
                self._lean.pop(shape_key, None)
            stats.extra["segments"] = _segment_log(schedule, tracker)
            # The call's whole count seeds the next calls' rows; its requests' own counts measure how
            # far rows differ (`AcceptanceMemory.spread`).
            self._acceptance.remember(np.atleast_1d(policy.total_accepted), np.atleast_1d(policy.total_trials))
            self._acceptance.remember_requests(queue.counters["accepted"], queue.counters["tried"])
            self._acceptance.remember_positions(policy.pos_total_accepted_p, policy.pos_total_tried_p)
            # Per draft position p: how often the p-th draft was accepted when it was tried (None: never tried).
            stats.extra["acceptance_by_position"] = [float(a / t) if t > 0 else None for a, t in
                                                     zip(policy.pos_total_accepted_p, policy.pos_total_tried_p)]
        return GenerationResult(tokens=tokens, texts=decode_texts(self.target.tokenizer, tokens), stats=stats)

    def _lean_call(self, shape_key, schedule: Schedule, plan_index: int, longest: int, ratio_j: np.ndarray) -> bool:
        """Whether a goodput call that opens on `plan_index` with no timing trial, no request
        waiting and no per-request callback runs as one program of plain decoding
        (`plain_call_on_device`), its longest request asking for `longest` tokens, its step times
        corrected by `ratio_j` (`StepTimeTracker.ratio`).

        It does when the call would open on plain decoding and one of the last calls at the shape
        decoded plainly in one segment from its opening to its end, for requests no shorter, with
        fewer than LEAN_CALLS lean calls since. Such a call's device choices are that one's but for
        the step times: plain decoding observes no acceptance (the remembered acceptance the
        opening judges by is unchanged), and its plain segment's look-ahead (`policy.hold`) covered
        the whole call. The step times are corrected after every segment, a lean call's included,
        so a call is lean only while no drafting plan's corrected time has fallen against plain
        decoding's by more than LEAN_DRIFT since the qualifying call's opening: where they have,
        the device, judging by them, may now draft. (In a batch-1 benchmark run a goodput + TETRIS
        decoder decoded plainly for three whole calls after a plain trial, the last two of them
        lean, each taking 1.5-2.0x its round's fixed k = 4 call; its drafting calls took 0.9-1.2x.)
        A uniform drift of every plan moves only the switch's fixed costs against the steps'
        (the drafter's prefill, a round trip: a few percent of a call), so it is let pass. Every
        LEAN_CALLS + 1-th call lets the device choose again. Timing trials and ties come due as
        before (the call's opening checks them on the host first, `_opening_trial`)."""
        streak = self._lean.get(shape_key)
        if (streak is None or schedule.predict_ks[plan_index] != 0 or streak.calls >= LEAN_CALLS
                or longest > streak.longest):
            return False
        moved_j = np.asarray(ratio_j, np.float64) / streak.ratio_j
        drafting = np.asarray(schedule.predict_ks) > 0
        return bool(np.all(moved_j[drafting] * (1.0 + LEAN_DRIFT) >= moved_j[plan_index]))

    def _generate_lean(self, schedule: Schedule, shape_key, tracker: cost_lib.StepTimeTracker, warm: _Warm,
                       plan_index: int, batch, queue, table, rows_in, eos_t, static, slots: int) -> GenerationResult:
        """A goodput call of plain decoding throughout, in one program (`plain_call_on_device`)."""
        start = time.perf_counter()
        outputs = plain_call_on_device(self.target.graphdef, self.sampling, self.target.params, *rows_in, eos_t,
                                       **static)
        done_b, out_bo, n_out_b, counters, steps = jax.device_get(outputs)
        seconds_taken = time.perf_counter() - start
        steps = int(steps)
        # Timed from the dispatch, less what such a call costs besides its steps, plus the round trip
        # a segment's time holds. The general path's opening (`warm.opening_seconds`, the policy's
        # choice and conditionals in it) is dearer than this program's prefill: taken off instead,
        # it left no time at all for the steps of a 10-token call of the tiny test pair, and the
        # plain plan's corrected time went to zero. A call timed within the noise of that estimate
        # says nothing of its steps and is not folded in.
        segment_seconds = seconds_taken - (warm.lean_opening_seconds - warm.round_trip)
        if segment_seconds > warm.round_trip:
            tracker.observe(plan_index, steps, segment_seconds)
        table.harvest(done_b, out_bo, n_out_b, counters)
        streak = self._lean[shape_key]
        self._lean[shape_key] = streak._replace(calls=streak.calls + 1)
        tokens = queue.results()
        stats = _stats(Counters(**queue.counters), batch.num_prompts, steps, seconds_taken, [0] * steps, self.drafter)
        stats.extra.update(slots=slots, lean=True,
                           segments=_segment_log(schedule, tracker),
                           acceptance_by_position=[None] * schedule.positions)
        return GenerationResult(tokens=tokens, texts=decode_texts(self.target.tokenizer, tokens), stats=stats)

    def _opening_trial(self, schedule: Schedule, tracker: cost_lib.StepTimeTracker, guess: int, seed: np.ndarray,
                       remaining_r: np.ndarray, drains: bool) -> tuple[int | None, bool]:
        """A timing trial to open the call with (`StepTimeTracker.explore`), or None; and whether
        it runs a whole segment: a plan tied with the guess (`StepTimeTracker.retime_tie`), not
        a trial of TRIAL_STEPS steps charged to the trial budget.

        Trials are otherwise proposed between segments, and a call that runs one segment (plain
        decoding, or one draft length, all the way) has none: a ranking of near-tied plans that
        the warm-up's timing got wrong then stood for every later call at the shape (in one batch-4
        diagnostic, 15 calls in a row decoded plainly where fixed k = 1 ran 7% faster). Judged on the
        acceptance the decoder remembers (`seed`, `AcceptanceMemory.seed`), against the plan the
        call is expected to open on.

        Most calls have no plan in doubt, none due for re-timing and no tie due; they return before
        any expected tokens are counted (0.5 ms of host time a call at batch 1 on XLA:CPU, while
        the device waits for the call's first dispatch)."""
        if not tracker.segments or not (tracker.in_doubt(guess) or tracker.tie_due(guess, TIE_RETIME)):
            return None, False
        tokens_j = self._opening_tokens(schedule, seed, remaining_r, drain=False)
        trial = tracker.explore(guess, tokens_j, baseline=schedule.predict_ks.index(0), steps=TRIAL_STEPS)
        if trial is not None:
            return trial, False
        if not tracker.tie_due(guess, TIE_RETIME):   # spares most calls the drain count below
            return None, False
        if drains:
            # A tie needs the drain count unless even bounds rule it out: drafting plans at most
            # (a plain guess) or at least (a drafting guess) what the count could give them.
            bound = _drain_bound if schedule.predict_ks[guess] == 0 else _drain_floor
            if tracker.retime_tie(guess, bound(tokens_j, remaining_r, schedule.predict_ks),
                                  margin=policy_lib.SWITCH_MARGIN, segments=TIE_RETIME) is None:
                return None, False   # no tie even at the bounds: the count is spared
            # A tie is judged as the device will judge it (by when the slowest row is done): judged
            # by one step's tokens, at batch 16 drafting plans came within the margin of plain
            # decoding, and the device left them after 4 steps in most calls (a round trip each).
            tokens_j = self._opening_tokens(schedule, seed, remaining_r, drain=True)
        tie = tracker.retime_tie(guess, tokens_j, margin=policy_lib.SWITCH_MARGIN, segments=TIE_RETIME)
        return tie, tie is not None

    def _opening_tokens(self, schedule: Schedule, seed: np.ndarray, remaining_r: np.ndarray,
                        drain: bool) -> np.ndarray:
        """Each plan's tokens per step at a call's opening, every row at the remembered acceptance
        (`seed`, `AcceptanceMemory.seed`): one step's expected tokens, or with `drain`, what the
        plan is worth until the slowest of rows with `remaining_r` tokens to go is done
        (`policy.drain_tokens_per_step`). A pure function of its inputs, and they repeat: a call
        that decodes plainly leaves the remembered acceptance as it was, and a batch job's calls
        ask for the same lengths. So each is counted once: the drain count cost 0.8 ms of host
        time a call at batch 16 of the tiny-8L pair (16 tokens), while the device waited for the
        call's first dispatch, and 33 of 40 such calls needed it."""
        key = (drain, schedule.predict_ks, seed.tobytes(), remaining_r.astype(np.int64).tobytes())
        tokens_j = self._opening_memo.get(key)
        if tokens_j is None:
            if len(self._opening_memo) >= OPENING_MEMO_SIZE:
                self._opening_memo.clear()
            alpha_r = np.full(remaining_r.shape, seed[0])
            profile = seed[4:] if schedule.positions else None
            if drain:
                tokens_j = policy_lib.drain_tokens_per_step(alpha_r, np.ones(alpha_r.shape, bool), remaining_r,
                                                            schedule.predict_ks, xp=np, spread=float(seed[3]),
                                                            profile=profile)
            else:
                tokens_j = _expected_tokens(alpha_r, schedule.predict_ks, profile)
            tokens_j.setflags(write=False)   # shared by the calls that ask again
            self._opening_memo[key] = tokens_j
        return tokens_j

    def _plan_segment(self, schedule: Schedule, tracker: cost_lib.StepTimeTracker, policy, done_b, remaining_b,
                      drains: bool, trial, plan_index: int, incumbent: int) -> tuple[int, int, int | None, int]:
        """The next segment's plan, its hold (`policy.hold`), whether it is a timing trial
        (`StepTimeTracker.explore`) and the plan it stands in for if so (else the plan itself),
        from the policy state the device left (read on the host)."""
        choice, hold = int(policy.choice), int(policy.hold)
        decide_here = trial is not None
        if not decide_here and not tracker.in_doubt(choice):
            return choice, hold, None, choice
        alpha_b, profile = np.asarray(policy.alpha_b()), policy.profile_p(xp=np)
        if drains:
            tokens_j = policy_lib.drain_tokens_per_step(alpha_b, ~done_b, remaining_b, schedule.predict_ks, xp=np,
                                                        spread=float(policy.spread), profile=profile)
        else:
            tokens_j = _expected_tokens(alpha_b[~done_b], schedule.predict_ks, profile)
        if decide_here and tokens_j.size:
            # A trial was just measured: decide on the measurement now. The device chose with the
            # step times from before it: after a trial of k = 1 at batch 16 (where plain decoding
            # was best), running its choice went k = 3, 2, 4, 5, 4 steps each, then k = 1 again.
            # (Deciding here did not stop that: in the next run the host chose k = 2 after such
            # a trial and the device went on to k = 3 and 4.)
            choice = _after_trial(schedule, policy, tokens_j, tracker.corrected(), ~done_b, remaining_b, incumbent)
        trial = tracker.explore(choice, tokens_j, baseline=schedule.predict_ks.index(0), steps=TRIAL_STEPS)
        return (choice if trial is None else trial), hold, trial, choice

    def _generate_sliced(self, batch, seed: int, eos: int, cache_len: int, batch_size,
                         on_finish=None) -> GenerationResult:
        """Draft and target on two slices, stepped from the host; two pipelined batches if asked.

        Pipelined, the slots are split between two lanes that share one request queue; the first
        requests are split so both lanes start with equal work (MineDraft's assignment), and a
        lane refills its finished rows from the queue, so both stay full until it drains.
        """
        from jaxspec.parallel.pipeline import SlicedRunner, balanced_split
        n = batch.num_prompts
        multiple = self.mesh.target_dp if self.mesh is not None else 1
        slots_total = batching.check_batch_size(batch_size, n)
        queue = batching.RequestQueue(batch, on_finish=on_finish)
        first = queue.pop(slots_total)
        if self.spec.pipeline and n >= 2:
            halves = balanced_split(batch.max_new_b[first], len(first))
            groups = [[first[i] for i in h] for h in halves]
        else:
            groups = [first]
        rows = max(prompts_lib.bucket_batch(len(g)) for g in groups)   # one program for both lanes
        rows = -(-rows // multiple) * multiple
        tables = [batching.SlotTable(queue, rows, multiple) for _ in groups]
        lane_batches = [t.first_batch(g) for t, g in zip(tables, groups)]
        # Both lanes run one program, compiled for the larger lane's TETRIS capacity; each selects
        # its own budget inside it.
        plan = self._schedule(rows, max(len(g) for g in groups), cache_len)[0].plans[0]
        runner = SlicedRunner(self.target, self.drafter, plan, self.sampling, self._target_mesh, self._draft_mesh)
        runner.timings = self.phase_timings
        start = time.perf_counter()
        lanes = [runner.start(t, lb, seed, eos, cache_len, self._schedule(rows, len(g), cache_len)[1])
                 for t, lb, g in zip(tables, lane_batches, groups)]
        runner.run(lanes, eos)
        steps = sum(int(s) for s in jax.device_get([ln.state.steps for ln in lanes]))
        seconds = time.perf_counter() - start
        tokens = queue.results()
        stats = _stats(Counters(**queue.counters), n, steps, seconds, [plan.k] * steps, self.drafter)
        stats.extra["lanes"] = len(lanes)
        stats.extra["slots"] = rows * len(lanes)
        return GenerationResult(tokens=tokens, texts=decode_texts(self.target.tokenizer, tokens), stats=stats)

    def _schedule(self, rows: int, num_prompts: int, cache_len: int) -> tuple[Schedule, int]:
        """The compiled step shapes and the TETRIS per-step budget C (0 for standard selection).

        TETRIS with capacity=None spends C = N * k over the N real requests: the budget standard
        speculative decoding with k spends, the paper's fair comparison. The program is compiled
        for C rounded up to a bucket and selects exactly C inside it. The goodput policy compiles
        one branch per candidate: k = 0..k (standard), or k = 0..k+extra-1 and TETRIS with a few
        candidate budgets up to C.
        """
        spec, big_k = self.spec, self.spec.draft_len
        tetris_on = spec.selection == "tetris" and big_k > 0
        budget = 0
        if tetris_on:
            budget = min(spec.capacity if spec.capacity is not None else num_prompts * spec.k, rows * big_k)
        threshold = spec.threshold
        if spec.policy == "fixed":
            capacity = tetris.capacity_bucket(budget, rows, big_k) if tetris_on else None
            plan = StepPlan(k=big_k, capacity=capacity, cache_len=cache_len, threshold=threshold)
            return Schedule(plans=(plan,)), budget
        if not tetris_on:
            ks = tuple(range(spec.k + 1))
            plans = tuple(StepPlan(k=k, cache_len=cache_len, threshold=threshold, calibrate=threshold is not None)
                          for k in ks)
            return Schedule(plans=plans, predict_ks=ks, choose_every=spec.choose_every,
                            positions=spec.k if spec.position_profile else 0), 0
        capacities = tuple(sorted({0} | {tetris.capacity_bucket(round(f * budget), rows, big_k)
                                         for f in (0.25, 0.5, 1.0, 1.5, 2.0)}))
        tetris_plan = StepPlan(k=big_k, capacity=max(capacities), capacities=capacities, cache_len=cache_len,
                               threshold=threshold)
        # Drafting k + extra positions costs the same whatever budget is then verified, so where
        # the batch's best budget is small (few rows, or acceptance that does not pay for the
        # extra drafts) a standard window is the cheaper choice: every draft length below k +
        # extra is offered (k = 1 is also the opening probe, `policy.opening_choice`). The TETRIS
        # plan stands for k where a draft length is needed (the host's trial proposals, a drain)
        # and is otherwise judged by its best budget (`policy.tetris_goodput`). With only k = 1
        # besides plain decoding and TETRIS, batch-1 decoders of the tiny-8L pair decoded plainly
        # and ran 0-10% behind the best fixed configuration in eight runs (5% at the median); with
        # k = 1..k - 1 and TETRIS judged as k, one at SmolLM2 shapes ran k = 3 at batch 1, 9% behind
        # the best fixed k (5).
        # The standard plans count the calibration only where they read it (threshold drafting):
        # TETRIS's ranking reads it in the TETRIS plan's own steps, and counted in every standard
        # step (most of a run's steps where the policy prefers a standard length) it cost a
        # standard k = 4 step 13 kernels over fixed k = 4's 567 at batch 1, against 3 without.
        # The TETRIS plan's steps still count it, so a run that stays on TETRIS learns the curve;
        # one that switches to it ranks by the drafter's own probabilities until its steps have.
        standard = tuple(StepPlan(k=j, cache_len=cache_len, threshold=threshold if j else None,
                                  calibrate=threshold is not None and j > 0)
                         for j in range(big_k))
        return Schedule(plans=standard + (tetris_plan,), predict_ks=tuple(range(big_k)) + (spec.k,),
                        choose_every=spec.choose_every, positions=big_k if spec.position_profile else 0), 0

    def _warm_up(self, schedule: Schedule, rows_in, eos_t, budget_t, predicted, static, put) -> _Warm:
        """Goodput: compiles every plan's program and runs it on a scratch state prefilled with
        this call's first rows; times a segment's round trip there and, with
        `spec.measure_plans`, each plan's steps; compiles and times a lean call's program
        (`plain_call_on_device`) on rows of one token. Once per decoder and shape.

        Running, not only compiling: a compiled program's first steps ran slowly (on XLA:CPU,
        150 ms over 4 steps of 10 ms), which stalled a run where a plan was first chosen mid-run.
        Timing the plans: a cost model fitted across shapes misses single shapes by up to 15-25%
        (its worst held-out error), more than the goodput gap between neighbouring draft lengths
        at small batches, where the profile alone made the policy run k = 2-3 where k = 1 was
        best. A few steps at the run's own shape rank the plans. The passes go round the plans in
        turn, so a slow moment of a shared machine does not fall on one plan only, and each plan
        keeps the median of its passes: the fastest of two passes (the rule before) under-predicted
        the run's steps by up to 10%, and a drafting plan's first pass ran up to 1.5x slower than
        its later ones, which the median of three or more passes ignores. The round trip (a call
        that runs no step, and the fetch of its outputs; about 2 ms on XLA:CPU, `ROUND_TRIPS`) is
        taken out of every timed segment: it would otherwise add a third of a step to each step of
        a 4-step segment at batch 1, and make short segments' plans look slower than long ones'.
        """
        graphdef, params, dparams = self.target.graphdef, self.target.params, self.drafter.params
        max_new_b, keys_b = rows_in[2], rows_in[3]
        no_stop, seconds = put(np.int32(0)), put(_as_arrays(predicted))
        # Arguments of the run's own kinds, so the run reuses these compiled programs.
        acceptance, draining, follow, next_choice = put((self._acceptance.seed(schedule.positions), np.bool_(True),
                                                         np.bool_(False), np.int32(-1)))

        max_new_host = np.asarray(max_new_b)

        def timed(state, plan_index: int, steps: int):
            """The state after `steps` more steps of a plan, the steps run so far, the call's
            seconds (fetch included) and the tokens the longest-running row has left."""
            start = time.perf_counter()
            state = run_on_device(graphdef, self.drafter, schedule, self.sampling, params, dparams, state, keys_b,
                                  max_new_b, eos_t, budget_t, seconds, no_stop, put(np.int32(steps)), draining,
                                  follow, **static, plan_index=plan_index)
            done_b, _, n_out_b, _, ran, *_ = _segment_outputs(state)
            elapsed = time.perf_counter() - start
            room = int(np.max(np.where(done_b, 0, max_new_host - n_out_b), initial=0))
            return state, int(ran), elapsed, room

        def opened():
            return start_on_device(graphdef, self.drafter, schedule, self.sampling, params, dparams, *rows_in, eos_t,
                                   seconds, next_choice, acceptance, draining, **static)

        scratch = jax.block_until_ready(opened())
        lean_opening = 0.0
        if self._target_mesh is None:
            # A lean call's program (`_lean_call`), compiled, then timed on rows of 1 token (no step):
            # what a lean call costs besides its steps, its prefill and fetch.
            one_b = put(np.minimum(max_new_host, 1))

            def lean_opened():
                start = time.perf_counter()
                jax.device_get(plain_call_on_device(graphdef, self.sampling, params, rows_in[0], rows_in[1], one_b,
                                                    keys_b, eos_t, **static))
                return time.perf_counter() - start

            lean_opened()   # compiles
            lean_opening = float(np.median([lean_opened() for _ in range(3)]))
        starts = []
        for _ in range(3):   # what a run's opening costs (prefill, first plan), fetch included
            start = time.perf_counter()
            jax.tree.map(np.asarray, opened().policy)
            starts.append(time.perf_counter() - start)

        def fresh(i: int):
            # The prefilled rows after plan i's first step, untimed: a drafter whose prefill the
            # opening deferred catches up on the prompts there.
            return timed(jax.tree.map(jnp.copy, scratch), i, 1)

        runs = [fresh(i) for i in range(len(schedule.plans))]
        states, steps_j, rooms_j = [r[0] for r in runs], [r[1] for r in runs], [r[3] for r in runs]
        trips = []
        for n in range(ROUND_TRIPS):
            i = n % len(states)
            states[i], _, elapsed, _ = timed(states[i], i, 0)
            trips.append(elapsed)
        round_trip = float(np.median(trips))
        position = self._position_seconds(rows_in[0], rows_in[1], static["cache_len"])
        if not self.spec.measure_plans:
            return _Warm(None, round_trip, _acceptance_seen(schedule, states), position, float(np.median(starts)),
                         lean_opening_seconds=lean_opening)
        # A pass (a 1-step call and a longer one) must fit in the tokens of fresh rows after their
        # first step, even where every step emits k + 1 tokens.
        cap_j = np.array([np.clip(static["out_len"] // (plan.k + 1) - 2, 1, MEASURE_STEPS) for plan in schedule.plans])
        pass_steps_j = np.clip(np.ceil(MEASURE_PASS_SECONDS / np.maximum(predicted["plans"], 1e-6)), 2, cap_j)
        passes_j: list[list[float]] = [[] for _ in states]
        sized_j = np.zeros(len(states), bool)   # whether a plan's passes are sized by its own timing
        retired: list[tuple] = []   # (plan, counters) of states replaced by fresh rows
        entries: list[float] = []   # a segment's seconds besides its steps, as the 1-step calls saw it
        start = time.perf_counter()
        for n in range(MEASURE_MAX_PASSES):
            if n >= MEASURE_PASSES and time.perf_counter() - start > MEASURE_SECONDS:
                break
            for i, plan in enumerate(schedule.plans):
                if rooms_j[i] < (1 + pass_steps_j[i]) * (plan.k + 1):
                    retired.append((i, states[i].counters))
                    states[i], steps_j[i], _, rooms_j[i] = fresh(i)
            # Every plan's 1-step call first, then every plan's longer call: each call follows
            # another plan's program, as a run's segment mostly does. (A plan's longer call right
            # after its own 1-step call ran faster than one after another program: the difference
            # then timed k = 1 at a fifth of its step at batch 1 on the tiny test pair.)
            ones = []
            for i, state in enumerate(states):
                states[i], one, one_elapsed, _ = timed(state, i, 1)
                ones.append((one, one_elapsed))
            for i, (state, (one, one_elapsed)) in enumerate(zip(states, ones)):
                states[i], steps, elapsed, rooms_j[i] = timed(state, i, int(pass_steps_j[i]))
                if one > steps_j[i] and steps - one >= 2:
                    # A step's time is the difference of the two calls over the steps the longer one
                    # added: what a call costs besides its steps (see MEASURE_STEPS) cancels out.
                    step = (elapsed - one_elapsed) / (steps - one - 1)
                    if step > 0:
                        passes_j[i].append(step)
                        entries.append(one_elapsed - step)
                    else:
                        # The steps were lost in the two calls' jitter: longer passes. Sized on the
                        # first pass only, a plan whose first pass timed nothing kept the cost
                        # model's 2 steps for good: the tiny test pair's 0.1 ms plain step, under a
                        # cost model 1000x too slow, came out 0.01-0.27 ms.
                        pass_steps_j[i] = min(2 * pass_steps_j[i], cap_j[i])
                elif steps > steps_j[i]:   # rows ran out: the plain round trip comes off instead
                    passes_j[i].append(cost_lib.steps_seconds(elapsed + one_elapsed, 2 * round_trip)
                                       / (steps - steps_j[i]))
                if passes_j[i] and not sized_j[i]:   # sized by the plan's first timing, not the cost model's guess
                    pass_steps_j[i] = np.clip(np.ceil(MEASURE_PASS_SECONDS / max(passes_j[i][0], 1e-6)), 2, cap_j[i])
                    sized_j[i] = True
                steps_j[i] = steps
        if entries:
            round_trip = max(round_trip, float(np.median(entries)))
        return _Warm(np.array([np.median(p) if p else np.nan for p in passes_j]), round_trip,
                     _acceptance_seen(schedule, states, retired), position, float(np.median(starts)),
                     lean_opening_seconds=lean_opening)

    def _position_seconds(self, tokens_bp, prompt_len_b, cache_len: int) -> float:
        """Goodput warm-up: the drafter's seconds per position fed, from its prefill of this call's
        first rows (median of 3 after a compiling run) over their padded width. Drafting from a
        run's start costs that prefill; drafting after plain steps costs a catch-up over the
        positions missed (`policy.draft_entry_seconds`)."""
        init = jax.jit(functools.partial(self.drafter.init, cache_len=cache_len))
        jax.block_until_ready(init(self.drafter.params, tokens_bp, prompt_len_b))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(init(self.drafter.params, tokens_bp, prompt_len_b))
            times.append(time.perf_counter() - start)
        return float(np.median(times)) / tokens_bp.shape[1]

    def _predicted_seconds(self, schedule: Schedule, rows: int, cache_len: int) -> dict[str, np.ndarray]:
        """The cost model's step time for each compiled branch and each TETRIS budget, computed
        here once per call and passed in traced (a new cost model does not recompile)."""
        cost, spec = self.spec.cost_model, self.spec
        plans = schedule.plans if schedule.predict_ks is not None else ()
        caps = () if schedule.tetris_index is None else schedule.plans[schedule.tetris_index].capacities
        # Measured at warm-up (0 until then): "round_trip", a segment's seconds besides its steps;
        # "position", the drafter's seconds per position fed to catch up (`policy.draft_entry_seconds`).
        measured = {"round_trip": np.float32(0.0), "position": np.float32(0.0)}
        if cost is None:
            return {"plans": np.ones((len(plans),), np.float32), "capacities": np.ones((len(caps),), np.float32),
                    **measured}
        plan_seconds = []
        for plan, k in zip(plans, schedule.predict_ks or ()):
            if plan.capacities is None:
                plan_seconds.append(cost.step_seconds(rows, plan.k, cache_len))
            else:
                # TETRIS drafting on: k + extra draft positions, the standard budget N * k packed.
                plan_seconds.append(cost.step_seconds(rows, plan.k, cache_len, packed_tokens=rows * (k + 1),
                                                      window=plan.k + 1))
        cap_seconds = [cost.step_seconds(rows, spec.draft_len, cache_len, packed_tokens=rows + c,
                                         window=spec.draft_len + 1) for c in caps]
        return {"plans": np.asarray(plan_seconds, np.float32), "capacities": np.asarray(cap_seconds, np.float32),
                **measured}


class _Warm(NamedTuple):
    plan_seconds: np.ndarray | None   # each plan's seconds per step at the shape (None: not measured)
    round_trip: float                 # seconds of a segment's call and fetch, besides its steps
    acceptance: tuple | None          # (accepted_b, trials_b) the drafting plans counted (None: none)
    position_seconds: float           # the drafter's seconds per position it feeds (its prefill's rate)
    opening_seconds: float            # a run's opening (`start_on_device`) and the fetch of its choice
    predicted: dict | None = None     # step times the policy starts each call from (the warm-up's in them)
    lean_opening_seconds: float = 0.0  # a lean call's prefill and fetch (`plain_call_on_device`, no step)


class _LeanStreak(NamedTuple):
    calls: int            # lean calls since the call that qualified them
    longest: int          # that call's longest request: a lean call's may be no longer
    ratio_j: np.ndarray   # the step-time corrections that call's opening judged by (`StepTimeTracker.ratio`)


def _acceptance_seen(schedule: Schedule, states, retired=()) -> tuple | None:
    """The acceptance counts of the warm-up's drafting plans on the call's own rows, the plans'
    rows side by side: every trial they made (`Counters.accepted` / `tried`), in `states` and in
    the states retired before them (`retired`: pairs of plan index and `Counters`).

    The decayed counts of the policy (about the last ten trials a row) were the rule before: they
    hold whatever stretch of text each plan's rows had reached when the warm-up stopped, and how
    far they got depends on how many passes the machine's speed allowed. At batch 1 of the
    tiny-8L pair the same prompt gave 0.755 after 3 passes and 0.866 after 8; the low one had
    the next calls decode plainly until a tie was re-timed."""
    pairs = [*retired, *((i, state.counters) for i, state in enumerate(states))]
    drafting = [(c.accepted, c.tried) for i, c in pairs if schedule.plans[i].k > 0]
    if not drafting:
        return None
    drafting = jax.device_get(drafting)   # one read for all of them
    return tuple(np.concatenate(parts).astype(np.float32) for parts in zip(*drafting))


def _segment_log(schedule: Schedule, tracker: cost_lib.StepTimeTracker) -> list[tuple]:
    """A call's segments, for its stats: (draft length, steps, predicted and measured seconds per step)."""
    return [(schedule.plans[j].k, n, p, m) for j, n, p, m in tracker.history]


def _segment_outputs(state: DecodeState, max_new_b=None):
    """What the host reads after each segment (one transfer)."""
    return jax.device_get((state.done_b, state.out_bo, state.n_out_b, state.counters, state.steps, state.policy,
                           max_new_b))


def _scaled(predicted: dict[str, np.ndarray], ratio_j: np.ndarray, schedule: Schedule) -> dict[str, np.ndarray]:
    """Predicted step times with each plan's scaled by `ratio_j`; a TETRIS plan's budgets follow
    that plan's ratio."""
    caps_ratio = 1.0 if schedule.tetris_index is None else ratio_j[schedule.tetris_index]
    return {**predicted, "plans": (predicted["plans"] * ratio_j).astype(np.float32),
            "capacities": (predicted["capacities"] * caps_ratio).astype(np.float32)}


def _corrected(predicted: dict[str, np.ndarray], tracker: cost_lib.StepTimeTracker,
               schedule: Schedule) -> dict[str, np.ndarray]:
    """Predicted step times scaled by what the run has measured."""
    return _scaled(predicted, tracker.ratio(), schedule)


def _with_measured(predicted: dict[str, np.ndarray], measured_j: np.ndarray,
                   schedule: Schedule) -> dict[str, np.ndarray]:
    """The cost model's step times with each plan's replaced by its time measured at warm-up; a
    plan that ran no timed step keeps the model's time, scaled by the measured plans' overall
    ratio."""
    model_j = np.asarray(predicted["plans"], np.float64)
    measured_j = _drafting_line(np.asarray(measured_j, np.float64), schedule)
    ok = np.isfinite(measured_j)
    overall = measured_j[ok].sum() / model_j[ok].sum() if ok.any() else 1.0
    return _scaled(predicted, np.where(ok, measured_j / model_j, overall), schedule)


def _drafting_line(measured_j: np.ndarray, schedule: Schedule) -> np.ndarray:
    """The warm-up's times of the standard drafting plans (k >= 1) replaced by a least-squares line
    in k through them, where at least three were timed and the line rises; plain decoding and
    TETRIS plans keep their own times.

    At one compiled shape the cost model's step is affine in k for k >= 1 (k draft positions, a
    verification of k + 1 tokens per row, the speculation terms), so the line keeps the model's
    form at the warm-up's level and averages each plan's timing noise over all of them. Timed one
    by one, near-tied plans were ranked by their noise: at batch 1 of the tiny-8L pair one
    warm-up timed k = 1..6 at 1.24 / 1.73 / 1.64 / 1.95 / 2.11 / 2.26 ms, k = 3 below k = 2, and
    the policy ran k = 3 in 15 of 16 calls where fixed k = 3 ran 0.943 of the best fixed k (4);
    through the line, k = 4 ranks first."""
    ks = np.asarray([plan.k for plan in schedule.plans])
    fit = np.isfinite(measured_j) & (ks > 0) & np.asarray([plan.capacity is None for plan in schedule.plans])
    if len(set(ks[fit].tolist())) < 3:
        return measured_j
    slope, intercept = np.polyfit(ks[fit].astype(np.float64), measured_j[fit], 1)
    if slope <= 0:   # noise swamped the line: keep the timings
        return measured_j
    return np.where(fit, intercept + slope * ks, measured_j)


def _after_trial(schedule: Schedule, policy, tokens_j, seconds_j, live_b, remaining_b, incumbent: int) -> int:
    """The plan to run after a timing trial: the best by predicted goodput (`tokens_j` over the
    corrected step times `seconds_j`) if it beats the plan the trial stood in for, `incumbent`, by
    the margin a switch on device needs (`policy.choose_k`), else the incumbent; a stop is judged
    on the rows' acceptance over their remaining tokens, as on device (`policy._stopping_judged_ahead`).

    A trial is one noisy sample against plans measured over many steps, and the argmax it replaced
    took near-ties on it: at batch 1 of the tiny-8L pair, where plain decoding ran 0.82-0.88 of
    fixed k = 5, a 16-step trial of k = 4 on a row whose acceptance estimate had dipped
    to 0.78 (0.84 over whole calls) turned plain decoding on for the call's last 49 tokens."""
    goodput_j = np.asarray(tokens_j, np.float64) / np.asarray(seconds_j, np.float64)
    drafting_j = np.asarray(schedule.predict_ks) > 0
    if drafting_j.any() and not drafting_j.all():
        profile = policy.profile_p(xp=np)
        ahead_j = _expected_tokens(np.asarray(policy.forecast_alpha_b(remaining_b, xp=np))[live_b], schedule.predict_ks,
                                   profile)
        recent_j = _expected_tokens(np.asarray(policy.alpha_b())[live_b], schedule.predict_ks, profile)
        factor = min(1.0, np.max((recent_j / seconds_j)[drafting_j]) / max(np.max((ahead_j / seconds_j)[drafting_j]),
                                                                           1e-30))
        goodput_j = np.where(drafting_j, goodput_j, goodput_j * factor)
    best = int(np.argmax(goodput_j))
    margin = float(policy_lib.switch_margin(policy, xp=np))
    return best if goodput_j[best] > (1.0 + margin) * goodput_j[incumbent] else incumbent


def _expected_tokens(alpha_r: np.ndarray, ks, profile=None) -> np.ndarray:
    """Host twin of `policy.goodput_of_ks`' numerator (numpy: no device dispatch between segments);
    `profile` as in `policy.expected_tokens`."""
    return np.sum(policy_lib.expected_tokens(alpha_r, ks, profile, xp=np), axis=1)


# Slack on `_drain_bound`'s and `_drain_floor`'s drafting rates, for the drain count's numerical integration.
DRAIN_BOUND_SLACK = 1.01


def _drain_bound(tokens_j: np.ndarray, remaining_r: np.ndarray, ks) -> np.ndarray:
    """Per plan, the drain rule's tokens per step (`policy.drain_tokens_per_step`) or more, without
    its count: plain decoding's exactly (the remaining tokens over the largest, its steps), each
    drafting plan's at most its expected tokens per step `tokens_j` (the rows' expected tokens per
    step, summed): E[max_i S_i] >= max_i E[S_i] >= max_i r_i / mu, so sum r / E[max S] <= n mu.
    The count costs about 0.3 ms of host time at batch 4; a plain call's opening needs it only
    when a drafting plan could tie."""
    remaining_r = np.asarray(remaining_r, np.float64)
    bound_j = np.asarray(tokens_j, np.float64) * DRAIN_BOUND_SLACK
    plain = np.asarray(ks) == 0
    bound_j[plain] = remaining_r.sum() / max(remaining_r.max(initial=0.0), 1.0)
    return bound_j


def _drain_floor(tokens_j: np.ndarray, remaining_r: np.ndarray, ks) -> np.ndarray:
    """Per plan, the drain rule's tokens per step (`policy.drain_tokens_per_step`) or less, without
    its count: plain decoding's exactly, each drafting plan's at least n mu R / (R + n k) / n
    (`tokens_j` = n mu, the n rows' expected tokens per step; R, their remaining tokens). A row
    done after S steps has emitted at most r + k tokens, so by Wald's identity E[S] <= (r + k) / mu,
    and E[max_i S_i] <= sum_i E[S_i]. Tight for one row (within k / r), where a drafting call at
    batch 1 otherwise counted the drain steps on the host before every call (0.5 ms on XLA:CPU) to
    find that plain decoding does not tie with it; loose for many rows."""
    remaining_r = np.asarray(remaining_r, np.float64)
    rows, total = max(remaining_r.size, 1), remaining_r.sum()
    ks_j = np.asarray(ks, np.float64)
    floor_j = np.asarray(tokens_j, np.float64) / rows * total / np.maximum(total + rows * ks_j, 1e-9)
    floor_j /= DRAIN_BOUND_SLACK
    plain = ks_j == 0
    floor_j[plain] = total / max(remaining_r.max(initial=0.0), 1.0)
    return floor_j


def _as_arrays(seconds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.asarray(v, np.float32) for name, v in seconds.items()}


def _stats(c: Counters, n: int, steps: int, seconds: float, step_ks: list[int], drafter: Drafter) -> GenerationStats:
    real = slice(0, n)
    emitted = int(c.emitted[real].sum())
    row_steps = int(c.row_steps[real].sum())
    drafted, verified, accepted = (int(x[real].sum()) for x in (c.drafted, c.verified, c.accepted))
    # Step emissions exclude the prefill's first token.
    step_emitted = emitted - int((c.emitted[real] > 0).sum())
    return GenerationStats(
        new_tokens=emitted, steps=steps, seconds=seconds,
        tokens_per_second=emitted / seconds if seconds > 0 else 0.0,
        per_request_new_tokens=[int(x) for x in c.emitted[real]],
        target_forwards=steps + 1,
        draft_forwards=sum(drafter.forwards_per_step(k) for k in step_ks) + (1 if any(step_ks) else 0),
        drafted_tokens=drafted, verified_tokens=verified, accepted_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        vsr=accepted / verified if verified else 0.0,
        ter=step_emitted / (verified + row_steps) if row_steps else 0.0,
        mean_accepted_length=step_emitted / row_steps if row_steps else 0.0,
        mean_draft_length=verified / row_steps if row_steps else 0.0,
        extra={"per_request_steps": [int(x) for x in c.row_steps[real]],
               "per_request_accepted": [int(x) for x in c.accepted[real]],
               "k_trace": step_ks})


def _as_drafter(draft, vocab_size: int, spec: SpecConfig) -> Drafter:
    if isinstance(draft, Model):
        if draft.config.vocab_size != vocab_size:
            raise ValueError(f"draft vocab_size ({draft.config.vocab_size}) differs from the target's "
                             f"vocab_size ({vocab_size}); they must share one tokenizer")
        return ModelDrafter(draft, greedy=spec.greedy_draft)
    if isinstance(draft, NgramDrafter):
        return draft.bind_vocab(vocab_size)
    if isinstance(draft, SpeculativeDecoder):
        from jaxspec.chain import ChainDrafter
        if draft.vocab_size != vocab_size:
            raise ValueError(f"draft chain vocab_size ({draft.vocab_size}) differs from the target's "
                             f"vocab_size ({vocab_size})")
        return ChainDrafter(draft)
    if isinstance(draft, Drafter):
        if draft.vocab_size not in (None, vocab_size):
            raise ValueError(f"drafter vocab_size ({draft.vocab_size}) differs from the target's "
                             f"vocab_size ({vocab_size})")
        return draft
    raise ValueError("draft must be a jaxspec.Model, a drafter (e.g. jaxspec.NgramDrafter()) or a "
                     f"SpeculativeDecoder, got {type(draft).__name__}")
