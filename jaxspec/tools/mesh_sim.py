"""Discrete-event simulation of sequential and pipelined speculative decoding on two device slices.

Predicts, from step costs, what the two engines of `jaxspec.engine.sliced` do: each slice is a
FIFO device queue (work runs in the order it was dispatched, one item at a time), and each lane
alternates draft (draft slice) -> verify (target slice), each depending on the one before. The
host dispatches in the engine's order:

- sequential: draft(A), verify(A), draft(A), ...: the two slices take turns, never overlapping;
- pipelined: draft(A); then verify(A), draft(B), verify(B), draft(A), ...: verify of one lane and
  draft of the other are queued back to back on different slices and overlap. When one lane has
  no requests left, the other continues sequentially (the tail).

Requests have token budgets; every step a live row emits 1 + (accepted drafts), drawn from the
geometric acceptance model with per-token acceptance alpha (the model of
`policy.expected_tokens_per_step`); finished rows are refilled from a shared queue (continuous
batching). Step times come from a `CostModel`-like pair of callables (seconds as a function of the
number of rows), so the simulation extends measurements to meshes and batch sizes not run here.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SimResult:
    seconds: float           # simulated wall time until every request finished
    tokens: int              # tokens emitted
    steps: int               # verifications (over all lanes)
    busy_draft: float        # seconds the draft slice was busy
    busy_target: float       # seconds the target slice was busy

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def simulate(budgets: Sequence[int], *, slots: int, k: int, alpha: float, draft_seconds: Callable[[int], float],
             verify_seconds: Callable[[int], float], pipeline: bool, seed: int = 0) -> SimResult:
    """Simulates decoding `budgets` (tokens per request) with `slots` rows in flight.

    Args:
      slots: rows in flight in all (pipelined: split over two lanes of slots // 2).
      k: draft tokens per row per step.
      alpha: per-token acceptance probability.
      draft_seconds, verify_seconds: time of one draft phase (k positions) / one verification as a
        function of a lane's compiled row count (finished rows still cost compute, as on device).
      pipeline: two lanes alternating on the two slices, else one lane.
    """
    if slots < (2 if pipeline else 1):
        raise ValueError(f"slots must be >= {2 if pipeline else 1}, got {slots}")
    rng = np.random.default_rng(seed)
    queue = collections.deque(int(b) for b in budgets)
    lanes = 2 if pipeline else 1
    rows = slots // lanes
    left = [[queue.popleft() if queue else 0 for _ in range(rows)] for _ in range(lanes)]
    free_at = {"draft": 0.0, "target": 0.0}
    busy = {"draft": 0.0, "target": 0.0}
    ready = [0.0] * lanes            # when each lane's last verification finished
    tokens = steps = 0

    def run(slice_name: str, after: float, seconds: float) -> float:
        """Queues `seconds` of work on a slice, to start once `after` has passed; returns its end."""
        start = max(free_at[slice_name], after)
        free_at[slice_name] = start + seconds
        busy[slice_name] += seconds
        return start + seconds

    def step(lane: int) -> None:
        nonlocal tokens, steps
        drafted = run("draft", ready[lane], draft_seconds(rows))
        ready[lane] = run("target", drafted, verify_seconds(rows))
        steps += 1
        for i, r in enumerate(left[lane]):
            if r > 0:
                accepted = int(np.argmin(np.append(rng.random(k) < alpha, False)))   # leading accepts
                emitted = min(r, accepted + 1)
                tokens += emitted
                left[lane][i] = r - emitted
            if left[lane][i] == 0 and queue:
                left[lane][i] = queue.popleft()

    # The engine's dispatch order: the draft slice and the target slice each run their queue in
    # order; alternating lanes makes verify(A) and draft(B) adjacent on different slices. A lane
    # left without requests stays so (the queue is empty), and the other runs alone (the tail).
    live = [lane for lane in range(lanes) if max(left[lane]) > 0]
    while live:
        for lane in live:
            step(lane)
        live = [lane for lane in live if max(left[lane]) > 0]
    seconds = max(free_at.values())
    return SimResult(seconds=seconds, tokens=tokens, steps=steps, busy_draft=busy["draft"],
                     busy_target=busy["target"])
