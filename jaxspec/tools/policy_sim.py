"""A deterministic testbed for the goodput policy: the clock is a cost model, acceptance is set.

The policy (`jaxspec.policy.goodput`) runs as the engine ran it before segments: it opens with a
choice, observes each verified window and chooses again after every drafting step and after every
`CHOOSE_EVERY` plain steps (aging its evidence first); or as it runs now (`Rules.segment`,
`Rules.lag`: `jaxspec.engine.loop.run_on_device`) at each segment's end only; a change of plan
costs a host round trip, and drafting after plain steps first feeds the drafter the tokens it
missed. Nothing is timed: a step of plan (k, budget) at batch b takes `CostModel.step_seconds` of the scenario's
true cost model, which may differ from the one the policy believes.

Acceptance is a property of the text: row r's draft at output position p and window slot j is
accepted iff u[r, p] < alpha(r, p, j), with one uniform u per (row, position) shared by every plan
(common random numbers), so the policy and every fixed plan decode the same text.

`simulate(scenario, plans)` runs one policy or fixed plan; `compare` runs the policy against
every fixed plan and reports tokens per simulated second against the best fixed plan in hindsight
and against plain decoding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.policy import goodput as policy
from jaxspec.policy.cost import CostModel


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    """Attributes:
      name: label.
      batch: rows (the compiled batch; finished rows still cost their share).
      tokens: output budget of each row.
      alphas: acceptance per row (cycled over the rows).
      drift: (fraction of the budget, alphas after it) or None: acceptance changes mid-run.
      falloff: acceptance at window slot j is alpha * falloff ** j (1: flat).
      cost: the true cost model (the clock).
      believed: the cost model the policy plans with (None: the true one).
      round_trip: seconds a change of plan costs (the host reads the choice and dispatches).
    """

    name: str
    batch: int
    tokens: int = 128
    alphas: tuple[float, ...] = (0.8,)
    drift: tuple[float, tuple[float, ...]] | None = None
    falloff: float = 1.0
    cost: CostModel
    believed: CostModel | None = None
    round_trip: float = 0.0

    def alpha_rp(self) -> np.ndarray:
        """Acceptance of each row at each output position (before the per-slot falloff)."""
        rows = np.arange(self.batch)
        before = np.asarray(self.alphas)[rows % len(self.alphas)]
        alpha_rp = np.repeat(before[:, None], self.tokens, axis=1)
        if self.drift is not None:
            at, after = self.drift
            alpha_rp[:, int(at * self.tokens):] = np.asarray(after)[rows % len(after)][:, None]
        return alpha_rp


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which of the policy's rules run (each can be switched off to measure its worth), and when it chooses.

    `segment` = 0: the policy chooses after every `draft_chunk` drafting steps and every `CHOOSE_EVERY` plain
    steps, and decoding stops at the step that finishes the batch. `segment` = S >= 1: decoding runs in
    segments of exactly S steps of one plan (drafting or plain alike); steps after the batch is done are masked
    but cost their step's seconds until the segment ends; the policy observes every verified window, ages over
    a segment's plain steps, and chooses once at each segment's end, and its choice runs from the segment
    `lag` segments after the next one (the host dispatched those with the plans chosen before).
    """

    margin: float = policy.MARGIN        # hysteresis
    off_decay: float = policy.OFF_DECAY  # probing after plain steps (1.0: never)
    per_row: bool = True                 # per-row acceptance (False: one pooled rate)
    per_slot: bool = True                # acceptance per window slot (False: the geometric model)
    draft_chunk: int = 1                 # drafting steps between two choices
    drain: bool = True                   # a draining batch is judged by its slowest row
    catch_up: bool = True                # a drafting plan pays for the drafter's catch-up
    prior: float = policy.PRIOR_ALPHA    # acceptance assumed before any is observed
    segment: int = 0                     # S >= 1: decode in segments of exactly S steps of one plan (0: off)
    lag: int = 0                         # segments between a choice at a segment's end and the plan it runs


@dataclasses.dataclass(frozen=True)
class _Static:
    """The compile-time settings of a choice (hashable: one program per setting)."""

    plans: tuple          # (k, budget) per plan
    margin: float         # the hysteresis
    has_current: bool     # False: the opening choice, no plan is running


@functools.partial(jax.jit, static_argnames="static")
def _choose(state, inputs, static: _Static):
    """`policy.choose` compiled; `inputs` (traced): (live_b, seconds_j, current, remaining_b, draining,
    catch_up_seconds)."""
    live_b, seconds_j, current, remaining_b, draining, catch_up = inputs
    return policy.choose(state, live_b, static.plans, seconds_j, current if static.has_current else None,
                         remaining_b=remaining_b, draining=draining, catch_up_seconds=catch_up, margin=static.margin)


_observe = jax.jit(policy.observe)
_age = jax.jit(policy.age)


def plan_seconds(cost: CostModel, batch: int, plans, cache_len: int = 0) -> np.ndarray:
    """Seconds of one step of each (k, budget) plan at `batch` rows."""
    return np.array([cost.step_seconds(batch, k, cache_len) if budget is None else
                     cost.step_seconds(batch, k, cache_len, packed_tokens=batch + budget) for k, budget in plans])


def simulate(s: Scenario, plans, fixed: int | None = None, rules: Rules = Rules(), seed: int = 0) -> dict:
    """Decodes the scenario's batch with the policy over `plans` (or plan `fixed` throughout).

    Returns tokens, seconds, tokens_per_second, steps and the plan of each step (masked steps included).
    With `rules.lag`, a choice is made against the latest plan chosen, and a change of plan costs its round
    trip and catch-up when the new plan starts running.
    """
    text = _Text(u_rp=np.random.default_rng(seed).random((s.batch, s.tokens)), alpha_rp=s.alpha_rp(),
                 slot_factor=s.falloff ** np.arange(max(k for k, _ in plans) + 1))
    true_j = plan_seconds(s.cost, s.batch, plans)
    believed_j = plan_seconds(s.believed or s.cost, s.batch, plans).astype(np.float32)
    catch_up = (s.believed or s.cost).draft_seconds(s.batch) if rules.catch_up else 0.0
    n_r = np.zeros(s.batch, np.int64)
    state = policy.PolicyState.init(s.batch, max(k for k, _ in plans), rules.prior)
    live = n_r < s.tokens

    def choose(state, current):
        inputs = (jnp.asarray(live), believed_j, current or 0, jnp.asarray(s.tokens - n_r, jnp.int32), rules.drain,
                  catch_up)
        return int(_choose(state, inputs, _Static(plans, rules.margin, current is not None)))

    current = fixed if fixed is not None else choose(state, None)
    queued = [current] * rules.lag   # plans of the segments dispatched after the running one
    seconds, trace, backlog = 0.0, [], 0
    while live.any():
        k, budget = plans[current]
        steps_before = len(trace)
        for _ in range(rules.segment or (policy.CHOOSE_EVERY if k == 0 else rules.draft_chunk)):
            if live.any():   # else a masked step of a segment: it costs its seconds and decodes nothing
                accepted_r, verified_r = _one_step(s, text, n_r, live, plans[current], state)
                n_r = np.minimum(n_r + np.where(live, accepted_r + 1, 0), s.tokens)
                if k:
                    state = _observe(state, jnp.asarray(verified_r, jnp.int32), jnp.asarray(accepted_r, jnp.int32),
                                     jnp.asarray(live))
            seconds += true_j[current]
            trace.append(current)
            live = n_r < s.tokens
            if not live.any() and not rules.segment:
                break
        backlog = backlog + len(trace) - steps_before if k == 0 else 0
        if fixed is not None or not live.any():
            continue
        if k == 0:
            state = _age(state, len(trace) - steps_before, rules.off_decay)
        seen = state if rules.per_row else _pooled(state, live)
        if not rules.per_slot:
            seen = seen.replace(accepted_k=jnp.zeros_like(seen.accepted_k), tried_k=jnp.zeros_like(seen.tried_k))
        queued.append(choose(seen, queued[-1] if queued else current))
        choice = queued.pop(0)
        if choice != current:
            # The segment ends: the host reads the choice, times the segment, dispatches the next.
            switch = s.round_trip
            if plans[choice][0] > 0 and backlog:   # the drafter catches up on the plain steps' tokens
                switch += math.ceil(backlog / policy.CATCH_UP_CHUNK) * s.cost.draft_seconds(s.batch)
                backlog = 0
            seconds += switch
            current = choice
    tokens = int(n_r.sum())
    return dict(tokens=tokens, seconds=seconds, tokens_per_second=tokens / seconds, steps=len(trace), trace=trace)


class _Text(NamedTuple):
    """The text a run decodes (common to the policy and every fixed plan): row r's draft at output
    position p and window slot j is accepted iff u_rp[r, p] < alpha_rp[r, p] * slot_factor[j]."""

    u_rp: np.ndarray
    alpha_rp: np.ndarray
    slot_factor: np.ndarray


def _one_step(s: Scenario, text: _Text, n_r, live, plan, state):
    """Accepted drafts and verified drafts per row in one step of `plan` (k, budget)."""
    k, budget = plan
    verified_r = np.where(live, k, 0)
    if budget is not None:
        # TETRIS selects by the drafter's confidence: here the policy's own estimate stands for it.
        reach = np.where(live[:, None], np.asarray(state.reach_bk(jnp.asarray(live), k)), -1.0)
        order = np.argsort(-reach.ravel(), kind="stable")[:budget]
        chosen = np.zeros(reach.size, bool)
        chosen[order] = reach.ravel()[order] >= 0
        verified_r = chosen.reshape(reach.shape).sum(axis=1)
    j = np.arange(max(k, 1))[None, :]
    p_rk = np.minimum(n_r[:, None] + j, s.tokens - 1)
    rows = np.arange(s.batch)[:, None]
    hit_rk = (text.u_rp[rows, p_rk] < text.alpha_rp[rows, p_rk] * text.slot_factor[:max(k, 1)][None, :])
    hit_rk &= (j < verified_r[:, None]) & (n_r[:, None] + j < s.tokens)
    accepted_r = np.cumprod(hit_rk, axis=1).sum(axis=1) * live
    return accepted_r, verified_r


def _pooled(state: policy.PolicyState, live) -> policy.PolicyState:
    """Every row's counts replaced by the live rows' mean (one rate for the batch)."""
    live = jnp.asarray(live)
    n = jnp.maximum(jnp.sum(live), 1)
    mean = lambda x: jnp.full_like(x, jnp.sum(jnp.where(live, x, 0.0)) / n)  # noqa: E731
    return state.replace(accepted_b=mean(state.accepted_b), tried_b=mean(state.tried_b))


def compare(s: Scenario, plans, rules=(Rules(),), seeds: int = 4) -> list[dict]:
    """Each set of `rules` against every fixed plan on the same texts (`seeds` of them): tokens
    per simulated second, summed over the texts, and the ratios to the best fixed plan in
    hindsight and to plain decoding (one dict per set of rules)."""
    def rate(runs):
        return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)

    fixed_tps = [rate([simulate(s, plans, fixed=j, seed=seed) for seed in range(seeds)]) for j in range(len(plans))]
    best = int(np.argmax(fixed_tps))
    plain = next(j for j, (k, _) in enumerate(plans) if k == 0)
    out = []
    for r in rules:
        runs = [simulate(s, plans, rules=r, seed=seed) for seed in range(seeds)]
        trace = np.concatenate([run["trace"] for run in runs])
        out.append(dict(scenario=s.name, batch=s.batch, best_fixed=_label(plans[best]),
                        best_vs_plain=float(fixed_tps[best] / fixed_tps[plain]),
                        vs_best=float(rate(runs) / fixed_tps[best]), vs_plain=float(rate(runs) / fixed_tps[plain]),
                        plain_is_best=bool(best == plain),
                        most_run=_label(plans[int(np.argmax(np.bincount(trace, minlength=len(plans))))]),
                        switches=sum(int(np.count_nonzero(np.diff(run["trace"]))) for run in runs) / seeds))
    return out


def _label(plan) -> str:
    k, budget = plan
    return f"k={k}" if budget is None else f"tetris k={k} C={budget}"


def machine_cost(machine: str, draft_ratio: float) -> CostModel:
    """A clock in units of a batch-1 plain step, and a draft position costing `draft_ratio` of it.

    "gpu": memory-bound steps: a step's cost grows by its fixed cost over 256 batched tokens.
    "cpu": compute-bound small matrices: a 4-token verification costs two plain steps (XLA:CPU).
    """
    per_token = {"gpu": 1.0 / 256, "cpu": 1.0 / 3}[machine]
    return CostModel.from_coefficients(draft_fixed=draft_ratio, draft_per_token=draft_ratio * per_token,
                                       target_fixed=1.0, target_per_token=per_token)
