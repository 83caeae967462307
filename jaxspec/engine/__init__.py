"""The speculative decoding engine: the step, the programs around it, and `SpeculativeDecoder`.

  step.py      one draft -> select -> verify -> accept -> commit step, a pure function of the state
  plans.py     the static step shapes, the `Program` they compile to, and their price
  loop.py      the compiled programs around the step: prefill, segments of S steps, catch-up, refill
  segments.py  the host's side of the segments: what runs next, read one segment behind
  chain.py     a SpeculativeDecoder as the drafter of a larger target (multi-level)
  sliced.py    the two-slice engine: draft and target on separate devices, sequential or pipelined
  batching.py  host bookkeeping of continuous batching: request queue, slot table
  decoder.py   `SpeculativeDecoder`: prompts, slots and refills, and which programs a call runs
  generate.py  the autoregressive baseline `jaxspec.generate` (the engine without a drafter)
  timing.py    timing of real steps, for `CostModel.profile`
"""

from jaxspec.engine import timing  # noqa: F401  (registers the step timer with jaxspec.policy.cost)
from jaxspec.engine.decoder import SpeculativeDecoder, clear_caches
from jaxspec.engine.generate import generate

__all__ = ["SpeculativeDecoder", "clear_caches", "generate"]
