"""The host's side of the segment loop: which segment runs next, when to read, what to refill.

The host reads each segment's `loop.Report` once and keeps one segment ahead: while segment n runs,
n + 1 of the same plan is already queued, so reading overlaps the device's work. It reads all in
flight first where the device needs the host: a row to refill, another plan chosen by the policy
(which so takes effect one segment late), or a batch that may finish meanwhile. Attention reads a
static number of cache slots per segment (`loop.Segment.live`), rounded up to a power of two blocks.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxspec.engine.loop import Report, Segment
from jaxspec.engine.plans import Program
from jaxspec.models import attention


class Host:
    """Host bookkeeping of one decode call: `table` (a `batching.SlotTable`, with the request
    queue) holds its rows, `view` is the prefill's `Report` (read), `steps` the segment length S."""

    def __init__(self, program: Program, table, view: Report, steps: int):
        self.schedule, self.cache_len, self.table = program.schedule, program.cache_len, table
        self.segment_steps = steps
        self.prompt_width = table.queue.batch.tokens_bp.shape[1]
        self.inflight: list[tuple[Report, Segment]] = []   # queued, not read yet
        self.step_ks: list[int] = []                        # the draft length of every step that ran
        self.trace: list[tuple[int, int]] = []              # goodput: (plan, steps) of each segment
        self.steps = self.slot_steps = 0
        self._read(view, None)

    def refilled(self, view: Report) -> None:
        """After a refill, its report (the opening choice of the new rows if no row was running)."""
        self.view, self.plan = view, int(view.choice) if self.schedule.goodput else 0

    def catch_up_width(self) -> int:
        """Tokens per row the drafter must take in before the next segment drafts (0: none)."""
        plan = self.schedule.plans[self.plan]
        lag = int(self.view.lag) if plan.k and not plan.free else 0
        self.view = self.view.replace(lag=np.int32(0))
        return catch_up_width(lag, self.cache_len)

    def next_segment(self, plan: int | None = None) -> Segment:
        plan = self.plan if plan is None else plan
        shape = self.schedule.plans[plan]
        reach = 2 * (max(shape.k, shape.tree.columns if shape.tree is not None else 0) + 1)
        need = self.prompt_width + int(self.view.longest) + reach * (1 + (len(self.inflight) + 1) * self.segment_steps)
        live = attention.BLOCK << max(0, math.ceil(need / attention.BLOCK) - 1).bit_length()
        return Segment(plan=plan, steps=self.segment_steps, live=live if live < self.cache_len else None)

    def dispatched(self, report: Report, segment: Segment) -> None:
        """Records a queued segment, then reads what is in flight down to one (none where the next needs the host)."""
        self.inflight.append((report, segment))
        self.slot_steps += segment.steps * self.table.active
        while self.inflight and not (len(self.inflight) == 1 and self._ahead(segment)):
            report, segment = self.inflight.pop(0)
            self._read(jax.device_get(report), segment)

    def _ahead(self, segment: Segment) -> bool:
        """The next segment of `segment`'s plan may be queued unread: the policy keeps the plan, no free
        row waits for a queued request, and some row has more tokens left than the segments in flight emit."""
        if self.plan != segment.plan or (len(self.table.queue) and self.table.active < self.table.slots):
            return False
        k = self.schedule.policy_plans[segment.plan][0]
        return int(self.view.left) > len(self.inflight) * segment.steps * (k + 1)

    def _read(self, view: Report, segment: Segment | None) -> None:
        ran, self.steps, self.view = int(view.steps) - self.steps, int(view.steps), view
        if segment is not None:
            self.step_ks += [self.schedule.plans[segment.plan].k] * ran
            self.trace += [(segment.plan, ran)] if self.schedule.goodput else []
        self.plan = int(view.choice) if self.schedule.goodput else 0
        self.table.harvest(view.done_b, view.out_bo, view.n_out_b, view.counters)
        if self.table.active == 0 and not len(self.table.queue):
            self.plan, self.inflight = None, []   # every request is done: what is in flight changes nothing

    def extra(self) -> dict:
        """S, the row-steps the segments ran, and the share of them masked (a finished row waiting
        for its segment's end, or for its refill)."""
        row_steps = int(np.sum(self.table.queue.counters["row_steps"]))
        extra = dict(segment=self.segment_steps, slot_steps=self.slot_steps,
                     masked=round(1.0 - row_steps / self.slot_steps, 4) if self.slot_steps else 0.0)
        return extra | (dict(segments=self.trace) if self.schedule.goodput else {})


def catch_up_width(lag: int, cache_len: int) -> int:
    """The static width of a catch-up of `lag` tokens: a power of two >= 8 (a few programs per call)."""
    return 0 if not lag else min(1 << max(3, (lag - 1).bit_length()), cache_len)
