"""One speculative decode step, as a pure function of the loop state (static shapes).

Shape key: b rows, p padded prompt length, l sequence-buffer slots, k draft tokens, o output slots,
v vocabulary.

One step, for every row at its own length: `draft_phase` proposes k tokens (and their
distributions); `verify_phase` scores [pending, d_1 .. d_k] in one padded forward (standard) or the
windows TETRIS picks across the batch in a packed one, accepts a prefix plus one token (greedy or
lossless rejection sampling), writes the emitted tokens (cut at eos and the budget) and commits
exactly those to the target's cache. `speculative_step` composes the two phases (the two-slice
engine runs them on two slices); `plain_step` is a lean step without drafts (the general path
costs more at k = 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import tetris
from jaxspec.drafting.base import Proposal, draft_logprob
from jaxspec.drafting.trees import Tree
from jaxspec.engine.plans import Program, StepPlan
from jaxspec.models.cache import KVCache
from jaxspec.models.model import forward, forward_packed, init_cache
from jaxspec.parallel import sharding as sharding_lib
from jaxspec.policy import goodput as policy_lib
from jaxspec.sampling import SamplingConfig, choose, probabilities, request_keys, row_keys, sample
from jaxspec.verify import accept, accept_tree

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
class Requests:
    """Requests entering a batch's rows (traced inputs of a prefill or refill)."""

    tokens_bp: jax.Array      # prompts, right-padded
    prompt_len_b: jax.Array
    max_new_b: jax.Array      # token budgets (0: a padding row)
    keys_b: jax.Array         # each request's RNG key (`sampling.request_keys`)
    eos_id: jax.Array         # the stop token (`prompts.NO_EOS`: none)

    @classmethod
    def of(cls, batch, seed: int, eos: int) -> Requests:
        """A `prompts.PromptBatch`'s rows as a program's inputs (host values)."""
        return cls(tokens_bp=batch.tokens_bp, prompt_len_b=batch.lengths_b, max_new_b=batch.max_new_b,
                   keys_b=request_keys(seed, batch.request_ids_b), eos_id=np.int32(eos))


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
    max_new_b: jax.Array      # each row's token budget
    keys_b: jax.Array         # each row's request key
    eos_id: jax.Array
    # Only at a chain's inner level: each emitted token's distribution (the q of the level above's
    # rejection sampling) and its acceptance surrogate (for TETRIS).
    probs_bov: jax.Array | None = None
    logprob_bo: jax.Array | None = None
    # Only under the goodput policy: acceptance tracking and the next step's choice.
    policy: policy_lib.PolicyState | None = None


def emit_and_commit(state: DecodeState, window_bk1, emit_count_b, record=None):
    """Writes each row's first `emit_count_b` window tokens (cut at eos and the budget)."""
    b, width = window_bk1.shape
    max_new_b, eos_id, out_len = state.max_new_b, state.eos_id, state.out_bo.shape[1]
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


def empty_proposal(b: int) -> Proposal:
    """The proposal of a step that does not draft (k = 0)."""
    return Proposal(tokens_bk=jnp.zeros((b, 0), jnp.int32), q_bkv=jnp.zeros((b, 0, 1), jnp.float32),
                    num_drafts_b=jnp.zeros((b,), jnp.int32), logprob_bk=jnp.zeros((b, 0), jnp.float32))


def _step_keys(state_or_view, tag: int):
    """Each row's key for this step's draws (`tag`: drafting or acceptance); a request's token i
    uses the same key whichever path emits it."""
    step_key_b = row_keys(state_or_view.keys_b, state_or_view.n_out_b)
    return jax.vmap(jax.random.fold_in, (0, None))(step_key_b, tag)


@struct.dataclass
class DraftView:
    """What the drafter's side reads of the target's state (so drafting can run on another slice)."""

    seq_bl: jax.Array
    pending_b: jax.Array      # each row's last emitted token's position
    n_out_b: jax.Array        # tokens emitted (seeds the step's draws)
    keys_b: jax.Array

    @classmethod
    def of(cls, state: DecodeState) -> DraftView:
        return cls(seq_bl=state.seq_bl, pending_b=state.target_cache.lengths, n_out_b=state.n_out_b,
                   keys_b=state.keys_b)


def draft_phase(program: Program, plan: StepPlan, draft_params, draft_state, view: DraftView):
    """Step part 1, the drafter's side: the Proposal of `plan.k` tokens (or a Tree) per row, and the drafter's state."""
    drafter, sampling = program.drafter, program.sampling
    if plan.k == 0:
        return empty_proposal(view.seq_bl.shape[0]), draft_state
    if plan.tree is not None:
        return drafter.propose_tree(draft_params, draft_state, view.seq_bl, view.pending_b, plan.tree, sampling)
    propose = drafter.propose_free if plan.free else drafter.propose
    return propose(draft_params, draft_state, view.seq_bl, view.pending_b, plan.k,
                           _step_keys(view, _DRAFT_TAG), sampling)


def verify_phase(program: Program, plan: StepPlan, params, state: DecodeState, proposal: Proposal,
                 budget=None) -> DecodeState:
    """Step part 2, the target's side: select -> verify -> accept -> commit, for every row, of what
    `draft_phase` proposed from this state (an EAGLE drafter also absorbs the target's features of
    the kept tokens). `budget`: the drafts TETRIS may select (traced, <= plan.capacity; default all)."""
    if plan.tree is not None:
        return tree_verify_phase(program, plan, params, state, proposal, budget)
    if plan.k == 0 and not program.record:
        return plain_step(program, params, state)
    b, k = state.seq_bl.shape[0], plan.k
    pending_tok_b = jnp.take_along_axis(state.seq_bl, state.target_cache.lengths[:, None], axis=1)[:, 0]
    live_b = ~state.done_b
    if plan.threshold is not None and k > 0:
        # Threshold drafting: each row's window ends where its cumulative confidence drops below
        # the threshold (a prefix: the cumulative estimate never increases along a row).
        above_b = jnp.sum(tetris.cumulative_logprobs(proposal.logprob_bk) >= jnp.log(plan.threshold), axis=1)
        proposal = proposal.replace(num_drafts_b=jnp.minimum(proposal.num_drafts_b, above_b).astype(jnp.int32))
    drafts_bk = proposal.tokens_bk
    window_bk1 = jnp.concatenate([pending_tok_b[:, None], drafts_bk], axis=1)
    if plan.capacity is None:
        # Standard: the target scores the pending token and every draft in one padded pass.
        verify_b, verified_b = proposal.num_drafts_b, jnp.full((b,), k, jnp.int32)
        out = forward(program.target, params[0], window_bk1, state.target_cache, features=program.features)
    else:
        verify_b, out = _tetris_verify(program, plan, params[0], state, proposal, window_bk1, budget)
        verified_b = verify_b
    logits_bk1v = out[0]
    accepted_b, next_b = accept(_step_keys(state, _ACCEPT_TAG), drafts_bk, proposal.q_bkv, logits_bk1v, verify_b,
                                program.sampling)
    # Emitted this step: d_1 .. d_a, then the correction / bonus token.
    j = jnp.arange(k + 1)[None, :]
    emitted_bk1 = jnp.where(j < accepted_b[:, None], jnp.pad(drafts_bk, ((0, 0), (0, 1))), next_b[:, None])
    state = state.replace(target_cache=out[1])
    if program.schedule.goodput and k > 0:   # a plain step observes nothing (see `policy.age`)
        state = state.replace(policy=policy_lib.observe(state.policy, verify_b, accepted_b, live_b, free=plan.free))
    record = _record_for_level_above(logits_bk1v, emitted_bk1, program.sampling) if program.record else None
    state, count_b = emit_and_commit(state, emitted_bk1, accepted_b + 1, record)
    state = _absorbed(program, params, state, out, emitted_bk1, count_b)
    return _counted(state, live_b, proposal.num_drafts_b, verified_b, accepted_b, count_b, verify_b)


def _absorbed(program: Program, params, state: DecodeState, out, kept_bw, count_b) -> DecodeState:
    """The state after a drafter reading the target's features (EAGLE) took in those of the kept
    tokens of a target pass (`out`: the forward's logits, cache, features); unchanged for others."""
    if not program.features:
        return state
    return state.replace(draft_state=program.drafter.absorb(params[1], state.draft_state, out[2], kept_bw, count_b))


def _counted(state: DecodeState, live_b, drafted_b, verified_b, accepted_b, count_b, window_b) -> DecodeState:
    """The state with a verifying step's counts added for its live rows (`window_b`: drafts the
    acceptance rule could reach; a trial is each accepted draft plus the first rejection)."""
    live, c = live_b.astype(jnp.int32), state.counters
    counters = Counters(row_steps=c.row_steps + live, drafted=c.drafted + live * drafted_b,
                        verified=c.verified + live * verified_b, accepted=c.accepted + live * accepted_b,
                        emitted=c.emitted + count_b, tried=c.tried + live * jnp.minimum(accepted_b + 1, window_b))
    # A step over finished rows only (a host-driven loop may run one) is not counted.
    return state.replace(counters=counters, steps=state.steps + jnp.any(live_b).astype(jnp.int32))


def plain_step(program: Program, params, state: DecodeState) -> DecodeState:
    """A step without drafts (k = 0), without the general path's acceptance and window. It draws
    the token as the general path's acceptance does with no drafts (the resample key of
    `verify.rejection_accept`, from p itself), so a request's tokens do not depend on the path."""
    sampling, live_b, pending_b = program.sampling, ~state.done_b, state.target_cache.lengths
    out = forward(program.target, params[0], jnp.take_along_axis(state.seq_bl, pending_b[:, None], axis=1),
                  state.target_cache, features=program.features)
    logits_b1v = out[0]
    if sampling.greedy:
        token_b = jnp.argmax(logits_b1v[:, 0], axis=-1).astype(jnp.int32)
    else:
        resample_key_b = jax.vmap(lambda key: jax.random.split(key)[1])(_step_keys(state, _ACCEPT_TAG))
        p_bv = probabilities(logits_b1v[:, 0], sampling)
        p_bv = p_bv / jnp.sum(p_bv, axis=-1, keepdims=True)    # as the general path renormalises
        token_b = jax.vmap(sample)(resample_key_b, p_bv)
    state, count_b = emit_and_commit(state.replace(target_cache=out[1]), token_b[:, None], jnp.ones_like(pending_b))
    # An EAGLE drafter keeps up with plain steps too: it cannot recompute features later.
    state = _absorbed(program, params, state, out, token_b[:, None], count_b)
    none_b = jnp.zeros_like(count_b)   # nothing drafted, verified or tried
    return _counted(state, live_b, none_b, none_b, none_b, count_b, none_b)


def speculative_step(program: Program, plan: StepPlan, params, state: DecodeState, budget=None) -> DecodeState:
    """One draft -> select -> verify -> accept -> commit step for every row."""
    proposal, draft_state = draft_phase(program, plan, params[1], state.draft_state, DraftView.of(state))
    return verify_phase(program, plan, params, state.replace(draft_state=draft_state), proposal, budget)


def _tetris_verify(program: Program, plan: StepPlan, target_params, state: DecodeState, proposal: Proposal,
                   window_bk1, budget):
    """TETRIS: choose each row's window across the batch among the usable slots (real proposals of
    live rows whose emission fits the budget), then verify exactly those tokens, packed."""
    b, k = window_bk1.shape[0], plan.k
    j = jnp.arange(k)[None, :]
    remaining_b = state.max_new_b - state.n_out_b
    usable_bk = (j < proposal.num_drafts_b[:, None]) & ~state.done_b[:, None] & (j + 2 <= remaining_b[:, None])
    verify_b = tetris.select(jnp.where(usable_bk, proposal.logprob_bk, -jnp.inf), plan.capacity, budget)
    return verify_b, forward_packed(program.target, target_params, window_bk1, verify_b + 1, state.target_cache,
                                    b + plan.capacity, program.features)


def tree_verify_phase(program: Program, plan: StepPlan, params, state: DecodeState, tree: Tree,
                      budget=None) -> DecodeState:
    """`verify_phase` for a draft tree: verify the selected nodes with the root in one packed pass, accept
    a path (`verify.accept_tree`) and move its keys and values into the slots after the pending token."""
    b, shape = state.seq_bl.shape[0], plan.tree
    depth_w = jnp.asarray(shape.depth_w())
    live_b = ~state.done_b
    remaining_b = state.max_new_b - state.n_out_b
    # A node at depth d emits d + 1 tokens with its correction: it must fit the row's budget.
    usable_bw = live_b[:, None] & (depth_w[None, :] >= 1) & (depth_w[None, :] + 1 <= remaining_b[:, None])
    cum_bw = jnp.where(usable_bw, tree.cum_bw, -jnp.inf)
    if plan.capacity is None:
        chosen_bw, packed = tetris.select_nodes(cum_bw, plan.k, per_row=True), b * (plan.k + 1)
    else:
        chosen_bw, packed = tetris.select_nodes(cum_bw, plan.capacity, budget), b + plan.capacity
    used_bw = chosen_bw | (depth_w[None, :] == 0)
    pending_b = state.target_cache.lengths
    out = forward_packed(program.target, params[0], tree.tokens_bw, used_bw, state.target_cache, packed,
                         program.features, tree=(jnp.broadcast_to(depth_w, (b, shape.columns)), tree.ancestor_bww))
    path_bd, accepted_b, next_b = accept_tree(_step_keys(state, _ACCEPT_TAG), tree.tokens_bw, tree.parent_bw, used_bw,
                                              out[0], program.sampling, shape.depth, shape.width)
    cache = out[1].move(pending_b[:, None] + path_bd, accepted_b, pending_b + 1)
    j = jnp.arange(shape.depth + 1)[None, :]
    path_tokens_bd = jnp.take_along_axis(tree.tokens_bw, path_bd, axis=1)
    emitted_bk1 = jnp.where(j < accepted_b[:, None], jnp.pad(path_tokens_bd, ((0, 0), (0, 1))), next_b[:, None])
    state, count_b = emit_and_commit(state.replace(target_cache=cache), emitted_bk1, accepted_b + 1)
    if program.features:   # the root, then the accepted path (past it: ignored)
        kept_bk1 = jnp.concatenate([jnp.zeros((b, 1), path_bd.dtype), path_bd], axis=1)
        out = (*out[:2], jnp.take_along_axis(out[2], kept_bk1[:, :, None], axis=1))
        state = _absorbed(program, params, state, out, emitted_bk1, count_b)
    verified_b = jnp.sum(chosen_bw, axis=1).astype(jnp.int32)
    if program.schedule.goodput:   # acceptance per depth of the path: the deepest verified node bounds the trials
        deepest_b = jnp.max(jnp.where(chosen_bw, depth_w[None, :], 0), axis=1)
        state = state.replace(policy=policy_lib.observe(state.policy, deepest_b, accepted_b, live_b))
    return _counted(state, live_b, jnp.sum(jnp.isfinite(cum_bw), axis=1), verified_b, accepted_b, count_b, verified_b)


def _record_for_level_above(logits_bk1v, emitted_bk1, sampling: SamplingConfig):
    """What a chain level reports for each emitted token: the distribution p it follows exactly
    (the level above's q), and the acceptance surrogate TETRIS ranks (see `draft_logprob`)."""
    p_bk1v = probabilities(logits_bk1v, sampling)
    logprob_bk1 = jax.vmap(draft_logprob, (1, 1, 1, None, None), 1)(logits_bk1v, emitted_bk1, p_bk1v, sampling,
                                                                    sampling.greedy)
    return p_bk1v, logprob_bk1


def initial_state(program: Program, target_params, requests: Requests) -> tuple[DecodeState, jax.Array | None]:
    """The target's ragged prefill and first token (none for a padding row), the loop state before
    the first step (no drafter state yet), and the prompt's features ([b, p, f] of the drafter's
    `features` layers, for an EAGLE drafter; else None)."""
    tokens_bp, prompt_len_b, max_new_b, (b, p) = (requests.tokens_bp, requests.prompt_len_b, requests.max_new_b,
                                                  requests.tokens_bp.shape)
    cache = init_cache(program.target, target_params, b, program.cache_len)
    out = forward(program.target, target_params, tokens_bp, cache, (prompt_len_b - 1)[:, None], empty=True,
                  features=program.features)
    (logits_b1v, cache), features_bpf = out[:2], (out[2] if program.features else None)
    cache = cache.commit(prompt_len_b)
    live_b = max_new_b > 0
    first_b = choose(row_keys(requests.keys_b, jnp.zeros_like(prompt_len_b)), logits_b1v[:, 0], program.sampling)
    n_out_b = live_b.astype(jnp.int32)
    done_b = ~live_b | (first_b == requests.eos_id) | (n_out_b >= max_new_b)
    if program.mesh is not None:
        cache = sharding_lib.constrain_cache(cache, program.mesh)
    seq_bl = jnp.zeros((b, program.cache_len), jnp.int32).at[:, :p].set(tokens_bp)
    seq_bl = seq_bl.at[jnp.arange(b), prompt_len_b].set(first_b)
    out_bo = jnp.zeros((b, program.out_len), jnp.int32).at[:, 0].set(first_b)
    state = DecodeState(target_cache=cache, draft_state=(), seq_bl=seq_bl, out_bo=out_bo, n_out_b=n_out_b,
                        done_b=done_b, counters=Counters.zeros(b).replace(emitted=n_out_b), steps=jnp.int32(0),
                        max_new_b=max_new_b, keys_b=requests.keys_b, eos_id=requests.eos_id)
    return state, features_bpf
