"""The speculative decoding engine: the step (`step`) and its static shapes (`plans`), the compiled
programs around it (`loop`) and their host side (`segments`, `batching`), `SpeculativeDecoder`
(`decoder`; `sliced`: two device slices; `chain`: multi-level), the autoregressive baseline
(`generate`), timing of real steps (`timing`) and XLA:CPU kernel choice (`kernels`)."""

from jaxspec.engine import timing  # noqa: F401  (registers the step timer with jaxspec.policy.cost)
from jaxspec.engine.decoder import SpeculativeDecoder, clear_caches
from jaxspec.engine.generate import generate

__all__ = ["SpeculativeDecoder", "clear_caches", "generate"]
