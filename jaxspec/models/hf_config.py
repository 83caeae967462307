"""Which families and options jaxspec supports: `ModelConfig` fields from a Hugging Face
`config.json` dict or GGUF metadata, and back to `config.json`."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
# Rope scaling types and the parameters each needs (HF names). "freq_factors": a GGUF file's `rope_freqs.weight`
# (llama.cpp's form of Llama 3 scaling), each rotary frequency divided by its own factor.
ROPE_SCALING = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "freq_factors": ("factors",)}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")   # the MLP's gate: SwiGLU, or GeGLU with tanh GELU
# ModelConfig field -> config.json key, for the fields every family states plainly.
_HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads", "intermediate_size": "intermediate_size",
            "max_position_embeddings": "max_position_embeddings"}


def fields_from_hf(hf: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    """`ModelConfig` fields from a Hugging Face `config.json` dict (transformers 4 or 5 layout)."""
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
        **{ours: hf[key] for ours, key in _HF_KEYS.items()}, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(hf.get("tie_word_embeddings")),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")), qk_norm=model_type == "qwen3",
        sliding_window=hf.get("sliding_window") if model_type == "mistral" else None,
        rope_scaling=rope_scaling_from_hf(hf), hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
        architecture=model_type, name=name or hf.get("_name_or_path") or model_type)
    if model_type.startswith("gemma"):
        fields.update(_gemma_from_hf(hf, model_type))
    return fields


def to_hf(cfg) -> dict[str, Any]:
    """The `config.json` dict transformers expects for a `ModelConfig`."""
    hf = {"model_type": cfg.architecture, "architectures": [_HF_CLASSES[cfg.architecture]],
          **{key: getattr(cfg, ours) for ours, key in _HF_KEYS.items()}, "num_key_value_heads": cfg.num_kv_heads,
          "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "head_dim": cfg.resolved_head_dim,
          "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": cfg.hidden_act}
    if cfg.architecture.startswith("gemma"):
        hf.update(hidden_activation=cfg.hidden_act, sliding_window=cfg.sliding_window,
                  layer_types=list(cfg.layer_types or ()), attn_logit_softcapping=cfg.attn_softcap,
                  final_logit_softcapping=cfg.final_softcap, query_pre_attn_scalar=cfg.query_pre_attn_scalar)
        if cfg.architecture == "gemma3_text":
            full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **cfg.rope}
            hf["rope_parameters"] = {"full_attention": full,
                                     "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}}
        return hf
    if cfg.rope.get("rope_type") == "freq_factors":
        raise ValueError("rope scaling read from a GGUF rope_freqs.weight tensor has no config.json form")
    if cfg.rope_scaling:
        hf["rope_scaling"] = cfg.rope
    if cfg.architecture == "mistral":
        hf["sliding_window"] = cfg.sliding_window
    elif cfg.sliding_window is not None:
        raise ValueError(f"jaxspec writes sliding windows for mistral models only, not {cfg.architecture}")
    if (cfg.architecture == "qwen3") != cfg.qk_norm:
        raise ValueError(f"transformers has q/k norms in qwen3 models only, not in {cfg.architecture} "
                         f"(qk_norm={cfg.qk_norm})")
    if cfg.architecture != "qwen2":
        hf["attention_bias"] = cfg.attention_bias
    elif not cfg.attention_bias:
        raise ValueError("a qwen2 config always has attention_bias=True in transformers")
    return hf


def fields_from_gguf(metadata: Mapping[str, Any], tensor_names: Collection[str] = (),
                     name: str | None = None, rope_freqs=None) -> dict[str, Any]:
    """`ModelConfig` fields from GGUF key/values (llama.cpp names) and the file's tensor names (from
    which a tied head and q/k/v biases are read: the metadata does not state them)."""
    arch = metadata.get("general.architecture")
    supported = [a for a in SUPPORTED_ARCHITECTURES if a != "gemma3_text"] + ["gemma3"]   # llama.cpp's names
    if arch not in supported:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(supported)}")

    def key(suffix, default=None):
        value = metadata.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{suffix}")
        return value

    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None, "linear"):
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported; supported: none, linear")
    if "rope_freqs.weight" in tensor_names and rope_freqs is None:
        raise ValueError("GGUF rope_freqs.weight (Llama 3 rope scaling as stored by llama.cpp) needs its values: "
                         "load the file with jaxspec.load")
    if rope_freqs is not None and scaling not in ("none", None):
        raise ValueError(f"GGUF rope_freqs.weight together with rope scaling type {scaling!r} is not supported")
    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = metadata.get(f"{arch}.vocab_size")
    names = set(tensor_names)
    head_dim = int(metadata.get(f"{arch}.attention.key_length", 0)
                   or metadata.get(f"{arch}.rope.dimension_count", 0)) or None
    num_layers = int(key("block_count"))
    gemma = _gemma_from_gguf(metadata, arch, num_layers, hidden / num_heads, head_dim) if "gemma" in arch else {}
    if head_dim == hidden // num_heads:
        head_dim = None
    return dict(
        vocab_size=int(len(metadata["tokenizer.ggml.tokens"]) if vocab is None else vocab), hidden_size=hidden,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        intermediate_size=int(key("feed_forward_length")), max_position_embeddings=int(key("context_length")),
        rope_theta=float(key("rope.freq_base", 10000.0)), rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=bool(names) and "output.weight" not in names, attention_bias="blk.0.attn_q.bias" in names,
        head_dim=head_dim, qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling={"rope_type": "freq_factors", "factors": tuple(float(f) for f in rope_freqs)}
        if rope_freqs is not None else None if scaling in ("none", None) else
        {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])},
        architecture="gemma3_text" if arch == "gemma3" else arch, name=name or str(metadata.get("general.name", arch)),
        **gemma)


def _gemma_from_gguf(metadata: Mapping[str, Any], arch: str, num_layers: int, width_per_head: float,
                     head_dim: int | None) -> dict[str, Any]:
    """The Gemma 2 / 3 options of a GGUF file, read as llama.cpp reads them (its rules fill gaps)."""
    window = metadata.get(f"{arch}.attention.sliding_window")
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if not isinstance(pattern, (list, tuple)):   # a list: true for a sliding layer; n: every n-th layer is global
        pattern = [(i + 1) % int(pattern) for i in range(num_layers)]
    types = tuple("sliding_attention" if swa else "full_attention" for swa in pattern)
    largest = num_layers == (46 if arch == "gemma2" else 62)   # the 27B models scale queries by width / heads
    fields = dict(sliding_window=int(window) if window else None, layer_types=types if window else None,
                  norm_offset=1.0, embed_scale=True, post_norms=True, hidden_act="gelu_pytorch_tanh",
                  attn_softcap=metadata.get(f"{arch}.attn_logit_softcapping"),
                  final_softcap=metadata.get(f"{arch}.final_logit_softcapping"),
                  query_pre_attn_scalar=width_per_head if largest else float(head_dim or width_per_head))
    if arch == "gemma3":
        fields["rope_local_theta"] = float(metadata.get(f"{arch}.rope.freq_base_swa", 10000.0))
    return fields


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
