"""Models: config, the NNX decoder, the KV cache, loading and saving."""

from jaxspec.models.cache import KVCache
from jaxspec.models.config import PRESETS, ModelConfig
from jaxspec.models.model import Model

__all__ = ["KVCache", "Model", "ModelConfig", "PRESETS"]
