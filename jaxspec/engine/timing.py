"""Timing of real decode steps, for the cost model's profiler (`CostModel.profile`), and of compilation.

A step is timed inside the decode loop (`loop.run_on_device`) as the difference between a segment
of 1 + `iterations` steps and one of 1 step, so a call's own cost is not counted as a step's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import prompts as prompts_lib
from jaxspec.drafting import Drafter, ModelDrafter, NgramDrafter
from jaxspec.engine.loop import Control, Segment, run_on_device, start_on_device
from jaxspec.engine.plans import Program, Schedule, StepPlan
from jaxspec.engine.step import Requests
from jaxspec.models.model import Model
from jaxspec.policy import cost as cost_lib
from jaxspec.sampling import SamplingConfig, request_keys


def time_steps(target: Model, drafter: Drafter, k: int, batch: int, cache_len: int, *, repeats: int = 3,
               iterations: int = 6, seed: int = 0) -> float:
    """Median seconds of one step with k drafts per row (k = 0: a plain decoding step). Where a stall
    makes the difference of the two loops implausibly small, a tenth of the long loop's average stands in."""
    run = step_timer(target, drafter, k, batch, cache_len, iterations=iterations, seed=seed)

    def step() -> tuple[float, float]:
        long = run(1 + iterations)
        return (long - run(1)) / iterations, long / (1 + iterations)

    step()
    times, averages = zip(*(step() for _ in range(repeats)), strict=True)
    return max(float(np.median(times)), 0.1 * float(np.median(averages)), 1e-9)


def cache_len_for(context: int, k: int, iterations: int) -> int:
    """The cache size at which `step_timer` prefills `context` tokens per row."""
    return context + prompts_lib.bucket_length((iterations + 1) * (k + 1) + 2) + prompts_lib.bucket_length(k + 2, 8)


def step_timer(target: Model, drafter: Drafter, k: int, batch: int, cache_len: int, *, iterations: int, seed: int,
               context: int | None = None, compiler_options: dict | None = None):
    """Prefills `batch` rows (`context` tokens each; default: as many as leave room for the timed
    steps) and returns a function timing `steps` steps from them, compiled on first use (with
    `compiler_options`); `hlo_text()` gives its text."""
    out_len = prompts_lib.bucket_length((iterations + 1) * (k + 1) + 2)
    room = cache_len - out_len - prompts_lib.bucket_length(k + 2, 8)
    prompt_len = room if context is None else context
    if not 1 <= prompt_len <= room:
        raise ValueError(f"cache_len={cache_len} is too small to time {iterations} steps with k={k} after "
                         f"{prompt_len} tokens of context; it leaves room for {room}")
    rng = np.random.default_rng(seed)
    tokens_bp = jnp.asarray(rng.integers(0, target.config.vocab_size, (batch, prompt_len)), jnp.int32)
    requests = Requests(tokens_bp=tokens_bp, prompt_len_b=jnp.full((batch,), prompt_len, jnp.int32),
                        max_new_b=jnp.full((batch,), out_len, jnp.int32),   # no row finishes within the timed steps
                        keys_b=request_keys(seed, np.arange(batch)), eos_id=jnp.int32(-1))   # eos never emitted
    schedule = Schedule(plans=(StepPlan(k=k),))
    program = Program(target=target.graphdef, drafter=drafter.static(), schedule=schedule, sampling=SamplingConfig(),
                      cache_len=cache_len, out_len=out_len)
    params = (target.params, drafter.params)
    # One prefill serves every timed run: each run gets a copy, as the loop donates its state.
    prefilled = start_on_device(dataclasses.replace(program, schedule=schedule.for_prefill()), params, requests,
                                Control.of())[0]
    compiled = {}

    def step_loop(steps: int):
        if steps not in compiled:   # a segment's length is static: one program per step count
            compiled[steps] = (run_on_device.lower(program, params, prefilled, Control.of(), Segment(0, steps))
                               .compile(compiler_options or None))
        return compiled[steps]

    def run(steps: int) -> float:
        loop = step_loop(steps)
        state = jax.block_until_ready(jax.tree.map(jnp.copy, prefilled))
        start = time.perf_counter()
        jax.block_until_ready(loop(params, state, Control.of()))
        return time.perf_counter() - start

    run.hlo_text = lambda steps=1: step_loop(steps).as_text()
    return run


def time_points(target: Model, draft, shapes, *, passes: int = 3, seed: int = 0) -> list[tuple]:
    """`(batch, k, cache_len, seconds)` of the decode step at each `(batch, k, cache_len)` shape: the
    median of `passes` passes in fresh shuffled orders (a machine's drift spreads as noise). `draft`:
    a Model, a drafter (an `EagleDrafter`), or None: drafts come from n-gram lookup."""
    if not isinstance(target, Model):
        raise ValueError(f"target must be a jaxspec.Model, got {type(target).__name__}")
    if draft is not None and not isinstance(draft, (Model, Drafter)):
        raise ValueError(f"draft must be a jaxspec.Model, a drafter or None, got {type(draft).__name__}")
    drafter = (ModelDrafter(draft) if isinstance(draft, Model) else draft if draft is not None
               else NgramDrafter().bind_vocab(target.config.vocab_size))
    shapes = [tuple(int(v) for v in shape) for shape in shapes]
    # Every shape's programs are compiled (and run once) side by side first, a thread per core.
    timers = side_by_side([functools.partial(lambda b, k, s: step_timer(target, drafter, k, b, s, iterations=6,
                                                                        seed=seed), *shape) for shape in shapes])
    side_by_side([functools.partial(run, steps) for run in timers for steps in (1, 7)])
    rng = np.random.default_rng(seed)
    seconds = [[] for _ in shapes]
    for _ in range(passes):
        for i in rng.permutation(len(shapes)):
            batch, k, cache_len = shapes[i]
            seconds[i].append(time_steps(target, drafter, k, batch, cache_len, repeats=1))
    return [(*shape, float(np.median(times))) for shape, times in zip(shapes, seconds, strict=True)]


def side_by_side(jobs) -> list:
    """Runs zero-argument callables in threads, one per core, and returns their results in order
    (one compilation leaves cores idle). On CPU only: on a GPU one thread's first run of a program
    aborts the process while another captures a CUDA graph (XLA 0.11), so there they run in turn."""
    jobs = list(jobs)
    if len(jobs) < 2 or jax.default_backend() != "cpu":
        return [job() for job in jobs]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(jobs), cores)) as pool:
        return [future.result() for future in [pool.submit(job) for job in jobs]]


cost_lib.register_step_timer(time_points)
_spans: list[tuple[float, float]] = []   # (start, end) time.time() of each span spent compiling a program


def _record_span(event: str, start_time: float, end_time: float, **_) -> None:
    if "/compile/" in event:   # JAX's tracing, lowering, compiling (or cache load) and kernel probes, any thread
        _spans.append((start_time, end_time))
        del _spans[:-4096]


def split_compile(start: float) -> tuple[float, float]:
    """(compile, other) seconds from `start` (time.time()) to now; nested or parallel spans count once."""
    end, covered, reach = time.time(), 0.0, start
    for lo, hi in sorted(_spans):   # by start: each adds the part past those before it
        covered += max(0.0, min(hi, end) - max(lo, reach))
        reach = max(reach, min(hi, end))
    return covered, end - start - covered


jax.monitoring.register_event_time_span_listener(_record_span)
