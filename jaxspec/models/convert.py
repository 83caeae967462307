"""Checkpoint conversion as one declarative table: jaxspec param <-> HF tensor <-> GGUF tensor.

Each row names a jaxspec weight, its tensor name in a transformers checkpoint and in a llama.cpp
GGUF file (`{i}` = layer index), and how the HF layout maps onto ours (`_LAYOUTS`); nothing else
knows tensor names. Checkpoints keep q/k/v and gate/up apart (`fuse_layers` / `unfuse_layers`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Collection

import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ModelConfig

# Layouts: name -> (HF layout -> ours, ours -> HF), given the head dim h.
_LAYOUTS = {
    "": (lambda x, h: x, lambda x, h: x),
    "T": (lambda x, h: x.T, lambda x, h: x.T),
    # [n*h, ...] <-> [n, h, ...] (q/k/v weights and biases)
    "heads": (lambda x, h: x.reshape(-1, h, *x.shape[1:]), lambda x, h: x.reshape(-1, *x.shape[2:])),
    # [d, n*h] <-> [d, n, h] (the output projection)
    "last_heads": (lambda x, h: x.reshape(x.shape[0], -1, h), lambda x, h: x.reshape(x.shape[0], -1)),
    # [n*h, d] <-> [d, n, h] (an EAGLE-3 head's q/k/v)
    "in_heads": (lambda x, h: x.T.reshape(x.shape[1], -1, h), lambda x, h: x.reshape(x.shape[0], -1).T),
    # [d, n*h] <-> [n, h, d] (an EAGLE-3 head's output projection)
    "out_heads": (lambda x, h: x.T.reshape(-1, h, x.shape[0]), lambda x, h: x.reshape(-1, x.shape[-1]).T),
}


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One weight: where it lives in jaxspec params, in HF and in GGUF checkpoints."""

    ours: tuple[str, ...]  # per-layer rules: ("layers", <name>...) means params["layers"][i][<name>...]
    hf: str                # or, per architecture, `hf_by_arch`
    gguf: str
    layout: str = ""       # a `_LAYOUTS` name
    per_layer: bool = False
    present: Callable[[ModelConfig], bool] = lambda cfg: True
    # llama.cpp stores Llama q/k rows permuted for its rope layout; None = no permutation.
    gguf_heads: Callable[[ModelConfig], int] | None = None
    hf_by_arch: tuple[tuple[str, str], ...] = ()

    def hf_name(self, cfg: ModelConfig) -> str:
        return dict(self.hf_by_arch).get(cfg.architecture, self.hf)

    def to_ours(self, x, cfg: ModelConfig):
        return _LAYOUTS[self.layout][0](x, cfg.resolved_head_dim)

    def to_hf(self, x, cfg: ModelConfig):
        return _LAYOUTS[self.layout][1](x, cfg.resolved_head_dim)


# Fused block weight -> the separate ones checkpoints hold, in its order (`decoder.Block`); int8 scales alike.
_FUSED = {"qkv_kxhd": ("q_nhd", "k_khd", "v_khd"), "qkv_bias_kxh": ("q_bias_nh", "k_bias_kh", "v_bias_kh"),
          "gate_up_fxd": ("gate_fd", "up_fd")}
_FUSED |= {f"{k}_scale": tuple(f"{n}_scale" for n in v) for k, v in _FUSED.items()}
_has_bias, _post_norms, _qk_norm = (operator.attrgetter(f) for f in ("attention_bias", "post_norms", "qk_norm"))
_q_heads, _kv_heads = operator.attrgetter("num_heads"), operator.attrgetter("num_kv_heads")
_L = "model.layers.{i}."
RULES: tuple[WeightRule, ...] = (
    WeightRule(("embed_vd",), "model.embed_tokens.weight", "token_embd.weight"),
    WeightRule(("final_norm", "scale"), "model.norm.weight", "output_norm.weight"),
    WeightRule(("lm_head_vd",), "lm_head.weight", "output.weight", present=lambda cfg: not cfg.tie_word_embeddings),
    WeightRule(("layers", "attn_norm", "scale"), _L + "input_layernorm.weight", "blk.{i}.attn_norm.weight",
               per_layer=True),
    # q, k, v and their biases (Qwen2): apart here and in checkpoints, fused in blocks (`_FUSED`).
    *(WeightRule(("layers", ours), _L + f"self_attn.{x}_proj.{kind}", f"blk.{{i}}.attn_{x}.{kind}", "heads",
                 per_layer=True, gguf_heads=heads, **({"present": _has_bias} if kind == "bias" else {}))
      for kind, fused in (("weight", "qkv_kxhd"), ("bias", "qkv_bias_kxh"))
      for ours, x, heads in zip(_FUSED[fused], "qkv", (_q_heads, _kv_heads, None))),
    WeightRule(("layers", "q_norm", "scale"), _L + "self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight",
               per_layer=True, present=_qk_norm),
    WeightRule(("layers", "k_norm", "scale"), _L + "self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight",
               per_layer=True, present=_qk_norm),
    WeightRule(("layers", "o_dnh"), _L + "self_attn.o_proj.weight", "blk.{i}.attn_output.weight",
               "last_heads", per_layer=True),
    WeightRule(("layers", "mlp_norm", "scale"), _L + "post_attention_layernorm.weight",
               "blk.{i}.ffn_norm.weight", per_layer=True,
               hf_by_arch=tuple((a, _L + "pre_feedforward_layernorm.weight") for a in ("gemma2", "gemma3_text"))),
    WeightRule(("layers", "post_attn_norm", "scale"), _L + "post_attention_layernorm.weight",
               "blk.{i}.post_attention_norm.weight", per_layer=True, present=_post_norms),
    WeightRule(("layers", "post_mlp_norm", "scale"), _L + "post_feedforward_layernorm.weight",
               "blk.{i}.post_ffw_norm.weight", per_layer=True, present=_post_norms),
    *(WeightRule(("layers", ours), _L + f"mlp.{x}_proj.weight", f"blk.{{i}}.ffn_{x}.weight", per_layer=True)
      for ours, x in (("gate_fd", "gate"), ("up_fd", "up"), ("down_df", "down"))),
)

# An EAGLE-3 head (`jaxspec.models.eagle.EagleModule`) in the reference's layout, PyTorch [out, in]
# weights as vLLM and SGLang read them; it has no GGUF form.
_M = "midlayer."
EAGLE3_RULES: tuple[WeightRule, ...] = (
    WeightRule(("fc_fd",), "fc.weight", "", "T"),
    WeightRule(("q_xnh",), _M + "self_attn.q_proj.weight", "", "in_heads"),
    WeightRule(("k_xkh",), _M + "self_attn.k_proj.weight", "", "in_heads"),
    WeightRule(("v_xkh",), _M + "self_attn.v_proj.weight", "", "in_heads"),
    WeightRule(("o_nhd",), _M + "self_attn.o_proj.weight", "", "out_heads"),
    WeightRule(("gate_du",), _M + "mlp.gate_proj.weight", "", "T"),
    WeightRule(("up_du",), _M + "mlp.up_proj.weight", "", "T"),
    WeightRule(("down_ud",), _M + "mlp.down_proj.weight", "", "T"),
    WeightRule(("input_norm", "scale"), _M + "input_layernorm.weight", ""),
    WeightRule(("hidden_norm", "scale"), _M + "hidden_norm.weight", ""),
    WeightRule(("mlp_norm", "scale"), _M + "post_attention_layernorm.weight", ""),
    WeightRule(("final_norm", "scale"), "norm.weight", ""),
    WeightRule(("lm_head_dw",), "lm_head.weight", "", "T"),
)

def _unpermute_gguf(x: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (its rope pairs interleaved, ours rotate-half)."""
    half = x.shape[0] // n_head // 2
    return x.reshape(n_head, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def convert_tensors(cfg: ModelConfig, our_shapes: dict, get: Callable[[str], np.ndarray],
                    names: Collection[str], *, source: str, convert_leaf: Callable) -> dict:
    """jaxspec params of `our_shapes` from the checkpoint tensors `names`, read by `get(name)` (float
    numpy, HF layout), stored as `convert_leaf(weight in our layout, its path)`; `source`: "hf",
    "gguf" (a name column of `RULES`) or "eagle" (`EAGLE3_RULES`)."""
    names = set(names)
    used: set[str] = set()
    params: dict = {}
    for rule, name, path in _weights(cfg, source):
        expected = tuple(rule.to_hf(np.empty(_lookup(our_shapes, path).shape, np.int8), cfg).shape)
        if name not in names:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {expected})")
        tensor = np.asarray(get(name))
        if tuple(tensor.shape) != expected:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but the config needs {expected}")
        if source == "gguf" and rule.gguf_heads is not None and cfg.architecture == "llama":
            tensor = _unpermute_gguf(tensor, rule.gguf_heads(cfg))
        if source == "gguf" and cfg.norm_offset and name.endswith("norm.weight"):
            tensor = tensor - np.float32(cfg.norm_offset)   # llama.cpp stores Gemma's norms as 1 + w
        _assign(params, path, convert_leaf(rule.to_ours(tensor, cfg), path))
        used.add(name)
    leftover = sorted(n for n in names - used if not _harmless(n, cfg, source))
    if leftover:
        shown = ", ".join(repr(n) for n in leftover[:8])
        raise ValueError(f"checkpoint has {len(leftover)} unexpected tensor(s) for a "
                         f"{cfg.architecture} model with this config: {shown}")
    return params


def params_to_hf(cfg: ModelConfig, params: dict, source: str = "hf") -> dict[str, np.ndarray]:
    """jaxspec params -> HF-named float32 numpy tensors (for writing safetensors checkpoints; of an
    EAGLE-3 head with `source="eagle"`)."""
    params = params if source == "eagle" else unfuse_layers(params)
    return {name: np.ascontiguousarray(rule.to_hf(np.asarray(_lookup(params, path), np.float32), cfg))
            for rule, name, path in _weights(cfg, source)}


def _join(q, *rest):  # q [n, ...], k and v [k, ...] -> [k, g + 2, ...]; gate, up [f, ...] -> [f, 2, ...]
    xp = np if isinstance(q, np.ndarray) else jnp
    return xp.stack([q, *rest], 1) if len(rest) == 1 else xp.concatenate(
        [q.reshape(rest[0].shape[0], -1, *q.shape[1:])] + [x[:, None] for x in rest], 1)


def _split(x, n: int):  # the inverse of `_join`
    return (x[:, 0], x[:, 1]) if n == 2 else (x[:, :-2].reshape(-1, *x.shape[2:]), x[:, -2], x[:, -1])


def fuse_layers(params: dict, unfuse: bool = False) -> dict:
    """Params with each layer's separate q/k/v (their biases, int8 scales) and gate/up fused (`_join`), or
    with `unfuse` the inverse (`unfuse_layers`: the layout of checkpoints and `RULES`). Numpy arrays stay
    numpy, jax arrays jax's; shapes (`jax.ShapeDtypeStruct`) go through `jax.eval_shape(fuse_layers, ...)`."""
    def layer(x: dict) -> dict:
        x = dict(x)
        for name, parts in _FUSED.items():
            if not unfuse and parts[0] in x:
                x[name] = _join(*(x.pop(p) for p in parts))
            elif unfuse and name in x:
                x.update(zip(parts, _split(x.pop(name), len(parts))))
        return x
    return {**params, "layers": {i: layer(x) for i, x in params["layers"].items()}}


unfuse_layers = functools.partial(fuse_layers, unfuse=True)


def _harmless(name: str, cfg: ModelConfig, source: str) -> bool:
    """HF tensors holding nothing jaxspec needs: rotary frequencies, a tied head stored twice."""
    return source == "hf" and (name.endswith("rotary_emb.inv_freq") or
                               (name == "lm_head.weight" and cfg.tie_word_embeddings))


def _weights(cfg: ModelConfig, source: str):
    """(rule, tensor name in `source`'s checkpoints, params path) of each weight `cfg` has; per-layer
    weights sit under params["layers"][i]."""
    for rule in EAGLE3_RULES if source == "eagle" else RULES:
        if rule.present(cfg):
            template = rule.gguf if source == "gguf" else rule.hf_name(cfg)
            for i in range(cfg.num_layers if rule.per_layer else 1):
                yield rule, template.format(i=i), (rule.ours[0], i, *rule.ours[1:]) if rule.per_layer else rule.ours


def _lookup(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _assign(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
