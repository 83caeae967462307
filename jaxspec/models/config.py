"""Model configuration: one frozen dataclass for every supported family, and the presets.

Field names follow Hugging Face's; reading HF config dicts and GGUF metadata is `hf_config`'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from typing import Any

from jaxspec.models import hf_config
from jaxspec.models.hf_config import ACTIVATIONS, SUPPORTED_ARCHITECTURES, check_rope_scaling


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer of the Llama family or a relative.

    Attributes:
      vocab_size, hidden_size, intermediate_size (the MLP's hidden width), max_position_embeddings
        (prompt + generated tokens), rope_theta, rms_norm_eps, tie_word_embeddings, attention_bias
        (q/k/v biases, Qwen2): Hugging Face's fields of the same names.
      num_layers, num_heads, num_kv_heads: HF's num_hidden_layers, num_attention_heads and
        num_key_value_heads; num_kv_heads divides num_heads (grouped-query attention).
      head_dim: per-head width; None means hidden_size // num_heads.
      qk_norm: an RMSNorm over each query and key head before the rotary embedding (Qwen3).
      sliding_window: None, or how many positions a query sees, itself included (Mistral; Gemma's sliding layers).
      layer_types: None (every layer alike) or per layer "sliding_attention" / "full_attention".
      hidden_act: the MLP gate's activation (`ACTIVATIONS`).
      norm_offset: RMSNorm multiplies by offset + weight, in float32 (Gemma: 1).
      embed_scale: the embeddings are multiplied by sqrt(hidden_size) (Gemma).
      post_norms: RMSNorms on the attention and MLP outputs before their residual adds (Gemma 2).
      attn_softcap, final_softcap: None, or c in c * tanh(x / c) over attention scores / logits (Gemma 2).
      query_pre_attn_scalar: None, or s in the attention scale s ** -0.5 (else head_dim ** -0.5).
      rope_local_theta: None, or the sliding layers' rotary base, without rope scaling (Gemma 3).
      rope_scaling: None (plain RoPE) or the rotary rescaling as sorted (name, value) pairs, `rope_type`
        included: "linear", "llama3" or "freq_factors" (`ROPE_SCALING`); a dict is stored in that form.
      architecture: the checkpoint family (`SUPPORTED_ARCHITECTURES`): its tensor names.
      name: a label carried into benchmark reports and cost models.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    head_dim: int | None = None
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    embed_scale: bool = False
    post_norms: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    architecture: str = "llama"
    name: str = "custom"

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "intermediate_size", "max_position_embeddings")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"ModelConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads "
                             f"({self.num_heads}) when head_dim is not given")
        if self.resolved_head_dim % 2:
            raise ValueError(f"ModelConfig head_dim must be even for rotary embeddings, "
                             f"got {self.resolved_head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"ModelConfig.architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if isinstance(self.rope_scaling, (Mapping, list)):
            pairs = dict(self.rope_scaling).items()   # lists (from JSON) become tuples: the config stays hashable
            object.__setattr__(self, "rope_scaling", tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                                  for k, v in pairs)))
        if self.rope_scaling is not None:
            check_rope_scaling(dict(self.rope_scaling))
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"ModelConfig.sliding_window must be None or a positive int, got {self.sliding_window!r}")
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers or not set(self.layer_types)
                                             <= {"sliding_attention", "full_attention"}):
            raise ValueError(f"ModelConfig.layer_types must give 'sliding_attention' or 'full_attention' for each of "
                             f"the {self.num_layers} layers, got {self.layer_types!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (None: it sees every earlier position)."""
        full = self.layer_types is not None and self.layer_types[i] == "full_attention"
        return None if full else self.sliding_window

    def layer_rope(self, i: int) -> tuple[float, tuple | None]:
        """(rotary base, rope scaling) of layer i."""
        if self.rope_local_theta is not None and self.layer_window(i) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def rope(self) -> dict[str, Any]:
        """The rope scaling parameters as a dict (empty for plain RoPE)."""
        return dict(self.rope_scaling or ())

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        """Parameter count (the tied head counted once)."""
        d, h = self.hidden_size, self.resolved_head_dim
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.attention_bias:
            attn += h * (self.num_heads + 2 * self.num_kv_heads)
        block = (attn + 3 * d * self.intermediate_size + 2 * d + (2 * h if self.qk_norm else 0)
                 + (2 * d if self.post_norms else 0))
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * block + d + head

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"ModelConfig.from_dict got unknown fields {unknown}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """A named configuration: "tiny", "smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b", ..."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
        return PRESETS[name]

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, name: str | None = None) -> ModelConfig:
        """Builds a config from a Hugging Face `config.json` dict (transformers 4 or 5 layout)."""
        return cls(**hf_config.fields_from_hf(hf, name))

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict transformers expects for this model."""
        return hf_config.to_hf(self)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], tensor_names: Collection[str] = (),
                           *, name: str | None = None, rope_freqs=None) -> ModelConfig:
        """Builds a config from GGUF key/values, tensor names and `rope_freqs.weight` values if any."""
        return cls(**hf_config.fields_from_gguf(metadata, tensor_names, name, rope_freqs))


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# Shapes of published models (random weights: `Model.random(ModelConfig.preset(name))`).
PRESETS: dict[str, ModelConfig] = {
    # A toy model for unit tests: small enough to compile in seconds on a CPU.
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, max_position_embeddings=1024, name="tiny"),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                                intermediate_size=1536, max_position_embeddings=8192, rope_theta=100000.0,
                                rms_norm_eps=1e-5, tie_word_embeddings=True, name="smollm2-135m"),
    "smollm2-360m": ModelConfig(vocab_size=49152, hidden_size=960, num_layers=32, num_heads=15, num_kv_heads=5,
                                intermediate_size=2560, max_position_embeddings=8192, rope_theta=100000.0,
                                rms_norm_eps=1e-5, tie_word_embeddings=True, name="smollm2-360m"),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                                intermediate_size=4864, max_position_embeddings=32768, rope_theta=1000000.0,
                                rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True, architecture="qwen2",
                                name="qwen2.5-0.5b"),
    "qwen2.5-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                                intermediate_size=8960, max_position_embeddings=32768, rope_theta=1000000.0,
                                rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True, architecture="qwen2",
                                name="qwen2.5-1.5b"),
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                              head_dim=128, intermediate_size=3072, max_position_embeddings=40960, rope_theta=1000000.0,
                              rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True, architecture="qwen3",
                              name="qwen3-0.6b"),
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                            head_dim=128, intermediate_size=12288, max_position_embeddings=40960, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, qk_norm=True, architecture="qwen3", name="qwen3-8b"),
    "llama3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                               intermediate_size=8192, max_position_embeddings=131072, rope_theta=500000.0,
                               rms_norm_eps=1e-5, tie_word_embeddings=True,
                               rope_scaling=_LLAMA3_ROPE | {"factor": 32.0}, name="llama3.2-1b"),
    "llama3.1-8b": ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                               intermediate_size=14336, max_position_embeddings=131072, rope_theta=500000.0,
                               rms_norm_eps=1e-5, rope_scaling=_LLAMA3_ROPE, name="llama3.1-8b"),
    "mistral-7b": ModelConfig(vocab_size=32768, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                              intermediate_size=14336, max_position_embeddings=32768, rope_theta=1000000.0,
                              rms_norm_eps=1e-5, architecture="mistral", name="mistral-7b"),   # v0.3: no window
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                              intermediate_size=18944, max_position_embeddings=32768, rope_theta=1000000.0,
                              rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True, architecture="qwen2",
                              name="qwen2.5-7b"),
}
