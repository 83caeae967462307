"""Weight-only int8 quantization with one scale per output channel.

A quantized matrix is int8 values and float32 scales over its output axes (max |w| over the input
axes / 127). Every matrix of the blocks and an untied LM head is quantized; the embedding stays in
the compute dtype (a step gathers only b rows of it, and EAGLE-3 heads share it).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

METHODS = ("int8",)

# Quantized weight -> how many of its trailing axes are input axes: the fused ones blocks run, and the separate
# ones checkpoints hold (loaders quantize them; per-channel scales fuse to the same bits).
BLOCK_MATRICES = {"qkv_kxhd": 1, "o_dnh": 2, "gate_up_fxd": 1, "down_df": 1,
                  "q_nhd": 1, "k_khd": 1, "v_khd": 1, "gate_fd": 1, "up_fd": 1}
HEAD_MATRIX = ("lm_head_vd", 1)


def check_method(quantize) -> str | None:
    if quantize is not None and quantize not in METHODS:
        raise ValueError(f"quantize must be None or one of {list(METHODS)}, got {quantize!r}")
    return quantize


def scale_name(name: str) -> str:
    return f"{name}_scale"


def quantize_array(w, in_axes: int) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values, float32 scales over the output axes) of one float matrix, computed on the
    host in numpy (so every path that quantizes a weight gets the same bits)."""
    w32 = np.asarray(w, np.float32)
    absmax = np.max(np.abs(w32), axis=tuple(range(w32.ndim - in_axes, w32.ndim)), keepdims=True)
    scale = np.where(absmax > 0, absmax / np.float32(127), np.float32(1)).astype(np.float32)
    return np.clip(np.rint(w32 / scale), -127, 127).astype(np.int8), scale.reshape(w32.shape[:-in_axes])


def quantized_leaf(path: tuple) -> int | None:
    """Input-axis count of the weight at this params path if int8 quantizes it, else None."""
    if len(path) == 3 and path[0] == "layers":
        return BLOCK_MATRICES.get(path[-1])
    return HEAD_MATRIX[1] if path == (HEAD_MATRIX[0],) else None


def quantize_params(params: dict) -> dict:
    """A float decoder's params with every quantizable matrix replaced by int8 values and its
    `<name>_scale` entry added (`Model.quantize`)."""
    def pair(path, x):
        in_axes = quantized_leaf(tuple(key.key for key in path))
        return x if in_axes is None else tuple(jnp.asarray(a) for a in quantize_array(x, in_axes))
    return split_pairs(jax.tree_util.tree_map_with_path(pair, params))


def split_pairs(params: dict) -> dict:
    """Params whose quantized leaves were built as (values, scales) pairs -> `<name>_scale`
    entries (the loaders quantize leaf by leaf, so no float copy of the model exists)."""
    out = {}
    for key, child in params.items():
        if isinstance(child, tuple):
            out[key], out[scale_name(key)] = child
        else:
            out[key] = split_pairs(child) if isinstance(child, dict) else child
    return out


def matmul(x_mi, w, scale, in_axes: int = 1):
    """x [m, i] times the weight w [out axes..., in axes...] -> [m, o] in x's dtype (an int8 w's
    output scaled by `scale` in float32). The dot is w . x -> [o, m], transposed after: XLA's CPU
    kernels then read each weight row once for all m rows (as x . w, four rows cost up to four)."""
    w_oi = w.reshape(-1, math.prod(w.shape[w.ndim - in_axes:]))
    dims = (((1,), (1,)), ((), ()))
    if scale is None:
        return jax.lax.dot_general(w_oi, x_mi, dims).T
    y = jax.lax.dot_general(w_oi.astype(x_mi.dtype), x_mi, dims, preferred_element_type=jnp.float32).T
    return (y * scale.reshape(-1)).astype(x_mi.dtype)


def cast_floats(params: dict, dtype) -> dict:
    """Params in another compute dtype: int8 values and float32 scales stay as they are."""
    def cast(path, x):
        return x if x.dtype == jnp.int8 or path[-1].key.endswith("_scale") else x.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, params)
