"""Model configuration: one frozen dataclass for the Llama / Qwen2 / Qwen3 / SmolLM families.

Field names follow Hugging Face's (`hidden_size`, `num_kv_heads`, ...) so a config reads the same
here as in a `config.json`. Construction from HF config dicts and from GGUF metadata lives here too,
so every loader agrees on what a checkpoint means.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
# Rope scaling types and the parameters each needs (HF `rope_scaling` / `rope_parameters` names).
ROPE_SCALING = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")   # the MLP's gate: SwiGLU, or GeGLU with tanh GELU


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer of the Llama family or a relative.

    Attributes:
      vocab_size: number of token ids.
      hidden_size: model width (embedding dimension).
      num_layers: number of decoder blocks.
      num_heads: query heads per block.
      num_kv_heads: key/value heads per block (grouped-query attention); divides num_heads.
      intermediate_size: SwiGLU hidden width.
      max_position_embeddings: longest sequence (prompt + generated) the model accepts.
      rope_theta: base of the rotary embedding frequencies.
      rms_norm_eps: epsilon of every RMSNorm.
      tie_word_embeddings: the LM head reuses the token embedding matrix.
      attention_bias: q/k/v projections carry a bias (Qwen2).
      head_dim: per-head width; None means hidden_size // num_heads.
      qk_norm: an RMSNorm over each query and key head before the rotary embedding (Qwen3).
      sliding_window: None, or how many positions a query sees, itself included (Mistral; Gemma's
        "sliding_attention" layers).
      layer_types: None (every layer alike) or per layer "sliding_attention" / "full_attention".
      hidden_act: the MLP gate's activation (`ACTIVATIONS`).
      norm_offset: RMSNorm multiplies by offset + weight, in float32 (Gemma: 1).
      embed_scale: the embeddings are multiplied by sqrt(hidden_size) (Gemma).
      post_norms: RMSNorms on the attention and MLP outputs before their residual adds (Gemma 2).
      attn_softcap, final_softcap: None, or c in c * tanh(x / c) over the attention scores / the
        logits (Gemma 2).
      query_pre_attn_scalar: None, or s in the attention scale s ** -0.5 (else head_dim ** -0.5).
      rope_local_theta: None, or the rotary base of the sliding layers, which then have no rope
        scaling (Gemma 3; `rope_theta` and `rope_scaling` are the full layers').
      rope_scaling: None (plain RoPE) or the rotary frequencies' rescaling as sorted (name,
        value) pairs, `rope_type` included: "linear" or "llama3" (`ROPE_SCALING`); a dict is
        accepted and stored in that form.
      architecture: "llama", "qwen2" or "qwen3": the checkpoint family (naming in converted
        checkpoints; its options are the fields above).
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
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}) when head_dim is not given")
        if self.resolved_head_dim % 2:
            raise ValueError(f"ModelConfig head_dim must be even for rotary embeddings, "
                             f"got {self.resolved_head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"ModelConfig.architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if isinstance(self.rope_scaling, Mapping) or isinstance(self.rope_scaling, list):
            object.__setattr__(self, "rope_scaling", tuple(sorted(dict(self.rope_scaling).items())))
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
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
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
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {model_type!r} in config.json; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
        if hf.get("use_sliding_window"):
            raise ValueError(f"config.json use_sliding_window (per-layer windows of {model_type}) is not supported")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim")
        if head_dim == hf["hidden_size"] // num_heads:
            head_dim = None  # the default; keep configs comparable
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf["max_position_embeddings"],
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            head_dim=head_dim,
            qk_norm=model_type == "qwen3",
            sliding_window=hf.get("sliding_window") if model_type == "mistral" else None,
            rope_scaling=rope_scaling_from_hf(hf),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            architecture=model_type,
            name=name or hf.get("_name_or_path") or model_type,
        )
        if model_type.startswith("gemma"):
            fields.update(_gemma_from_hf(hf, model_type))
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict transformers expects for this model."""
        hf = {
            "model_type": self.architecture,
            "architectures": [_HF_CLASSES[self.architecture]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "head_dim": self.resolved_head_dim,
            "hidden_act": self.hidden_act,
        }
        if self.architecture.startswith("gemma"):
            hf.update(hidden_activation=self.hidden_act, sliding_window=self.sliding_window,
                      layer_types=list(self.layer_types or ()), attn_logit_softcapping=self.attn_softcap,
                      final_logit_softcapping=self.final_softcap, query_pre_attn_scalar=self.query_pre_attn_scalar)
            if self.architecture == "gemma3_text":
                hf.pop("rope_scaling", None)
                hf["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": self.rope_theta,
                                                            **self.rope},
                                         "sliding_attention": {"rope_type": "default",
                                                               "rope_theta": self.rope_local_theta}}
            return hf
        if self.rope_scaling:
            hf["rope_scaling"] = self.rope
        if self.architecture == "mistral":
            hf["sliding_window"] = self.sliding_window
        elif self.sliding_window is not None:
            raise ValueError(f"jaxspec writes sliding windows for mistral models only, not {self.architecture}")
        if (self.architecture in ("qwen3", "gemma3_text")) != self.qk_norm:
            raise ValueError(f"transformers has q/k norms in qwen3 models only, not in {self.architecture} "
                             f"(qk_norm={self.qk_norm})")
        if self.architecture != "qwen2":
            hf["attention_bias"] = self.attention_bias
        elif not self.attention_bias:
            raise ValueError("a qwen2 config always has attention_bias=True in transformers")
        return hf

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], tensor_names: Collection[str] = (),
                           *, name: str | None = None) -> ModelConfig:
        """Builds a config from GGUF key/values (llama.cpp names) and the file's tensor names.

        Whether the head is tied and whether q/k/v carry a bias are read from which tensors exist,
        because GGUF metadata does not state them.
        """
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

        def key(suffix, default=None):
            value = metadata.get(f"{arch}.{suffix}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{suffix}")
            return value

        scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", None, "linear"):
            raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported; supported: none, linear")
        if "rope_freqs.weight" in tensor_names:
            raise ValueError("GGUF rope_freqs.weight (Llama 3 rope scaling as stored by llama.cpp) is not "
                             "supported; load the model's safetensors folder instead")
        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        vocab = metadata.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(metadata["tokenizer.ggml.tokens"])
        names = set(tensor_names)
        head_dim = int(metadata.get(f"{arch}.attention.key_length", 0)) or None
        if head_dim is None and f"{arch}.rope.dimension_count" in metadata:
            head_dim = int(metadata[f"{arch}.rope.dimension_count"])
        if head_dim == hidden // num_heads:
            head_dim = None
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            intermediate_size=int(key("feed_forward_length")),
            max_position_embeddings=int(key("context_length")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings=bool(names) and "output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            head_dim=head_dim,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            rope_scaling=None if scaling in ("none", None) else
            {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])},
            architecture=arch,
            name=name or str(metadata.get("general.name", arch)),
        )


def _gemma_from_hf(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The Gemma 2 / 3 options of a `config.json` dict."""
    window = hf.get("sliding_window")
    every = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
    types = hf.get("layer_types") or [("sliding_attention" if (i + 1) % every else "full_attention")
                                      for i in range(hf["num_hidden_layers"])]
    fields = dict(sliding_window=window, layer_types=tuple(types) if window else None, norm_offset=1.0,
                  embed_scale=True, post_norms=True, attn_softcap=hf.get("attn_logit_softcapping"),
                  final_softcap=hf.get("final_logit_softcapping"),
                  query_pre_attn_scalar=hf.get("query_pre_attn_scalar"))
    if model_type == "gemma3_text":   # q/k norms; rope per layer type (transformers 5), or legacy keys
        params = hf.get("rope_parameters") or {}
        full = params.get("full_attention") or {"rope_theta": hf.get("rope_theta", 1e6),
                                                **(hf.get("rope_scaling") or {})}
        local = params.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling {local['rope_type']!r} on Gemma 3's sliding layers is not supported")
        fields.update(qk_norm=True, rope_theta=float(full.get("rope_theta", 1e6)),
                      rope_scaling=rope_scaling_from_hf({"rope_parameters": full}),
                      rope_local_theta=float(local.get("rope_theta", 10000.0)))
    return fields


def rope_scaling_from_hf(hf: Mapping[str, Any]) -> dict[str, Any] | None:
    """`ModelConfig.rope_scaling` from a `config.json` dict (transformers 4's `rope_scaling` or 5's
    `rope_parameters`); None for plain RoPE."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    return {"rope_type": kind, **{k: rope[k] for k in ROPE_SCALING.get(kind, ()) if k in rope}}


def check_rope_scaling(rope: Mapping[str, Any]) -> None:
    """Refuses, by name, a rope scaling jaxspec does not compute or one missing its parameters."""
    kind = rope.get("rope_type")
    if kind not in ROPE_SCALING:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: default (none), "
                         f"{', '.join(ROPE_SCALING)}")
    missing = [k for k in ROPE_SCALING[kind] if k not in rope]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} lacks {missing}")


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# Shapes of published models (random weights: `Model.random(ModelConfig.preset(name))`).
PRESETS: dict[str, ModelConfig] = {
    # A toy model for unit tests: small enough to compile in seconds on a CPU.
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, max_position_embeddings=1024, rope_theta=10000.0,
                        rms_norm_eps=1e-6, name="tiny"),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                                num_kv_heads=3, intermediate_size=1536, max_position_embeddings=8192,
                                rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                name="smollm2-135m"),
    "smollm2-360m": ModelConfig(vocab_size=49152, hidden_size=960, num_layers=32, num_heads=15,
                                num_kv_heads=5, intermediate_size=2560, max_position_embeddings=8192,
                                rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                name="smollm2-360m"),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                                num_kv_heads=2, intermediate_size=4864, max_position_embeddings=32768,
                                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                attention_bias=True, architecture="qwen2", name="qwen2.5-0.5b"),
    "qwen2.5-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
                                num_kv_heads=2, intermediate_size=8960, max_position_embeddings=32768,
                                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                attention_bias=True, architecture="qwen2", name="qwen2.5-1.5b"),
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                              head_dim=128, intermediate_size=3072, max_position_embeddings=40960,
                              rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
                              architecture="qwen3", name="qwen3-0.6b"),
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                            head_dim=128, intermediate_size=12288, max_position_embeddings=40960,
                            rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True, architecture="qwen3",
                            name="qwen3-8b"),
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
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                              num_kv_heads=4, intermediate_size=18944, max_position_embeddings=32768,
                              rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                              attention_bias=True, architecture="qwen2", name="qwen2.5-7b"),
}
