from jaxspec.generate import generate
from jaxspec.models import KVCache, Model, ModelConfig
from jaxspec.models.loading import load
from jaxspec.results import GenerationResult, GenerationStats
from jaxspec.sampling import SamplingConfig
