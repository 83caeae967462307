"""Plans: the static shapes a decode call may run (`StepPlan`, `Schedule`), the `Program` they
compile to (the one static argument of every jitted entry point; params, caches and per-row inputs
are traced), `schedule_for` a `SpecConfig`, and each plan's price for the policy's clock
(`plan_seconds`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxspec import tetris
from jaxspec.drafting.base import Drafter
from jaxspec.drafting.trees import TreeShape
from jaxspec.policy.cost import CostModel
from jaxspec.sampling import SamplingConfig
from jaxspec.spec import SpecConfig


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The static shape of one speculative step (a compiled program): k drafts per row (0: plain
    decoding); `capacity` None for standard selection (a padded [b, k + 1] pass), else TETRIS (a
    packed pass of b + capacity tokens); `threshold` (SpecConfig.threshold); `tree`, a TreeShape of
    which k nodes per row (standard) or `capacity` across the batch (TETRIS) are verified; `free`: a
    hybrid drafter's first (free) member drafts alone, the costly ones skip the step."""

    k: int
    capacity: int | None = None
    threshold: float | None = None
    tree: TreeShape | None = None
    free: bool = False


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

    @property
    def free_plans(self) -> tuple[bool, ...]:
        return tuple(plan.free for plan in self.plans)

    def for_prefill(self) -> Schedule:
        """The schedule a prefill compiles for: a fixed schedule's prefill depends only on whether
        it drafts, so decoders of every fixed draft length share one prefill program."""
        return self if self.goodput else Schedule(plans=(StepPlan(k=1 if self.drafts else 0),))


# The target slice's own programs in the two-slice engine: no drafter on this side.
TARGET_ONLY = Schedule(plans=(StepPlan(k=0),))


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything static about a compiled decode program (hashable: jit's static argument)."""

    target: Any                 # the target model's graphdef
    drafter: Drafter            # weightless (`Drafter.static()`): a program's cache keeps it alive
    schedule: Schedule          # the plans it may run
    sampling: SamplingConfig    # shared by target and drafter
    cache_len: int = 0          # slots of the caches and of the sequence buffer (`cache_length`)
    out_len: int = 0            # slots of the output buffer
    mesh: Any = None            # a jax Mesh to lay the target's cache out on, or None
    record: bool = False        # a chain's inner level: each emitted token's q and surrogate are recorded

    @property
    def features(self) -> tuple[int, ...]:
        """The target layers whose features the drafter absorbs after each target pass (EAGLE);
        none when the schedule never drafts (no drafter state to feed)."""
        return self.drafter.feature_layers if self.schedule.drafts else ()


def schedule_for(spec: SpecConfig, rows: int, num_prompts: int, hybrid: bool = False) -> tuple[Schedule, tuple]:
    """The compiled step shapes of a call over `rows` rows holding `num_prompts` requests, and each
    plan's TETRIS budget C per step (0 for standard), run in a program compiled for C's capacity
    bucket. The goodput policy's candidates: draft lengths 0..k (standard), or with TETRIS 0..k+extra-1
    and the TETRIS window at budgets C / 2, C and 2C; with a tree, plain decoding and the tree; for a
    `hybrid` drafter also its free member alone at draft lengths 1..k (standard)."""
    big_k, tetris_on = spec.draft_len, spec.selection == "tetris" and spec.draft_len > 0
    budget = spec.tetris_budget(rows, num_prompts) if tetris_on else 0
    capacity = tetris.capacity_bucket(budget, rows, big_k) if tetris_on else None
    if spec.tree is not None:   # each row's k best nodes, or the batch's C best
        tree = StepPlan(k=spec.k, capacity=capacity, tree=TreeShape(*spec.tree))
        if spec.policy == "fixed":
            return Schedule(plans=(tree,)), (budget,)
        return Schedule(plans=(StepPlan(k=0), tree), goodput=True), (0, budget)
    if spec.policy == "fixed":
        return Schedule(plans=(StepPlan(k=big_k, capacity=capacity, threshold=spec.threshold),)), (budget,)
    top = big_k if tetris_on else spec.k + 1
    plans = tuple(StepPlan(k=j, threshold=spec.threshold if j else None) for j in range(top))
    if hybrid and not tetris_on:
        plans += tuple(StepPlan(k=j, threshold=spec.threshold, free=True) for j in range(1, top))
    if tetris_on:
        capacities = sorted({tetris.capacity_bucket(max(1, round(f * budget)), rows, big_k) for f in (0.5, 1, 2)})
        plans += tuple(StepPlan(k=big_k, capacity=c, threshold=spec.threshold) for c in capacities)
    return Schedule(plans=plans, goodput=True), tuple(plan.capacity or 0 for plan in plans)


def plan_seconds(cost: CostModel, rows: int, plans, cache_len: int, pipelined: bool = False) -> np.ndarray:
    """The cost model's seconds for one step of each plan over `rows` rows: drafting plus verification;
    pipelined (two lanes on two slices), the longer of the two, as the other lane's half runs meanwhile.
    A hybrid's free plan: `cost.free`'s step in units of its plain step (the two profiles ran at
    different times, and this machine's speed drifts), or without it `cost`'s less the draft positions."""
    out = []
    for plan in plans:
        packed = None if plan.capacity is None else rows + plan.capacity
        model = cost.free if plan.free and cost.free is not None else cost
        seconds = model.step_seconds(rows, plan.k, cache_len, packed_tokens=packed, tree=plan.tree)
        if plan.free:
            seconds = (seconds - cost.draft_seconds(rows, plan.k) if model is cost else
                       seconds * cost.step_seconds(rows, 0, cache_len) / model.step_seconds(rows, 0, cache_len))
        if pipelined:
            draft = cost.draft_seconds(rows, plan.k, plan.tree)
            seconds = max(draft, seconds - draft)
        out.append(seconds)
    return np.asarray(out, np.float32)


def cache_length(prompt_width: int, out_len: int, max_new: int, k: int) -> int:
    """Slots of a decode call's caches: the padded prompts, then the output bucket or at least
    max_new + k + 1 (a row with one token left verifies k drafts past it), rounded up to 8."""
    return prompt_width + max(out_len, -(-(max_new + k + 1) // 8) * 8)
