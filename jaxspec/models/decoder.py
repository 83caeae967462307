"""Flax NNX decoder of the Llama family and its relatives (Mistral, Qwen2 / 3, Gemma 2 / 3, SmolLM),
whose differences are options of `ModelConfig`.

Shape key: b batch, t new tokens, s cache slots, d model width, n query heads, k kv heads,
g query heads per kv head, h head dim, f MLP width, v vocabulary, x fused: a block runs q/k/v as
one matrix [k, g + 2, h, d] and gate/up as one [f, 2, d] (`convert.fuse_layers`). Matrices are
stored [out axes..., in axes...], as HF stores them (`quant.matmul`), with logical axis names for
`jaxspec.parallel`. Blocks are unrolled, not scanned: slicing one layer out of stacked weights
costs a copy of it on CPU. Norm statistics, rotary angles, softmax and logits are in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models import quant
from jaxspec.models.attention import Options, attend, attend_cache
from jaxspec.models.cache import KVCache
from jaxspec.models.config import ModelConfig

_F32 = jnp.float32


def _normal(key, shape, std, dtype):
    return (std * jax.random.normal(key, shape, _F32)).astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, axes=("embed",), offset: float = 0.0):
        self.eps, self.offset = eps, offset
        self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=axes)

    def __call__(self, x):
        x32 = x.astype(_F32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:   # Gemma's order: scale by offset + weight in float32, then cast
            return (y * (self.offset + self.scale[...].astype(_F32))).astype(x.dtype)
        # Llama's order: normalise in float32, cast, then scale.
        return y.astype(x.dtype) * self.scale[...].astype(x.dtype)


def _matrix(module, name: str, shape, axes, dtype, rngs, quantized: bool) -> None:
    """Adds the weight `name` (random, std 1/sqrt(fan_in)) to `module`, with its `<name>_scale` (None
    unless `quantized`: then int8 zeros and unit scales, whose values `quant` or the loaders give)."""
    in_axes = quant.BLOCK_MATRICES.get(name, 1)
    w = _normal(rngs.params(), shape, math.prod(shape[-in_axes:]) ** -0.5, dtype)
    scale = None
    if quantized:
        w = jnp.zeros(shape, jnp.int8)
        scale = nnx.Param(jnp.ones(shape[:-in_axes], jnp.float32), axes=axes[:-in_axes])
    setattr(module, name, nnx.Param(w, axes=axes))
    setattr(module, quant.scale_name(name), scale)


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """The rotary embedding's inverse frequencies [h/2] (float32, as transformers computes them),
    rescaled per `scaling` ("linear": divided by the factor; "llama3": long wavelengths divided by
    the factor, short ones kept, those between interpolated; "freq_factors": each divided by its
    own factor)."""
    inv_freq = (1.0 / theta ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim)).astype(np.float32)
    kind = (scaling or {}).get("rope_type")
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "freq_factors":
        return (inv_freq / np.asarray(scaling["factors"], np.float32)).astype(np.float32)
    if kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled).astype(np.float32)
    return inv_freq


def rotary(x_mah, pos_m, theta: float, scaling: tuple | None = None):
    """Rotary embedding in the rotate-half layout, for x of shape [m, heads, h] at positions pos_m
    (`scaling`: `ModelConfig.rope_scaling`)."""
    half = x_mah.shape[-1] // 2
    inv_freq = rope_frequencies(2 * half, theta, dict(scaling) if scaling else None)
    angles = pos_m.astype(_F32)[:, None, None] * inv_freq  # [m, 1, h/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x_mah[..., :half].astype(_F32), x_mah[..., half:].astype(_F32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_mah.dtype)


class Block(nnx.Module):
    """One pre-norm decoder block: attention with GQA and RoPE, then a SwiGLU MLP, split at attention
    so the caller decides where keys and values come from and in which layout attention runs."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, quantized: bool = False, layer: int = 0):
        d, n, k = config.hidden_size, config.num_heads, config.num_kv_heads
        h, f = config.resolved_head_dim, config.intermediate_size
        self.theta, self.rope_scaling = config.layer_rope(layer)
        scalar = config.query_pre_attn_scalar
        self.attention = Options(window=config.layer_window(layer), softcap=config.attn_softcap,
                                 scale=None if scalar is None else float(scalar) ** -0.5)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.head_dim = h
        norm = functools.partial(RMSNorm, eps=config.rms_norm_eps, dtype=dtype, offset=config.norm_offset)
        self.attn_norm = norm(d)
        # Per kv head: its g query heads (query head kv * g + j, as `attention._grouped` pairs them), key, value.
        qkv_shape, qkv_axes = (k, n // k + 2, h), ("kv_heads", "fused", "head_dim")
        _matrix(self, "qkv_kxhd", (*qkv_shape, d), (*qkv_axes, "embed"), dtype, rngs, quantized)
        self.qkv_bias_kxh = nnx.Param(_normal(rngs.params(), qkv_shape, 0.1, dtype), axes=qkv_axes) \
            if config.attention_bias else None
        self.q_norm = norm(h, axes=("head_dim",)) if config.qk_norm else None
        self.k_norm = norm(h, axes=("head_dim",)) if config.qk_norm else None
        _matrix(self, "o_dnh", (d, n, h), ("embed", "heads", "head_dim"), dtype, rngs, quantized)
        self.mlp_norm = norm(d)
        self.post_attn_norm, self.post_mlp_norm = (norm(d), norm(d)) if config.post_norms else (None, None)
        _matrix(self, "gate_up_fxd", (f, 2, d), ("mlp", "fused", "embed"), dtype, rngs, quantized)
        _matrix(self, "down_df", (d, f), ("embed", "mlp"), dtype, rngs, quantized)

    def _mm(self, x_mi, name: str):
        """x [m, i] through the matrix `name` (int8 or float) -> [m, o]."""
        scale = getattr(self, quant.scale_name(name))
        with jax.named_scope(name):   # names the kernels in profiles (`jaxspec.tools.profiling`)
            return quant.matmul(x_mi, getattr(self, name)[...], None if scale is None else scale[...],
                                quant.BLOCK_MATRICES[name])

    def qkv(self, x_md, pos_m):
        """Queries, keys and values (rotated) of m tokens at positions pos_m, from one dot over a flat
        [m, d] buffer (XLA's CPU dot is slower on the equivalent multi-axis einsums)."""
        m, kv = x_md.shape[0], self.qkv_kxhd.shape[0]
        qkv = self._mm(self.attn_norm(x_md), "qkv_kxhd").reshape(m, kv, -1, self.head_dim)
        qkv = qkv if self.qkv_bias_kxh is None else qkv + self.qkv_bias_kxh[...]   # Qwen2's biases, fused alike
        q, k, v = qkv[:, :, :-2].reshape(m, -1, self.head_dim), qkv[:, :, -2], qkv[:, :, -1]
        if self.q_norm is not None:   # Qwen3: each head normalised before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        return rotary(q, pos_m, self.theta, self.rope_scaling), rotary(k, pos_m, self.theta, self.rope_scaling), v

    def finish(self, x_md, attn_mnh):
        """Output projection, residual, and the MLP half of the block."""
        out = self._mm(attn_mnh.reshape(x_md.shape[0], -1), "o_dnh")
        x = x_md + (out if self.post_attn_norm is None else self.post_attn_norm(out))
        y = self.mlp_norm(x)
        gate, up = jnp.unstack(self._mm(y, "gate_up_fxd").reshape(x.shape[0], -1, 2), axis=-1)
        hidden = (jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)) * up
        out = self._mm(hidden, "down_df")
        return x + (out if self.post_mlp_norm is None else self.post_mlp_norm(out))


class Decoder(nnx.Module):
    """Token embedding, a stack of blocks, final norm and LM head (tied or not)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, quantized: bool = False):
        d, v = config.hidden_size, config.vocab_size
        self.config = config
        # Embedding std 1/sqrt(d) keeps tied random models' logits at unit scale, so their
        # argmax is well separated (tests compare greedy paths token for token).
        self.embed_vd = nnx.Param(_normal(rngs.params(), (v, d), d ** -0.5, dtype), axes=("vocab", "embed"))
        self.layers = nnx.List([Block(config, dtype=dtype, rngs=rngs, quantized=quantized, layer=i)
                                for i in range(config.num_layers)])
        self.final_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, offset=config.norm_offset)
        if config.tie_word_embeddings:
            self.lm_head_vd = self.lm_head_vd_scale = None
        else:
            _matrix(self, "lm_head_vd", (v, d), ("vocab", "embed"), dtype, rngs, quantized)

    def embed(self, tokens):
        x = jnp.take(self.embed_vd[...], tokens, axis=0)
        if self.config.embed_scale:   # Gemma: by sqrt(d), rounded to the compute dtype first
            return x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        return x

    def head(self, x_md, ids=None):
        """Final norm and LM head of flat tokens [m, d] (any leading axes); logits in float32, of
        the vocabulary or of the token ids `ids` only."""
        lead, d = x_md.shape[:-1], x_md.shape[-1]
        with jax.named_scope("lm_head"):
            y = self.final_norm(x_md.reshape(-1, d))
            head = self.embed_vd if self.lm_head_vd is None else self.lm_head_vd
            scale = None if self.lm_head_vd_scale is None else self.lm_head_vd_scale[...]
            if ids is not None:
                head, scale = jnp.take(head[...], ids, axis=0), None if scale is None else jnp.take(scale, ids)
            # w [v, d] . y [m, d] -> [v, m], transposed: the weight read once for all rows (`quant.matmul`).
            logits = jax.lax.dot_general(head[...].astype(y.dtype), y, (((1,), (1,)), ((), ())),
                                         preferred_element_type=_F32).T
            logits = logits if scale is None else logits * scale
            cap = self.config.final_softcap
            if cap is not None:
                logits = cap * jnp.tanh(logits / cap)
            return logits.reshape(*lead, -1)

    def _run_blocks(self, x_md, body, features=()):
        """Runs `body(block, x_md, i)` -> (x_md, out) over the blocks; returns the last x_md, the outs,
        and the residual entering each `features` layer, concatenated ([m, f], an EAGLE-3 head's input)."""
        captured, outputs = [], []
        for i, block in enumerate(self.layers):
            captured += [x_md] * features.count(i)
            x_md, out = body(block, x_md, i)
            outputs.append(out)
        return x_md, outputs, (jnp.concatenate(captured, axis=-1) if features else None)

    def hidden_uncached(self, tokens_bt, features=()):
        """Final hidden states of whole sequences from position 0, and the features [b, t, f] or None."""
        b, t = tokens_bt.shape
        pos_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

        def body(block, x_md, i):
            q, k, v = (a.reshape(b, t, *a.shape[1:]) for a in block.qkv(x_md, pos_bt.reshape(-1)))
            attn = attend(q, k, v, pos_bt, pos_bt, block.attention)
            return block.finish(x_md, attn.reshape(b * t, *attn.shape[2:])), None

        x_md, _, feats = self._run_blocks(self.embed(tokens_bt.reshape(-1)), body, features)
        return x_md.reshape(b, t, -1), _rows(feats, b)

    def hidden_cached(self, tokens_bt, cache: KVCache, empty: bool = False, features=()):
        """Final hidden states of t new tokens per row, the cache with their keys and values written
        at slots lengths[b] + t (`lengths` unchanged), and the `features` layers' inputs or None.
        `empty` (static, a prefill): the tokens attend to each other only, not to the whole buffer."""
        b, t = tokens_bt.shape
        pos_bt = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
        rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))

        def body(block, x_md, i):
            q, k, v = (a.reshape(b, t, *a.shape[1:]) for a in block.qkv(x_md, pos_bt.reshape(-1)))
            # mode="drop": a write past the buffer is discarded instead of clamped onto live slots.
            k_layer = cache.k[i].at[rows_bt, pos_bt].set(k.astype(cache.k[i].dtype), mode="drop")
            v_layer = cache.v[i].at[rows_bt, pos_bt].set(v.astype(cache.v[i].dtype), mode="drop")
            if empty:   # the slots at and past t hold nothing a query here may see
                attn = attend(q, k.astype(k_layer.dtype).astype(q.dtype), v.astype(v_layer.dtype).astype(q.dtype),
                              pos_bt, pos_bt, block.attention)
            else:
                attn = attend_cache(q, k_layer, v_layer, pos_bt, jnp.minimum(cache.lengths + t, cache.max_len),
                                    block.attention)
            return block.finish(x_md, attn.reshape(b * t, *attn.shape[2:])), (k_layer, v_layer)

        x_md, kv, feats = self._run_blocks(self.embed(tokens_bt.reshape(-1)), body, features)
        ks, vs = zip(*kv)
        return x_md.reshape(b, t, -1), cache.replace(k=ks, v=vs), _rows(feats, b)

    def hidden_packed(self, tokens_m, row_m, col_m, cache: KVCache, width: int, features=(), tree=None):
        """`hidden_cached` of ragged windows packed flat: token m is column col_m (`width`: unused) of
        row row_m's window, at slot lengths[row] + col; only attention runs in the [b, width] layout."""
        b = cache.batch
        used_m = col_m < width
        read_col_m = jnp.minimum(col_m, width - 1)
        write_at_m = jnp.where(used_m, cache.lengths[row_m] + col_m, cache.max_len)   # past the buffer: dropped
        offset_bw = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width)) if tree is None else tree[0]
        pos_m = cache.lengths[row_m] + offset_bw[row_m, read_col_m]
        q_pos_bw = cache.lengths[:, None] + offset_bw
        live_b = jnp.minimum(cache.lengths + width, cache.max_len)
        attend_tree = None if tree is None else (cache.lengths, tree[1])

        def body(block, x_md, i):
            q_mnh, k_mkh, v_mkh = block.qkv(x_md, pos_m)
            k_layer = cache.k[i].at[row_m, write_at_m].set(k_mkh.astype(cache.k[i].dtype), mode="drop")
            v_layer = cache.v[i].at[row_m, write_at_m].set(v_mkh.astype(cache.v[i].dtype), mode="drop")
            q_bwnh = jnp.zeros((b, width) + q_mnh.shape[1:], q_mnh.dtype).at[row_m, col_m].set(q_mnh, mode="drop")
            attn_bwnh = attend_cache(q_bwnh, k_layer, v_layer, q_pos_bw, live_b, block.attention, attend_tree)
            return block.finish(x_md, attn_bwnh[row_m, read_col_m]), (k_layer, v_layer)

        x_md, kv, feats = self._run_blocks(self.embed(tokens_m), body, features)
        ks, vs = zip(*kv)
        return x_md, cache.replace(k=ks, v=vs), feats


def _rows(x_mf, b: int):
    """[b * t, f] -> [b, t, f] (None stays None)."""
    return None if x_mf is None else x_mf.reshape(b, -1, x_mf.shape[-1])
