"""Initialising a draft model from its target: same tokenizer, a shallower (and maybe narrower) stack.

A draft that starts from the target's own embedding and head already speaks the target's token
space, so distillation only has to teach the blocks. At the target's width the draft is its first
`num_layers` blocks, embedding, final norm and head, copied. Narrower (e < d), the blocks are fresh
and the embedding is projected onto its top-e right singular vectors (truncated SVD: the most
variance that fits in e dimensions); an untied head likewise, with the target's final-norm scale
folded in (it does not survive a rotation of the basis); a tied head's norm starts at its RMS.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.model import Model, resolve_dtype
from jaxspec.prompts import check_int


def draft_from_target(target: Model, num_layers: int, *, hidden_size: int | None = None,
                      intermediate_size: int | None = None, num_heads: int | None = None,
                      num_kv_heads: int | None = None, seed: int = 0, dtype=None) -> Model:
    """A draft model initialised from `target`, sharing its vocabulary and tokenizer.

    Args:
      num_layers: decoder blocks of the draft, in [1, target layers] when the width is kept.
      hidden_size: the draft's width; None keeps the target's (and copies its first blocks).
        Smaller widths project the embedding by truncated SVD and initialise the blocks randomly.
      intermediate_size: MLP width; None keeps the target's ratio to the hidden size.
      num_heads: query heads; None keeps the target's head dimension (hidden_size // head_dim heads).
      num_kv_heads: key/value heads; None: the largest divisor of num_heads not above the target's.
      seed: seeds the weights that are not copied; dtype: the draft's (None: the target's).

    Raises:
      ValueError: if num_layers or hidden_size is out of range.
    """
    cfg = target.config
    if target.quantization is not None:
        raise ValueError(f"target is {target.quantization}-quantized: build the draft from the float model "
                         f"and quantize both afterwards")
    check_int("num_layers", num_layers, 1)
    width = cfg.hidden_size if hidden_size is None else hidden_size
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= cfg.hidden_size:
        raise ValueError(f"hidden_size must be an int in [1, {cfg.hidden_size}] (the target's width), "
                         f"got {hidden_size!r}")
    name = f"{cfg.name}-draft{num_layers}x{width}"
    if width == cfg.hidden_size and intermediate_size in (None, cfg.intermediate_size) \
            and num_heads in (None, cfg.num_heads) and num_kv_heads in (None, cfg.num_kv_heads):
        if num_layers > cfg.num_layers:
            raise ValueError(f"num_layers must be at most the target's {cfg.num_layers} when its blocks are "
                             f"copied (same width and block shapes), got {num_layers}")
        config = cfg.replace(num_layers=num_layers, layer_types=_layer_types(cfg, num_layers), name=name)
        params = jax.tree.map(lambda x: x, target.params)  # a new tree; arrays are immutable
        params["layers"] = {i: target.params["layers"][i] for i in range(num_layers)}
        draft = Model(config, params, dtype=target.dtype, tokenizer=target.tokenizer)
    else:
        config = _narrow_config(cfg, num_layers, width, intermediate_size, num_heads, num_kv_heads, name)
        draft = Model(config, _fresh_blocks(target, config, seed), dtype="float32", tokenizer=target.tokenizer)
    return _cast(draft, target.dtype if dtype is None else dtype)


def _fresh_blocks(target: Model, config: ModelConfig, seed: int) -> dict:
    """float32 params of `config`: random blocks, the target's embedding, final norm and head."""
    params = jax.tree.map(np.asarray, Model.random(config, seed=seed, dtype="float32").params)
    embed_vd = np.asarray(target.params["embed_vd"], np.float32)
    gain_d = np.asarray(target.params["final_norm"]["scale"], np.float32)
    head_vd = None if config.tie_word_embeddings else np.asarray(target.params["lm_head_vd"], np.float32)
    width = config.hidden_size
    if width == target.config.hidden_size:
        params["embed_vd"], params["final_norm"]["scale"] = embed_vd, gain_d
        if head_vd is not None:
            params["lm_head_vd"] = head_vd
        return params
    # Right singular vectors: the directions along which the token vectors vary most.
    basis_de = np.linalg.svd(embed_vd, full_matrices=False)[2][:width].T
    params["embed_vd"] = embed_vd @ basis_de
    if head_vd is None:
        params["final_norm"]["scale"] = np.full((width,), np.sqrt(np.mean(gain_d ** 2)), np.float32)
    else:
        params["lm_head_vd"] = (head_vd * gain_d) @ basis_de
        params["final_norm"]["scale"] = np.ones((width,), np.float32)
    return params


def _narrow_config(cfg: ModelConfig, num_layers, width, intermediate_size, num_heads, num_kv_heads,
                   name) -> ModelConfig:
    head_dim = cfg.resolved_head_dim
    if num_heads is None:
        num_heads = max(1, width // head_dim)
    if num_kv_heads is None:
        num_kv_heads = max(k for k in range(1, min(num_heads, cfg.num_kv_heads) + 1) if num_heads % k == 0)
    if intermediate_size is None:
        intermediate_size = max(1, round(cfg.intermediate_size * width / cfg.hidden_size))
    # Keep the target's head dimension (RoPE frequencies then mean the same thing in both models).
    explicit_head_dim = None if width == num_heads * head_dim else head_dim
    return cfg.replace(num_layers=num_layers, hidden_size=width, intermediate_size=intermediate_size,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=explicit_head_dim,
                       layer_types=_layer_types(cfg, num_layers), name=name)


def _layer_types(cfg, num_layers: int):
    """The target's first layers' attention types (its pattern repeated past its depth)."""
    types = cfg.layer_types
    return None if types is None else tuple(types[i % len(types)] for i in range(num_layers))


def _cast(model: Model, dtype) -> Model:
    dtype = resolve_dtype(dtype)
    if dtype == model.dtype:
        return model
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), model.params)
    return Model(model.config, params, dtype=dtype, tokenizer=model.tokenizer)
