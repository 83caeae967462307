"""Continuous batching, host-side bookkeeping: a request queue, fixed slots, and which request
sits in which slot.

A decode program is compiled for a fixed number of rows (slots). With more requests than slots, a
finished row goes back to the `SlotTable` and the next queued request is prefilled into it
(`loop.refill_on_device`). Each request keeps its own RNG stream, so its output does not depend on
its slot or neighbours: the same as generating it alone. In the pipelined engine each lane refills
its own rows from the one shared queue.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from jaxspec import prompts as prompts_lib

COUNTER_FIELDS = ("row_steps", "drafted", "verified", "accepted", "emitted", "tried")


def check_batch_size(batch_size, num_prompts: int) -> int:
    """The number of slots for `num_prompts` requests: all of them when batch_size is None."""
    if batch_size is None:
        return num_prompts
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}")
    return min(int(batch_size), num_prompts)


class RequestQueue:
    """Requests (rows of one PromptBatch) waiting for a slot, first come first served."""

    def __init__(self, batch: prompts_lib.PromptBatch,
                 on_finish: Callable[[int, list[int], dict[str, int]], None] | None = None):
        self.batch, self.on_finish = batch, on_finish
        self._waiting = collections.deque(range(batch.num_prompts))
        # What each finished request produced, by its row in `batch`.
        self.tokens: dict[int, list[int]] = {}
        self.remembered = 0   # how many of them the drafter has been given (`Drafter.remember`)
        self.counters = {f: np.zeros((batch.num_prompts,), np.int64) for f in COUNTER_FIELDS}

    def __len__(self) -> int:
        return len(self._waiting)

    def pop(self, n: int) -> list[int]:
        return [self._waiting.popleft() for _ in range(min(n, len(self._waiting)))]

    def finish(self, request: int, tokens: list[int], counters) -> None:
        """Records a finished request and tells `on_finish` (index, tokens, its counters)."""
        self.tokens[request] = tokens
        for f in COUNTER_FIELDS:
            self.counters[f][request] = counters[f]
        if self.on_finish is not None:
            self.on_finish(request, tokens, {f: int(counters[f]) for f in COUNTER_FIELDS})

    def results(self) -> list[list[int]]:
        return [self.tokens[i] for i in range(self.batch.num_prompts)]


def refill_rows(n: int, slots: int) -> int:
    """Rows of a refill batch of `n` requests into a table of `slots`: the next power of four, at
    most `slots`. Each refill size is a program of its own and refills come in every size: powers
    of four bound the programs to about log4(slots) + 1, so a warm-up meets them all."""
    return min(1 << 2 * -(-max(n - 1, 0).bit_length() // 2), slots)


class SlotTable:
    """Which request occupies each of `slots` rows (those the decode program is compiled for, a bucketed
    size), fed from `queue` (two lanes of the pipelined engine share one); refill batches are padded to
    a multiple of `multiple` (the data-parallel degree)."""

    def __init__(self, queue: RequestQueue, slots: int, multiple: int = 1):
        self.queue, self.slots, self.multiple = queue, slots, multiple
        self.request_at = np.full((slots,), -1, np.int64)   # row of queue.batch, -1 = free

    def first_batch(self, requests: list[int]) -> prompts_lib.PromptBatch:
        """The initial rows: `requests` in the first slots, the rest padding (free)."""
        self.request_at[:len(requests)] = requests
        return prompts_lib.subset(self.queue.batch, requests, self.multiple, min_rows=self.slots)

    @property
    def active(self) -> int:
        return int(np.sum(self.request_at >= 0))

    def harvest(self, done_b, out_bo, n_out_b, counters) -> list[int]:
        """Records every occupied slot whose row is done; returns the slots freed."""
        freed = []
        for slot in np.flatnonzero((self.request_at >= 0) & np.asarray(done_b)[:self.slots]):
            request = int(self.request_at[slot])
            self.queue.finish(request, out_bo[slot, :n_out_b[slot]].tolist(),
                              {f: getattr(counters, f)[slot] for f in COUNTER_FIELDS})
            self.request_at[slot] = -1
            freed.append(int(slot))
        return freed

    def refill(self) -> tuple[np.ndarray, prompts_lib.PromptBatch] | None:
        """Takes queued requests into free slots: (slot of each refill row, its PromptBatch), or None
        when nothing moves. The refill batch has `refill_rows` rows; its padding rows target slot
        `slots`, out of range, so their writes are dropped."""
        free = np.flatnonzero(self.request_at < 0)
        requests = self.queue.pop(len(free))
        if not requests:
            return None
        sub = prompts_lib.subset(self.queue.batch, requests, self.multiple,
                                 min_rows=refill_rows(len(requests), self.slots))
        slots_r = np.full((sub.tokens_bp.shape[0],), self.slots, np.int32)
        slots_r[:len(requests)] = free[:len(requests)]
        self.request_at[free[:len(requests)]] = requests
        return slots_r, sub
