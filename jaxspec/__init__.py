"""jaxspec: batch speculative decoding in JAX / Flax NNX."""

from jaxspec import multilevel, parallel, policy, tetris
from jaxspec.cost import CostModel
from jaxspec.crossvocab import CrossVocabDrafter, VocabMap
from jaxspec.distill import distill, draft_from_target
from jaxspec.drafters import Drafter, EagleDrafter, ModelDrafter, NgramDrafter
from jaxspec.engine import SpeculativeDecoder
from jaxspec.engine.decoder import clear_caches
from jaxspec.generate import generate
from jaxspec.models import KVCache, Model, ModelConfig
from jaxspec.models.eagle import EagleHead
from jaxspec.models.loading import load
from jaxspec.parallel import MeshConfig
from jaxspec.results import GenerationResult, GenerationStats
from jaxspec.sampling import SamplingConfig
from jaxspec.spec import SpecConfig
from jaxspec.train_eagle import train_eagle

__all__ = ["CostModel", "CrossVocabDrafter", "Drafter", "EagleDrafter", "EagleHead", "GenerationResult",
           "GenerationStats", "KVCache", "MeshConfig", "Model", "ModelConfig", "ModelDrafter", "NgramDrafter",
           "SamplingConfig", "SpecConfig", "SpeculativeDecoder", "VocabMap", "clear_caches", "distill",
           "draft_from_target", "generate", "load", "multilevel", "parallel", "policy", "tetris", "train_eagle"]
