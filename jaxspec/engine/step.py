"""One speculative decode step, as a pure function of the loop state (static shapes).

Shape key: b rows, p padded prompt length, l sequence-buffer slots, k draft tokens, o output slots,
v vocabulary.

One step, for every row at its own length:
  1. draft: the drafter proposes k tokens (and the distributions they came from);
  2. select and verify: standard selection scores [pending, d_1 .. d_k] in one padded forward over
     the target cache; TETRIS picks each row's window across the batch and scores exactly those
     tokens in a packed forward of b + C tokens;
  3. accept: greedy matching or lossless rejection sampling picks a prefix plus one token;
  4. bookkeeping: emitted tokens go to the output and sequence buffers (cut at eos and at the
     row's budget); the target cache commits exactly the tokens it has processed and kept.
     Rolling back the rest is not writing them: `lengths` simply does not cover them.
`draft_phase` is 1, `verify_phase` 2-4; `speculative_step` composes them, and the two-slice engine
(`jaxspec.engine.sliced`) runs them on two device slices. `plain_step` is a step without drafts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec import policy as policy_lib
from jaxspec import tetris
from jaxspec.drafting.base import Drafter, Proposal, draft_logprob
from jaxspec.drafting.trees import Tree, TreeShape
from jaxspec.engine.generate import prefill
from jaxspec.models.cache import KVCache
from jaxspec.models.model import forward, forward_packed
from jaxspec.parallel import sharding as sharding_lib
from jaxspec.sampling import SamplingConfig, probabilities, row_keys, sample
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
    """The static shape of one speculative step (a compiled program).

    Attributes:
      k: draft tokens proposed per row (k + extra under TETRIS; 0 = a plain decoding step).
      capacity: None for standard selection (every row verifies all its drafts in a padded
        [b, k + 1] pass); else TETRIS, compiled for a packed pass of b + capacity tokens (the
        step selects the traced `budget` <= capacity drafts).
      threshold: confidence-threshold drafting (SpecConfig.threshold).
      tree: a TreeShape: a draft tree per row, of which k nodes per row (standard) or `capacity`
        across the batch (TETRIS) are verified in one packed pass.
    """

    k: int
    capacity: int | None = None
    threshold: float | None = None
    tree: TreeShape | None = None


def empty_proposal(b: int) -> Proposal:
    """The proposal of a step that does not draft (k = 0)."""
    return Proposal(tokens_bk=jnp.zeros((b, 0), jnp.int32), q_bkv=jnp.zeros((b, 0, 1), jnp.float32),
                    num_drafts_b=jnp.zeros((b,), jnp.int32), logprob_bk=jnp.zeros((b, 0), jnp.float32))


def draft_phase(drafter: Drafter, k: int, sampling: SamplingConfig, draft_params, draft_state, seq_bl, pending_b,
                n_out_b, request_keys_b, tree: TreeShape | None = None) -> tuple[Proposal | Tree, object]:
    """Step part 1, the drafter's side: propose k tokens per row.

    It reads only token ids and lengths of the target's side (`seq_bl`, the pending positions, the
    emitted counts that seed the RNG), so it can run on another device slice than the target
    (`jaxspec.parallel`); its output, the Proposal, is all the target's side needs.
    """
    if k == 0:
        return empty_proposal(seq_bl.shape[0]), draft_state
    if tree is not None:
        return drafter.propose_tree(draft_params, draft_state, seq_bl, pending_b, tree, sampling)
    step_key_b = row_keys(request_keys_b, n_out_b)
    draft_key_b = jax.vmap(jax.random.fold_in, (0, None))(step_key_b, _DRAFT_TAG)
    return drafter.propose(draft_params, draft_state, seq_bl, pending_b, k, draft_key_b, sampling)


def _absorbed_features(drafter, state) -> tuple:
    """The layers whose features the drafter absorbs after this pass: none without a drafter state
    (a schedule that never drafts, e.g. k = 0, has no head to feed)."""
    if drafter is None or (isinstance(state.draft_state, tuple) and not state.draft_state):
        return ()
    return drafter.feature_layers


def verify_phase(target_graphdef, plan: StepPlan, sampling: SamplingConfig, target_params, state: DecodeState,
                 proposal: Proposal, request_keys_b, max_new_b, eos_id, out_len: int, budget=None, drafter=None,
                 draft_params=None) -> DecodeState:
    """Step part 2, the target's side: select -> verify -> accept -> commit, for every row.

    Args:
      plan: the step's static shape (StepPlan); plan.k must equal the proposal's length.
      proposal: what `draft_phase` proposed from this same state.
      budget: traced number of drafts TETRIS may select (<= plan.capacity; default all of it).
      drafter, draft_params: a drafter with `feature_layers` (EAGLE) absorbs the target's
        features of the kept tokens here, in the same step; others are not called.
    """
    b, k = state.seq_bl.shape[0], plan.k
    features = _absorbed_features(drafter, state)
    if plan.tree is not None:
        return tree_verify_phase(target_graphdef, plan, sampling, target_params, state, proposal, request_keys_b,
                                 max_new_b, eos_id, out_len, budget, drafter, draft_params)
    if k == 0 and state.probs_bov is None:
        return plain_step(target_graphdef, sampling, target_params, state, request_keys_b, max_new_b, eos_id,
                          out_len, drafter, draft_params)
    pending_b = state.target_cache.lengths
    pending_tok_b = jnp.take_along_axis(state.seq_bl, pending_b[:, None], axis=1)[:, 0]
    step_key_b = row_keys(request_keys_b, state.n_out_b)
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
        verify_b = proposal.num_drafts_b
        out = forward(target_graphdef, target_params, window_bk1, state.target_cache, features=features)
        verified_b = jnp.full((b,), k, jnp.int32)
    else:
        verify_b, out = _tetris_verify(target_graphdef, target_params, plan, state, proposal, window_bk1, max_new_b,
                                       budget, features)
        verified_b = verify_b
    logits_bk1v, target_cache = out[:2]
    accept_key_b = jax.vmap(jax.random.fold_in, (0, None))(step_key_b, _ACCEPT_TAG)
    accepted_b, next_b = accept(accept_key_b, drafts_bk, proposal.q_bkv, logits_bk1v, verify_b, sampling)
    # Emitted this step: d_1 .. d_a, then the correction / bonus token.
    j = jnp.arange(k + 1)[None, :]
    drafts_pad_bk1 = jnp.concatenate([drafts_bk, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted_bk1 = jnp.where(j < accepted_b[:, None], drafts_pad_bk1, next_b[:, None])
    state = state.replace(target_cache=target_cache)
    if state.policy is not None and k > 0:   # a plain step observes nothing (see `policy.age`)
        state = state.replace(policy=policy_lib.observe(state.policy, verify_b, accepted_b, live_b))
    record = _record_for_level_above(logits_bk1v, emitted_bk1, sampling) if state.probs_bov is not None else None
    state, count_b = emit_and_commit(state, emitted_bk1, accepted_b + 1, max_new_b, eos_id, out_len, record)
    if features:   # the drafter takes in the target's features of the tokens kept (EAGLE)
        state = state.replace(draft_state=drafter.absorb(draft_params, state.draft_state, out[2], emitted_bk1,
                                                         count_b))
    return _counted(state, live_b, proposal.num_drafts_b, verified_b, accepted_b, count_b, verify_b)


def _counted(state: DecodeState, live_b, drafted_b, verified_b, accepted_b, count_b, window_b) -> DecodeState:
    """The state with a verifying step's counts added for its live rows (`window_b`: drafts the
    acceptance rule could reach; a trial is each accepted draft plus the first rejection)."""
    live, c = live_b.astype(jnp.int32), state.counters
    counters = Counters(row_steps=c.row_steps + live, drafted=c.drafted + live * drafted_b,
                        verified=c.verified + live * verified_b, accepted=c.accepted + live * accepted_b,
                        emitted=c.emitted + count_b, tried=c.tried + live * jnp.minimum(accepted_b + 1, window_b))
    # A step over finished rows only (a host-driven loop may run one) is not counted.
    return state.replace(counters=counters, steps=state.steps + jnp.any(live_b).astype(jnp.int32))


def plain_step(target_graphdef, sampling: SamplingConfig, target_params, state: DecodeState, request_keys_b,
               max_new_b, eos_id, out_len: int, drafter=None, draft_params=None) -> DecodeState:
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
    features = _absorbed_features(drafter, state)
    out = forward(target_graphdef, target_params, pending_tok_b[:, None], state.target_cache, features=features)
    logits_b1v, cache = out[:2]
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
    if features:   # an EAGLE drafter keeps up with plain steps too: it cannot recompute features later
        state = state.replace(draft_state=drafter.absorb(draft_params, state.draft_state, out[2], token_b[:, None],
                                                         live))
    return state.replace(target_cache=cache.commit(pending_b + live), seq_bl=seq_bl, out_bo=out_bo, n_out_b=n_out_b,
                         done_b=done_b, counters=counters, steps=state.steps + jnp.any(live_b).astype(jnp.int32))


def speculative_step(target_graphdef, drafter: Drafter, plan: StepPlan, sampling: SamplingConfig,
                     target_params, draft_params, state: DecodeState, request_keys_b, max_new_b, eos_id,
                     out_len: int, budget=None) -> DecodeState:
    """One draft -> select -> verify -> accept -> commit step for every row (static shapes).

    The composition of `draft_phase` and `verify_phase`; the pipelined engine runs the same two
    functions on two device slices.
    """
    proposal, draft_state = draft_phase(drafter, plan.k, sampling, draft_params, state.draft_state, state.seq_bl,
                                        state.target_cache.lengths, state.n_out_b, request_keys_b, plan.tree)
    return verify_phase(target_graphdef, plan, sampling, target_params, state.replace(draft_state=draft_state),
                        proposal, request_keys_b, max_new_b, eos_id, out_len, budget, drafter, draft_params)


def _tetris_verify(target_graphdef, target_params, plan: StepPlan, state: DecodeState, proposal: Proposal,
                   window_bk1, max_new_b, budget, features=()):
    """TETRIS: choose each row's window across the batch, then verify exactly those tokens, packed.

    A slot is usable if it is a real proposal, its row is live, and what it could emit fits in the
    row's remaining token budget. Returns (window lengths, (logits [b, k + 1, v], target cache[,
    features])).
    """
    b, k = window_bk1.shape[0], plan.k
    j = jnp.arange(k)[None, :]
    remaining_b = max_new_b - state.n_out_b
    usable_bk = (j < proposal.num_drafts_b[:, None]) & ~state.done_b[:, None] & (j + 2 <= remaining_b[:, None])
    verify_b = tetris.select(tetris.acceptance_logprobs(proposal, usable_bk), plan.capacity, budget)
    return verify_b, forward_packed(target_graphdef, target_params, window_bk1, verify_b + 1, state.target_cache,
                                    b + plan.capacity, features)


def tree_verify_phase(target_graphdef, plan: StepPlan, sampling: SamplingConfig, target_params, state: DecodeState,
                      tree: Tree, request_keys_b, max_new_b, eos_id, out_len: int, budget=None, drafter=None,
                      draft_params=None) -> DecodeState:
    """`verify_phase` for a draft tree: select nodes (each row's k best, or the batch's `capacity`
    best), verify them with the root in one packed pass, accept a path (`verify.accept_tree`),
    move its keys and values into the slots after the pending token, commit; an EAGLE drafter
    absorbs the target's features of the root and the accepted path."""
    b, shape = state.seq_bl.shape[0], plan.tree
    depth_w = jnp.asarray(shape.depth_w())
    live_b = ~state.done_b
    remaining_b = max_new_b - state.n_out_b
    # A node at depth d emits d + 1 tokens with its correction: it must fit the row's budget.
    usable_bw = live_b[:, None] & (depth_w[None, :] >= 1) & (depth_w[None, :] + 1 <= remaining_b[:, None])
    cum_bw = jnp.where(usable_bw, tree.cum_bw, -jnp.inf)
    if plan.capacity is None:
        chosen_bw, packed = tetris.select_nodes(cum_bw, plan.k, per_row=True), b * (plan.k + 1)
    else:
        chosen_bw, packed = tetris.select_nodes(cum_bw, plan.capacity, budget), b + plan.capacity
    used_bw = chosen_bw | (depth_w[None, :] == 0)
    pending_b = state.target_cache.lengths
    features = _absorbed_features(drafter, state)
    out = forward_packed(target_graphdef, target_params, tree.tokens_bw, used_bw, state.target_cache, packed, features,
                         tree=(jnp.broadcast_to(depth_w, (b, shape.columns)), tree.ancestor_bww))
    logits_bwv, cache = out[:2]
    accept_key_b = jax.vmap(jax.random.fold_in, (0, None))(row_keys(request_keys_b, state.n_out_b), _ACCEPT_TAG)
    path_bd, accepted_b, next_b = accept_tree(accept_key_b, tree.tokens_bw, tree.parent_bw, used_bw, logits_bwv,
                                              sampling, shape.depth, shape.width)
    cache = cache.move(pending_b[:, None] + path_bd, accepted_b, pending_b + 1)
    j = jnp.arange(shape.depth + 1)[None, :]
    path_tokens_bd = jnp.take_along_axis(tree.tokens_bw, path_bd, axis=1)
    emitted_bk1 = jnp.where(j < accepted_b[:, None], jnp.pad(path_tokens_bd, ((0, 0), (0, 1))), next_b[:, None])
    state, count_b = emit_and_commit(state.replace(target_cache=cache), emitted_bk1, accepted_b + 1, max_new_b,
                                     eos_id, out_len)
    if features:   # the root, then the accepted path (past it: ignored)
        kept_bk1 = jnp.concatenate([jnp.zeros((b, 1), path_bd.dtype), path_bd], axis=1)
        state = state.replace(draft_state=drafter.absorb(draft_params, state.draft_state, jnp.take_along_axis(
            out[2], kept_bk1[:, :, None], axis=1), emitted_bk1, count_b))
    verified_b = jnp.sum(chosen_bw, axis=1).astype(jnp.int32)
    if state.policy is not None:   # acceptance per depth of the path: the deepest verified node bounds the trials
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


def initial_state(target_graphdef, sampling: SamplingConfig, target_params, tokens_bp, prompt_len_b, max_new_b,
                  request_keys_b, eos_id, *, cache_len: int, seq_len: int, out_len: int, mesh=None,
                  features=()) -> tuple[DecodeState, jax.Array | None]:
    """The target's prefill and first token, and the loop state before the first step (no
    drafter); also the prompt's features of the `features` layers (`prefill`), or None.

    `mesh`: a jax Mesh to lay the target's KV cache out on (rows over data, kv heads over tensor).
    """
    b, p = tokens_bp.shape
    cache, first_b, n_out_b, done_b, features_bpf = prefill(target_graphdef, target_params, tokens_bp, prompt_len_b,
                                                            max_new_b, request_keys_b, eos_id, sampling, cache_len,
                                                            features)
    if mesh is not None:
        cache = sharding_lib.constrain_cache(cache, mesh)
    rows = jnp.arange(b)
    seq_bl = jnp.zeros((b, seq_len), jnp.int32).at[:, :p].set(tokens_bp)
    seq_bl = seq_bl.at[rows, prompt_len_b].set(first_b)
    out_bo = jnp.zeros((b, out_len), jnp.int32).at[:, 0].set(first_b)
    state = DecodeState(target_cache=cache, draft_state=(), seq_bl=seq_bl, out_bo=out_bo, n_out_b=n_out_b,
                        done_b=done_b, counters=Counters.zeros(b).replace(emitted=n_out_b), steps=jnp.int32(0))
    return state, features_bpf
