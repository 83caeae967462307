"""EAGLE-3 draft heads: one decoder layer fed by the target's own hidden states.

Shape key: b rows, t tokens, m flat tokens, s cache slots, d the head's width, f fused target
features, n / k query / kv heads, h head dim, u MLP width, v target vocabulary, w draft vocabulary.

EAGLE-3 (Li et al., 2025): the residual stream entering three target layers is concatenated and
mapped by `fc` to the head's width: the hidden input of the first draft step (later steps feed the
head's own pre-norm output). A step normalises its token's embedding (the target's, shared) and the
hidden input apart, concatenates them into attention's 2d-wide input, adds attention's output to the
hidden input, runs an MLP block and scores the draft vocabulary. Draft token i is target token
`draft_ids[i]` (checkpoints store d2t[i] = draft_ids[i] - i); other tokens get probability 0.

The head's row for target position p pairs the target's features of the token at p with the
embedding of the token at p + 1, at rotary position p, and predicts the token at p + 2.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.attention import attend_cache
from jaxspec.models.cache import KVCache
from jaxspec.models.config import ModelConfig
from jaxspec.models.convert import convert_tensors, params_to_hf
from jaxspec.models.decoder import RMSNorm, _normal, rotary
from jaxspec.models.hf_config import rope_scaling_from_hf
from jaxspec.models.model import _logical_axes

_F32 = jnp.float32
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"   # `architectures` in an EAGLE-3 folder's config.json


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high layers: the inputs of layers 2, L // 2 and L - 3 (clamped
    into the model for shallow test models)."""
    return tuple(sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
    """`layer`: the head's decoder layer as a one-layer ModelConfig of the draft vocabulary's size;
    `feature_layers`: the target layers whose inputs are fused, ascending; `norm_before_residual`: the
    residual around attention is the normalised hidden input (a speculators variant)."""

    layer: ModelConfig
    target_hidden_size: int
    target_vocab_size: int
    feature_layers: tuple[int, ...]
    norm_before_residual: bool = False

    @property
    def feature_size(self) -> int:
        return len(self.feature_layers) * self.target_hidden_size


class EagleModule(nnx.Module):
    """The head's weights; `jaxspec.models.eagle.head_forward` runs them."""

    def __init__(self, config: EagleConfig, *, dtype, rngs: nnx.Rngs):
        c = config.layer
        d, n, k, h, u, w = (c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim, c.intermediate_size,
                            c.vocab_size)
        f = config.feature_size
        self.theta, self.rope_scaling, self.head_dim = c.rope_theta, c.rope_scaling, h
        self.norm_before_residual = config.norm_before_residual

        def param(shape, fan_in: int, axes):   # random, std 1 / sqrt(fan_in)
            return nnx.Param(_normal(rngs.params(), shape, fan_in ** -0.5, dtype), axes=axes)

        self.fc_fd = param((f, d), f, ("features", "embed"))
        self.input_norm = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
        self.q_xnh = param((2 * d, n, h), 2 * d, ("embed", "heads", "head_dim"))
        self.k_xkh = param((2 * d, k, h), 2 * d, ("embed", "kv_heads", "head_dim"))
        self.v_xkh = param((2 * d, k, h), 2 * d, ("embed", "kv_heads", "head_dim"))
        self.o_nhd = param((n, h, d), n * h, ("heads", "head_dim", "embed"))
        self.mlp_norm = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
        self.gate_du = param((d, u), d, ("embed", "mlp"))
        self.up_du = param((d, u), d, ("embed", "mlp"))
        self.down_ud = param((u, d), u, ("mlp", "embed"))
        self.final_norm = RMSNorm(d, c.rms_norm_eps, dtype=dtype)
        self.lm_head_dw = param((d, w), d, ("embed", "vocab"))

    def fuse(self, features_mf):
        return features_mf @ self.fc_fd[...]

    def qkv(self, hidden_md, embedded_md, pos_m):
        """Queries, keys and values of the [embedding, hidden] input, rotated to positions pos_m."""
        m = hidden_md.shape[0]
        x = jnp.concatenate([self.input_norm(embedded_md), self.hidden_norm(hidden_md)], axis=-1)
        q, k, v = ((x @ w[...].reshape(x.shape[-1], -1)).reshape(m, -1, self.head_dim)
                   for w in (self.q_xnh, self.k_xkh, self.v_xkh))
        return rotary(q, pos_m, self.theta, self.rope_scaling), rotary(k, pos_m, self.theta, self.rope_scaling), v

    def finish(self, hidden_md, attn_mnh):
        """Attention's output added to the hidden input, then the MLP block (pre-norm output)."""
        m, d = hidden_md.shape
        residual = self.hidden_norm(hidden_md) if self.norm_before_residual else hidden_md
        x = residual + attn_mnh.reshape(m, -1) @ self.o_nhd[...].reshape(-1, d)
        y = self.mlp_norm(x)
        return x + (jax.nn.silu(y @ self.gate_du[...]) * (y @ self.up_du[...])) @ self.down_ud[...]

    def head(self, hidden_md):
        return jnp.dot(self.final_norm(hidden_md), self.lm_head_dw[...], preferred_element_type=_F32)


def fuse(graphdef, params, features_btf):
    """The fused target features [b, t, d]: the first draft step's hidden input."""
    return nnx.merge(graphdef, params).fuse(features_btf)


def head_forward(graphdef, params, embed_vd, hidden_btd, tokens_bt, cache: KVCache, tree=None):
    """One draft step of the head for t tokens per row at positions cache.lengths[b] + t (keys and
    values written, `lengths` not advanced): hidden_btd are fused target features (`fuse`) or the
    head's own outputs, tokens_bt the token after each one's. Returns (float32 draft-vocabulary
    logits [b, t, w], pre-norm outputs [b, t, d] that feed the next step, cache). tree: None, or
    (slot_bt, offset_bt, ancestor_btn): token i is written at slot lengths + slot_bt[b, i], sits at
    position lengths + offset_bt[b, i], and sees the committed cache and the tree slots ancestor_btn marks.
    """
    module = nnx.merge(graphdef, params)
    b, t = tokens_bt.shape
    if tree is None:
        slot_bt = pos_bt = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
        live_b, attend_tree = jnp.minimum(cache.lengths + t, cache.max_len), None
    else:
        slot_bt, pos_bt = cache.lengths[:, None] + tree[0], cache.lengths[:, None] + tree[1]
        live_b, attend_tree = jnp.minimum(cache.lengths + tree[2].shape[2], cache.max_len), (cache.lengths, tree[2])
    rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    hidden_md = hidden_btd.reshape(b * t, -1).astype(embed_vd.dtype)
    q, k, v = (a.reshape(b, t, *a.shape[1:]) for a in
               module.qkv(hidden_md, jnp.take(embed_vd, tokens_bt.reshape(-1), axis=0), pos_bt.reshape(-1)))
    k_cache = cache.k[0].at[rows_bt, slot_bt].set(k.astype(cache.k[0].dtype), mode="drop")
    v_cache = cache.v[0].at[rows_bt, slot_bt].set(v.astype(cache.v[0].dtype), mode="drop")
    attn = attend_cache(q, k_cache, v_cache, pos_bt, live_b, tree=attend_tree)
    out_md = module.finish(hidden_md, attn.reshape(b * t, *attn.shape[2:]))
    return (module.head(out_md).reshape(b, t, -1), out_md.reshape(b, t, -1),
            cache.replace(k=(k_cache,), v=(v_cache,)))


def to_target_logits(logits_btw, draft_ids_w, vocab_size: int):
    """Draft-vocabulary logits scattered into the target's vocabulary, -inf elsewhere."""
    if logits_btw.shape[-1] == vocab_size:
        return logits_btw
    full = jnp.full(logits_btw.shape[:-1] + (vocab_size,), -jnp.inf, logits_btw.dtype)
    return full.at[..., draft_ids_w].set(logits_btw)


class EagleHead:
    """An EAGLE-3 head for one target: its `config`, `graphdef` and `params` (split as `jaxspec.Model`
    splits its decoder), `draft_ids` (int32 numpy [w], the draft vocabulary's ascending target ids)
    and `embed_vd`, the target's token embedding (the same array, or None for an unbound head)."""

    def __init__(self, config: EagleConfig, graphdef, params, draft_ids, embed_vd=None):
        draft_ids = np.asarray(draft_ids, np.int32)
        if draft_ids.shape != (config.layer.vocab_size,) or np.any(np.diff(draft_ids) <= 0) or (
                draft_ids.size and (draft_ids[0] < 0 or draft_ids[-1] >= config.target_vocab_size)):
            raise ValueError(f"draft_ids must be {config.layer.vocab_size} ascending ids in "
                             f"[0, {config.target_vocab_size})")
        self.config, self.graphdef, self.params, self.draft_ids = config, graphdef, params, draft_ids
        self.embed_vd = embed_vd

    @classmethod
    def init(cls, target, feature_layers=None, draft_vocab_size=None, seed: int = 0, token_counts=None,
             dtype=None) -> EagleHead:
        """A fresh head for `target` (a `jaxspec.Model`, whose embedding it shares), shaped like one
        of its layers, its LM head the target's over the draft ids. `feature_layers`: None for EAGLE-3's
        low / middle / high; `draft_vocab_size`: None for the full vocabulary, else the most frequent
        ids of `token_counts` (int [v]), or the lowest ids; `dtype`: default the target's."""
        tc = target.config
        layers = default_feature_layers(tc.num_layers) if feature_layers is None else tuple(feature_layers)
        if not layers or any(not isinstance(i, (int, np.integer)) or not 0 <= i < tc.num_layers for i in layers):
            raise ValueError(f"feature_layers must be target layer indices in [0, {tc.num_layers}), got {layers}")
        w = tc.vocab_size if draft_vocab_size is None else int(draft_vocab_size)
        if not 1 <= w <= tc.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {tc.vocab_size}], got {draft_vocab_size}")
        if token_counts is not None and w < tc.vocab_size:
            draft_ids = np.sort(np.argsort(-np.asarray(token_counts), kind="stable")[:w])
        else:
            draft_ids = np.arange(w)
        # The head's layer: a Llama layer of the target's shape, whatever the target's family.
        config = _head_config(tc, layers, vocab_size=w, hidden_size=tc.hidden_size, num_heads=tc.num_heads,
                              num_kv_heads=tc.num_kv_heads, intermediate_size=tc.intermediate_size,
                              rope_theta=tc.rope_theta, rms_norm_eps=tc.rms_norm_eps, head_dim=tc.head_dim,
                              rope_scaling=tc.rope_scaling)
        dtype = target.dtype if dtype is None else dtype
        graphdef, state = nnx.split(EagleModule(config, dtype=dtype, rngs=nnx.Rngs(seed)))
        params = nnx.to_pure_dict(state)
        head_vd = target.params["embed_vd"] if tc.tie_word_embeddings else target.params["lm_head_vd"]
        params["lm_head_dw"] = jnp.asarray(head_vd)[draft_ids].T.astype(dtype)
        return cls(config, graphdef, params, draft_ids, target.params["embed_vd"])

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.init(self.config.layer, batch, max_len, self.params["fc_fd"].dtype)

    @property
    def logical_axes(self) -> dict:
        """Nested dict parallel to `params` of logical axis-name tuples (as `Model.logical_axes`)."""
        return _logical_axes(nnx.state(_abstract_module(self.config, jnp.float32)))

    def save(self, path) -> None:
        """Writes `config.json` and `model.safetensors` in the published EAGLE-3 layout
        (`convert.EAGLE3_RULES`; float32 weights, d2t int64, t2d bool), which `jaxspec.load(path,
        target=...)` and EAGLE-3 loaders elsewhere read."""
        from safetensors.numpy import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        c, config = self.config.layer, self.config
        hf = {"architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.resolved_head_dim, "num_hidden_layers": 1,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              **({"rope_scaling": c.rope} if c.rope else {}),
              "max_position_embeddings": c.max_position_embeddings, "vocab_size": config.target_vocab_size,
              "draft_vocab_size": c.vocab_size, "target_hidden_size": config.target_hidden_size,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
                               "use_aux_hidden_state": True}, "norm_before_residual": config.norm_before_residual}
        (path / "config.json").write_text(json.dumps(hf, indent=2))
        tensors = params_to_hf(c, self.params, source="eagle")
        tensors["d2t"] = (self.draft_ids - np.arange(len(self.draft_ids))).astype(np.int64)
        tensors["t2d"] = np.zeros(config.target_vocab_size, bool)
        tensors["t2d"][self.draft_ids] = True
        save_file(tensors, str(path / "model.safetensors"))


def _head_config(target: ModelConfig, feature_layers, norm_before_residual: bool = False, **layer) -> EagleConfig:
    """The config of a head for `target` whose one layer has the ModelConfig fields `layer`."""
    layer = ModelConfig(num_layers=1, max_position_embeddings=target.max_position_embeddings,
                        name=f"{target.name}-eagle3", **layer)
    return EagleConfig(layer=layer, target_hidden_size=target.hidden_size, target_vocab_size=target.vocab_size,
                       feature_layers=tuple(sorted(int(i) for i in feature_layers)),
                       norm_before_residual=norm_before_residual)


def _abstract_module(config: EagleConfig, dtype) -> EagleModule:
    return nnx.eval_shape(lambda: EagleModule(config, dtype=dtype, rngs=nnx.Rngs(0)))


def is_eagle_folder(path) -> bool:
    config = Path(path) / "config.json"
    return config.exists() and any("Eagle3" in a for a in json.loads(config.read_text()).get("architectures", []))


def _speculators(hf: dict, tensors: dict) -> tuple[dict, dict]:
    """A speculators-format head (`speculators_model_type` "eagle3") as the reference layout: the
    layer's fields from `transformer_layer_config`, tensors `layers.0.*` as `midlayer.*`."""
    layer = dict(hf["transformer_layer_config"])
    layer.update({key: hf[key] for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual")
                  if key in hf})
    layer["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": hf.get("eagle_aux_hidden_state_layer_ids")}
    return layer, {name.replace("layers.0.", "midlayer.", 1): value for name, value in tensors.items()}


def load_head(path, target) -> EagleHead:
    """Reads an EAGLE-3 folder (`EagleHead.save`'s layout, the reference's) as a head bound to `target`,
    in the target's dtype; a ValueError names a field or tensor that does not fit."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    tensors = _read_tensors(path)
    if hf.get("speculators_model_type") == "eagle3":
        hf, tensors = _speculators(hf, tensors)
    tc = target.config
    if hf.get("vocab_size", tc.vocab_size) != tc.vocab_size:
        raise ValueError(f"the head's vocab_size ({hf['vocab_size']}) differs from the target's ({tc.vocab_size})")
    if hf.get("target_hidden_size", hf["hidden_size"]) != tc.hidden_size:
        raise ValueError(f"the head reads features of width {hf.get('target_hidden_size', hf['hidden_size'])}, "
                         f"but the target's hidden_size is {tc.hidden_size}")
    layers = tuple(hf.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
                   or default_feature_layers(tc.num_layers))
    if any(not 0 <= i < tc.num_layers for i in layers):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {layers} must lie in [0, {tc.num_layers})")
    w = int(hf.get("draft_vocab_size", tc.vocab_size))
    rope_theta = float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 1e4)))
    config = _head_config(tc, layers, bool(hf.get("norm_before_residual", False)), vocab_size=w,
                          hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
                          num_kv_heads=hf["num_key_value_heads"], intermediate_size=hf["intermediate_size"],
                          rope_theta=rope_theta, rms_norm_eps=float(hf["rms_norm_eps"]), head_dim=hf.get("head_dim"),
                          rope_scaling=rope_scaling_from_hf(hf))
    graphdef, state = nnx.split(_abstract_module(config, target.dtype))
    params = convert_tensors(config.layer, nnx.to_pure_dict(state), lambda name: np.asarray(tensors[name], np.float32),
                             set(tensors) - {"d2t", "t2d", "embed_tokens.weight"}, source="eagle",
                             convert_leaf=lambda value, path: jnp.asarray(value, target.dtype))
    if "d2t" in tensors:
        draft_ids = np.arange(w) + np.asarray(tensors["d2t"], np.int64)
    elif w == tc.vocab_size:
        draft_ids = np.arange(w)
    else:
        raise ValueError(f"missing tensor 'd2t' (expected shape ({w},)): a reduced draft vocabulary needs its map")
    return EagleHead(config, graphdef, params, draft_ids, target.params["embed_vd"])


def _read_tensors(path: Path) -> dict:
    """The folder's tensors as numpy: model.safetensors, or pytorch_model.bin (the EAGLE reference's
    own releases; reading it needs torch)."""
    if (path / "model.safetensors").exists():
        from safetensors.numpy import load_file

        return load_file(str(path / "model.safetensors"))
    if not (path / "pytorch_model.bin").exists():
        raise ValueError(f"{str(path)!r} has neither model.safetensors nor pytorch_model.bin")
    try:
        import torch
    except ImportError:
        raise ValueError(f"reading {str(path / 'pytorch_model.bin')!r} needs torch (pip install torch), or "
                         "convert it to model.safetensors") from None
    state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return {name: (t.float() if t.is_floating_point() else t).numpy() for name, t in state.items()}
