"""jaxspec: batch speculative decoding in JAX / Flax NNX."""

from jaxspec import tetris
from jaxspec.drafters import Drafter, ModelDrafter, NgramDrafter
from jaxspec.engine import SpeculativeDecoder
from jaxspec.generate import generate
from jaxspec.models import KVCache, Model, ModelConfig
from jaxspec.models.loading import load
from jaxspec.results import GenerationResult, GenerationStats
from jaxspec.sampling import SamplingConfig
from jaxspec.spec import SpecConfig

__all__ = ["Drafter", "GenerationResult", "GenerationStats", "KVCache", "Model", "ModelConfig",
           "ModelDrafter", "NgramDrafter", "SamplingConfig", "SpecConfig", "SpeculativeDecoder",
           "generate", "load", "tetris"]
