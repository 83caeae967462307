"""jaxspec: batch speculative decoding in JAX / Flax NNX."""

from jaxspec import parallel, policy, tetris
from jaxspec.drafting import CrossVocabDrafter, Drafter, EagleDrafter, HybridDrafter, ModelDrafter, NgramDrafter
from jaxspec.drafting.crossvocab import VocabMap
from jaxspec.drafting.suffix import SuffixDrafter
from jaxspec.engine import SpeculativeDecoder, clear_caches, generate
from jaxspec.models import KVCache, Model, ModelConfig
from jaxspec.models.eagle import EagleHead
from jaxspec.models.init_draft import draft_from_target
from jaxspec.models.loading import example_model, load
from jaxspec.parallel import MeshConfig
from jaxspec.policy import CostModel
from jaxspec.results import GenerationResult, GenerationStats
from jaxspec.sampling import SamplingConfig
from jaxspec.spec import SpecConfig
from jaxspec.training.distill import distill
from jaxspec.training.eagle import train_eagle

__all__ = ["CostModel", "CrossVocabDrafter", "Drafter", "EagleDrafter", "EagleHead", "GenerationResult",
           "GenerationStats", "HybridDrafter", "KVCache", "MeshConfig", "Model", "ModelConfig", "ModelDrafter",
           "NgramDrafter", "SamplingConfig", "SpecConfig", "SpeculativeDecoder", "SuffixDrafter", "VocabMap",
           "clear_caches", "distill", "draft_from_target", "example_model", "generate", "load", "parallel", "policy",
           "tetris", "train_eagle"]
