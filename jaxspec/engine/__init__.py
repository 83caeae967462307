"""The speculative decoding engine: the step, the loops on device, and `SpeculativeDecoder`.

  step.py      one draft -> select -> verify -> accept -> commit step, a pure function of the
               loop state (`speculative_step` = `draft_phase` + `verify_phase`; `plain_step`)
  loop.py      the compiled programs that run steps on device (`start_on_device`,
               `run_on_device`, `refill_on_device`, `plain_call_on_device`,
               `drafting_call_on_device`) and `time_steps`
  control.py   the host's side of the goodput policy between segments (`GoodputControl`)
  decoder.py   `SpeculativeDecoder`: prompts, slots and refills, and which programs a call runs

The names below are the engine's interface to the rest of the library (the two-slice pipeline,
chains, the profiler, scripts).
"""

from jaxspec.engine.decoder import SpeculativeDecoder
from jaxspec.engine.loop import (
    MIN_SEGMENT,
    Schedule,
    cache_length,
    drafting_call_on_device,
    plain_call_on_device,
    prefill_schedule,
    put_rows,
    refill_on_device,
    run_on_device,
    start_on_device,
    time_steps,
)
from jaxspec.engine.step import (
    Counters,
    DecodeState,
    StepPlan,
    draft_phase,
    emit_and_commit,
    empty_proposal,
    initial_state,
    plain_step,
    speculative_step,
    verify_phase,
)

__all__ = [
    "Counters", "DecodeState", "MIN_SEGMENT", "Schedule", "SpeculativeDecoder", "StepPlan", "cache_length",
    "draft_phase", "drafting_call_on_device", "emit_and_commit", "empty_proposal", "initial_state",
    "plain_call_on_device", "plain_step", "prefill_schedule", "put_rows", "refill_on_device", "run_on_device",
    "speculative_step", "start_on_device", "time_steps", "verify_phase",
]
