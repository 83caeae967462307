"""`SpecConfig`: what a speculative decoder drafts and verifies each step."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.cost import CostModel

MAX_K = 16  # the largest draft length a program is compiled for

SELECTIONS = ("standard", "tetris")
POLICIES = ("fixed", "goodput")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """Attributes:
      k: draft tokens verified per row per step (0 = plain decoding through the same engine).
      extra: additional draft tokens per row for TETRIS selection.
      selection: "standard" (every row verifies k drafts) or "tetris".
      capacity: TETRIS verification budget C per step (None = batch * k).
      policy: "fixed", or "goodput": every step picks the draft length in 0..k (standard) or
        drafting on/off and the TETRIS budget (up to 2 * capacity) maximising predicted goodput.
      cost_model: a CostModel for policy="goodput".
      measure_plans: policy="goodput": when the decoder first meets a batch shape, time a few
        steps of each compiled plan there and plan with those times instead of the cost model's
        (which then only prices TETRIS budgets against each other and plans that ran no step);
        measured times are corrected during the run either way. False: the cost model alone, as
        given (what-if studies, tests of the policy). On two slices (a separate draft slice or
        pipeline=True) each draft length's drafting and verification are timed there, and the
        lane-step times corrected during the run; False plans with the cost model alone,
        uncorrected (`jaxspec.parallel.goodput`).
      pipeline: pipelined two-batch drafting on a separate device slice.
      greedy_draft: draft with argmax even when sampling (q is then one-hot; still lossless).
      threshold: confidence-threshold drafting: a row's window ends at the first draft whose
        cumulative confidence (product of the drafter's per-token estimates) falls below this;
        k is then the most a row drafts. None: fixed-length windows.
      choose_every: policy="goodput": a drafting segment re-chooses its plan on device every this
        many steps (after its first few). Each choice is a few hundred small operations: cheap
        where the device runs small operations quickly (XLA:CPU), dearer where each is a kernel
        launch (a GPU); a larger value makes them rarer, and a switch the acceptance asks for
        comes up to choose_every - 1 steps later. `scripts/policy_overhead.py` measures it.
      position_profile: policy="goodput": track acceptance per draft position and predict each
        draft length's tokens with it (`policy.PolicyState.profile_p`: a draft that got this far is
        usually on easier text, so acceptance tends to rise along the window). False: one rate per
        row for every position (the geometric model of `policy.expected_tokens_per_step`).
    """

    k: int = 4
    extra: int = 0
    selection: str = "standard"
    capacity: int | None = None
    policy: str = "fixed"
    cost_model: Any = None
    measure_plans: bool = True
    pipeline: bool = False
    greedy_draft: bool = False
    threshold: float | None = None
    choose_every: int = 4
    position_profile: bool = True

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"k must be an int >= 0, got {self.k!r}")
        if self.k > MAX_K:
            raise ValueError(f"k={self.k} is larger than the compiled maximum MAX_K={MAX_K}")
        if isinstance(self.extra, bool) or not isinstance(self.extra, int) or self.extra < 0:
            raise ValueError(f"extra must be an int >= 0, got {self.extra!r}")
        if self.k + self.extra > MAX_K:
            raise ValueError(f"k + extra = {self.k + self.extra} is larger than the compiled maximum MAX_K={MAX_K}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.capacity is not None and (isinstance(self.capacity, bool) or not isinstance(self.capacity, int)
                                          or self.capacity < 0):
            raise ValueError(f"capacity must be None or an int >= 0, got {self.capacity!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        threshold = self.threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0.0 < threshold <= 1.0):
            raise ValueError(f"threshold must be None or a number in (0, 1], got {self.threshold!r}")
        if isinstance(self.choose_every, bool) or not isinstance(self.choose_every, int) or self.choose_every < 1:
            raise ValueError(f"choose_every must be an int >= 1, got {self.choose_every!r}")
        if not isinstance(self.position_profile, bool):
            raise ValueError(f"position_profile must be a bool, got {self.position_profile!r}")
        if not isinstance(self.measure_plans, bool):
            raise ValueError(f"measure_plans must be a bool, got {self.measure_plans!r}")
        if self.policy == "goodput" and not isinstance(self.cost_model, CostModel):
            raise ValueError("policy='goodput' needs cost_model=jaxspec.CostModel(...) (CostModel.profile or "
                             f"CostModel.load), got {type(self.cost_model).__name__}")
        if self.policy == "goodput" and self.k < 1:
            raise ValueError(f"policy='goodput' needs k >= 1 (k is the largest draft length it may choose; plain "
                             f"decoding is always a candidate), got k={self.k}")

    @property
    def draft_len(self) -> int:
        """Draft tokens proposed per row per step."""
        return self.k + (self.extra if self.selection == "tetris" else 0)
