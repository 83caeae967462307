"""`jaxspec.Model`: a decoder's structure, its weights as a pytree, its config and tokenizer. Compiled
functions take the parameters as a traced argument and `nnx.merge` them with the static graph
definition inside the trace, so one compilation serves any weights of the same shapes.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import graphlib

from jaxspec.models import quant
from jaxspec.models.cache import KVCache
from jaxspec.models.config import ModelConfig
from jaxspec.models.convert import unfuse_layers
from jaxspec.models.decoder import Decoder

CHECKPOINT_FORMAT = 2                  # the version `Model.save` writes and `jaxspec.load` reads
CHECKPOINT_MANIFEST = "jaxspec.json"   # the checkpoint folder's manifest

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype) -> jnp.dtype:
    """"float32" / "bfloat16" / a numpy dtype -> a jnp dtype; ValueError otherwise."""
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return jnp.dtype(_DTYPES[name])


class _GraphDef(graphlib.GraphDef):
    """An nnx GraphDef that computes its hash once: it is a static argument of every compiled
    function, so jit hashes it on each call, and flax's hash walks the whole module structure."""

    __slots__ = ("_hash",)

    def __hash__(self) -> int:
        if not hasattr(self, "_hash"):
            object.__setattr__(self, "_hash", graphlib.GraphDef.__hash__(self))
        return self._hash


jax.tree_util.register_static(_GraphDef)


def _abstract_decoder(config: ModelConfig, dtype, quantize: str | None = None) -> Decoder:
    return nnx.eval_shape(lambda: Decoder(config, dtype=dtype, rngs=nnx.Rngs(0), quantized=quantize == "int8"))


def _logical_axes(state) -> dict:
    """Pure dict, parallel to the params, of each weight's logical axis names."""
    if isinstance(state, nnx.Variable):
        return tuple(state.get_metadata().get("axes", ()))
    return {key: _logical_axes(child) for key, child in state.items()}


@functools.partial(jax.jit, static_argnums=0)
def _logits_uncached(graphdef, params, tokens_bt):
    decoder = nnx.merge(graphdef, params)
    return decoder.head(decoder.hidden_uncached(tokens_bt)[0])


def forward(graphdef, params, tokens_bt, cache: KVCache, logits_at_bm=None, empty: bool = False, features=()):
    """Runs tokens_bt [b, t] through the cache at positions cache.lengths[b] + t (lengths are not
    advanced: `cache.commit`); returns (float32 logits, cache), and with `features` (static layer
    indices: an EAGLE-3 head's) also the residual stream entering those layers ([b, t, f]).
    `logits_at_bm` [b, m]: the LM head runs at these token indices only. `empty` (static): the cache
    holds nothing yet, so attention runs over the new tokens only (`Decoder.hidden_cached`)."""
    decoder = nnx.merge(graphdef, params)
    hidden_btd, cache, features_btf = decoder.hidden_cached(tokens_bt, cache, empty, features)
    if logits_at_bm is not None:
        hidden_btd = jnp.take_along_axis(hidden_btd, logits_at_bm[:, :, None], axis=1)
    if features:
        return decoder.head(hidden_btd), cache, features_btf
    return decoder.head(hidden_btd), cache


def forward_packed(graphdef, params, window_bw, counts_b, cache: KVCache, packed_len: int, features=(), tree=None):
    """`forward` of the first `counts_b` tokens of each row's window_bw [b, w] (written at slots
    cache.lengths[b] + j), laid end to end in a buffer of `packed_len` (static) slots, so the
    token-wise work costs packed_len tokens however the windows are shaped. Logits (and features)
    come back padded, [b, w, ...]; unused columns hold nothing meaningful. tree: None (a chain), or
    (depth_bw, ancestor_bww) with counts_b the used columns, bool [b, w] (closed under ancestors):
    column j sits at position lengths + depth_bw[b, j] and sees the committed cache and the columns
    ancestor_bww[b, j] marks (column 0, depth 0, is the root).
    """
    b, w = window_bw.shape
    col_w = jnp.arange(w, dtype=jnp.int32)
    used_bw = counts_b if tree is not None else col_w[None, :] < counts_b[:, None]
    index_bw = jnp.where(used_bw, jnp.cumsum(used_bw.reshape(-1)).reshape(b, w) - 1, packed_len)
    tokens_m = jnp.zeros((packed_len,), jnp.int32).at[index_bw].set(window_bw, mode="drop")
    row_m = jnp.zeros((packed_len,), jnp.int32).at[index_bw].set(jnp.arange(b, dtype=jnp.int32)[:, None], mode="drop")
    col_m = jnp.full((packed_len,), w, jnp.int32).at[index_bw].set(col_w, mode="drop")
    decoder = nnx.merge(graphdef, params)
    hidden_md, cache, features_mf = decoder.hidden_packed(tokens_m, row_m, col_m, cache, w, features, tree)
    logits_mv = decoder.head(hidden_md)
    unpack_bw = jnp.minimum(index_bw, packed_len - 1)
    if features:
        return logits_mv[unpack_bw], cache, features_mf[unpack_bw]
    return logits_mv[unpack_bw], cache


def init_cache(graphdef, params, batch: int, max_len: int) -> KVCache:
    """An empty cache for this decoder (usable inside a trace)."""
    decoder = nnx.merge(graphdef, params)
    return KVCache.init(decoder.config, batch, max_len, decoder.embed_vd[...].dtype)


class Model:
    """A decoder-only language model ready for jaxspec's compiled loops: its `config`, `params` (a
    nested dict of jax.Arrays, one entry per block under "layers"), `tokenizer` (transformers', or
    None), `dtype` (the compute dtype, and the storage dtype of every weight not quantized),
    `quantization` (None or "int8": `Model.quantize`) and `logical_axes` (parallel to `params`)."""

    def __init__(self, config: ModelConfig, params: dict, *, dtype="float32", tokenizer=None,
                 quantization: str | None = None):
        self.config = config
        self.dtype = resolve_dtype(dtype)
        self.quantization = quant.check_method(quantization)
        graphdef, abstract_state = nnx.split(_abstract_decoder(config, self.dtype, self.quantization))
        self.graphdef = _GraphDef(nodes=graphdef.nodes, attributes=graphdef.attributes, num_leaves=graphdef.num_leaves)
        self.logical_axes = _logical_axes(abstract_state)
        _check_same_structure(nnx.to_pure_dict(abstract_state), params)
        self.params = params
        self.tokenizer = tokenizer

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, dtype="float32") -> Model:
        """A model with random weights (scaled so logits are O(1)), for tests and benchmarks."""
        dtype = resolve_dtype(dtype)
        # Built eagerly: each weight is one small random op, compiled once per distinct shape,
        # which is far quicker than compiling the whole initialiser as one program.
        decoder = Decoder(config, dtype=dtype, rngs=nnx.Rngs(seed))
        return cls(config, nnx.to_pure_dict(nnx.state(decoder)), dtype=dtype)

    def __repr__(self):
        tok = type(self.tokenizer).__name__ if self.tokenizer is not None else None
        q = f", quantization={self.quantization!r}" if self.quantization else ""
        return (f"Model({self.config.name!r}, layers={self.config.num_layers}, "
                f"params={self.config.num_params / 1e6:.1f}M, dtype={self.dtype.name}{q}, tokenizer={tok})")

    def quantize(self, method: str = "int8") -> Model:
        """This model with weight-only quantized matrices (`jaxspec.models.quant`); the embedding
        and norms stay in `dtype`, and so does the compute."""
        if quant.check_method(method) is None:
            raise ValueError("quantize: method must be one of " + str(list(quant.METHODS)))
        if self.quantization is not None:
            raise ValueError(f"this model is already quantized ({self.quantization!r})")
        return Model(self.config, quant.quantize_params(self.params), dtype=self.dtype, tokenizer=self.tokenizer,
                     quantization=method)

    def forward(self, params, tokens_bt, cache: KVCache, logits_at_bm=None, empty: bool = False):
        """`forward` with this model's structure; the params are an explicit (traced) argument."""
        return forward(self.graphdef, params, tokens_bt, cache, logits_at_bm, empty)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.init(self.config, batch, max_len, self.dtype)

    def logits(self, tokens) -> jax.Array:
        """Full forward without a cache: int [B, T] -> float32 logits [B, T, V]."""
        tokens_bt = np.asarray(tokens)
        if tokens_bt.ndim != 2 or tokens_bt.shape[1] < 1:
            raise ValueError(f"tokens must be a non-empty int array of shape [B, T], got shape {tokens_bt.shape}")
        if not np.issubdtype(tokens_bt.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got dtype {tokens_bt.dtype}")
        vocab = self.config.vocab_size
        if tokens_bt.size and (tokens_bt.min() < 0 or tokens_bt.max() >= vocab):
            bad = int(tokens_bt.min()) if tokens_bt.min() < 0 else int(tokens_bt.max())
            raise ValueError(f"tokens contains token id {bad}, outside [0, {vocab}) (vocab_size={vocab})")
        if tokens_bt.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"tokens has {tokens_bt.shape[1]} positions, more than "
                             f"max_position_embeddings={self.config.max_position_embeddings}")
        return _logits_uncached(self.graphdef, self.params, jnp.asarray(tokens_bt, jnp.int32))

    def save(self, path) -> None:
        """Writes an orbax checkpoint of the params (q/k/v and gate/up apart, as in checkpoints of
        every kind: `convert.unfuse_layers`), the config, and the tokenizer if any (read back by `jaxspec.load`)."""
        import orbax.checkpoint as ocp
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        params_dir = path / "params"
        if params_dir.exists():
            shutil.rmtree(params_dir)
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(params_dir, unfuse_layers(self.params))
            ckpt.wait_until_finished()
        manifest = {"format": CHECKPOINT_FORMAT, "dtype": self.dtype.name, "config": self.config.to_dict(),
                    "quantization": self.quantization}
        (path / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(path / "tokenizer"))


def _check_same_structure(expected: Any, got: Any, path: str = "") -> None:
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            raise ValueError(f"params{path}: expected a dict, got {type(got).__name__}")
        missing = sorted(set(map(str, expected)) - set(map(str, got)))
        unexpected = sorted(set(map(str, got)) - set(map(str, expected)))
        if missing or unexpected:
            raise ValueError(f"params{path}: missing {missing}, unexpected {unexpected}")
        for key in expected:
            _check_same_structure(expected[key], got[key], f"{path}.{key}")
        return
    if tuple(expected.shape) != tuple(np.shape(got)):
        raise ValueError(f"params{path}: expected shape {tuple(expected.shape)}, got {tuple(np.shape(got))}")
    if (expected.dtype == jnp.int8) != (np.dtype(getattr(got, "dtype", np.float32)) == np.int8):
        raise ValueError(f"params{path}: expected dtype {expected.dtype}, got {got.dtype}")
