"""The speculative decoding engine: the step, the loop on device, and `SpeculativeDecoder`.

  step.py      one draft -> select -> verify -> accept -> commit step, a pure function of the
               loop state (`speculative_step` = `draft_phase` + `verify_phase`; `plain_step`)
  loop.py      the compiled programs around the step (`start_on_device`, `run_on_device`,
               `refill_on_device`)
  chain.py     a SpeculativeDecoder as the drafter of a larger target (multi-level)
  decoder.py   `SpeculativeDecoder`: prompts, slots and refills, and which programs a call runs
  timing.py    timing of real steps, for `CostModel.profile`
"""

from jaxspec.engine import timing  # noqa: F401  (registers the step timer with jaxspec.cost)
from jaxspec.engine.decoder import SpeculativeDecoder

__all__ = ["SpeculativeDecoder"]
