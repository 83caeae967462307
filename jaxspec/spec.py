"""`SpecConfig`: what a speculative decoder drafts and verifies each step."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxspec.drafting.trees import TreeShape
from jaxspec.policy.cost import CostModel
from jaxspec.prompts import check_int

MAX_K = 16  # the largest draft length a program is compiled for
MAX_TREE_COLUMNS = 64  # the most nodes (root included) a draft tree may have

SELECTIONS = ("standard", "tetris")
POLICIES = ("fixed", "goodput")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """Attributes:
      k: draft tokens verified per row per step (0 = plain decoding through the same engine).
      extra: additional draft tokens per row for TETRIS selection.
      selection: "standard" (every row verifies k drafts) or "tetris".
      capacity: TETRIS verification budget C per step (None = batch * k).
      policy: "fixed", or "goodput": `jaxspec.policy` picks each step's draft length in 0..k (with
        TETRIS, or the budget C / 2, C or 2C), maximising predicted goodput under `cost_model`.
      pipeline: pipelined two-batch drafting on a separate device slice.
      greedy_draft: draft with argmax even when sampling (q is then one-hot; still lossless).
      threshold: None, or a row's window ends at the first draft whose cumulative confidence (the
        product of the drafter's per-token estimates) falls below this; k is then the most it drafts.
      tree: None, or (depth D, width W): draft a tree (`jaxspec.drafting.trees`); standard selection
        verifies each row's k most probable nodes, "tetris" the batch's C best (default N * k); under
        the goodput policy each step runs the tree or plain decoding, whichever it predicts faster.
      segment: steps per segment S, between the host's reads (None: `segment_steps`'s default).
    """

    k: int = 4
    extra: int = 0
    selection: str = "standard"
    capacity: int | None = None
    policy: str = "fixed"
    cost_model: Any = None
    pipeline: bool = False
    greedy_draft: bool = False
    threshold: float | None = None
    tree: tuple[int, int] | None = None
    segment: int | None = None

    def __post_init__(self):
        check_int("k", self.k, 0)
        if self.k > MAX_K:
            raise ValueError(f"k={self.k} is larger than the compiled maximum MAX_K={MAX_K}")
        check_int("extra", self.extra, 0)
        if self.k + self.extra > MAX_K:
            raise ValueError(f"k + extra = {self.k + self.extra} is larger than the compiled maximum MAX_K={MAX_K}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.capacity is not None and (isinstance(self.capacity, bool) or not isinstance(self.capacity, int)
                                          or self.capacity < 0):
            raise ValueError(f"capacity must be None or an int >= 0, got {self.capacity!r}")
        if self.segment is not None:
            check_int("segment", self.segment, 1)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        threshold = self.threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0.0 < threshold <= 1.0):
            raise ValueError(f"threshold must be None or a number in (0, 1], got {self.threshold!r}")
        if self.policy == "goodput" and not isinstance(self.cost_model, CostModel):
            raise ValueError("policy='goodput' needs cost_model=jaxspec.CostModel(...) (CostModel.profile or "
                             f"CostModel.load), got {type(self.cost_model).__name__}")
        if self.tree is not None:
            self._check_tree()
        if self.policy == "goodput" and self.k < 1:
            raise ValueError(f"policy='goodput' needs k >= 1 (k is the largest draft length it may choose; plain "
                             f"decoding is always a candidate), got k={self.k}")

    def _check_tree(self):
        if not isinstance(self.tree, (tuple, list)) or len(self.tree) != 2:
            raise ValueError(f"tree must be None or (depth, width), got {self.tree!r}")
        shape = TreeShape(*self.tree)
        object.__setattr__(self, "tree", (shape.depth, shape.width))
        if shape.columns > MAX_TREE_COLUMNS:
            raise ValueError(f"tree={self.tree} has {shape.columns} nodes with its root, more than "
                             f"MAX_TREE_COLUMNS={MAX_TREE_COLUMNS}")
        if self.k < 1 or self.k >= shape.columns:
            raise ValueError(f"with tree={self.tree}, k (nodes verified per row) must be in 1..{shape.columns - 1}, "
                             f"got k={self.k}")
        if self.threshold is not None or self.extra > 0:   # a tree's k already counts its verified nodes
            raise ValueError(f"tree drafting takes neither threshold nor extra, got threshold={self.threshold!r}, "
                             f"extra={self.extra}")

    def segment_steps(self) -> int:
        """The segment length S (`segment`, or the default for the default backend)."""
        return self.segment if self.segment is not None else (1 if jax.default_backend() == "cpu" else 2)

    @property
    def draft_len(self) -> int:
        """Draft tokens proposed per row per step (a tree's nodes, its root excluded)."""
        if self.tree is not None:
            return TreeShape(*self.tree).columns - 1
        return self.k + (self.extra if self.selection == "tetris" else 0)

    def tetris_budget(self, rows: int, num_prompts: int) -> int:
        """The TETRIS verification budget C per step over `rows` compiled rows holding `num_prompts`
        requests: `capacity`, or k per request (what standard selection with k spends: the paper's
        fair comparison), at most every drafted slot."""
        wanted = self.capacity if self.capacity is not None else num_prompts * self.k
        return min(wanted, rows * self.draft_len)
