"""The target's features over a corpus, computed once and kept on disk for training EAGLE heads.
Shape key: n sequences, t positions, f fused features, d the target's width.

The target runs once over `tokens` [n, t]; memory-mapped `.npy` files keep `features` [n, t, f]
(the residual entering the chosen layers), `hidden` [n, t, d] (before the final norm) and `choice`
[n, t] (the target's argmax), floats as bfloat16 bits in uint16 (`stored`). `meta.json` records
the rows done after each chunk, so a killed build resumes at the first missing chunk.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxspec.training.loop import params_digest, write_json

FORMAT = 1
CHUNK_ROWS = 8


def stored(bits):
    """A stored float array (uint16 bfloat16 bits) as bfloat16."""
    return jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("graphdef", "layers"))
def _target_pass(graphdef, params, tokens_bt, *, layers):
    decoder = nnx.merge(graphdef, params)
    hidden_btd, features_btf = decoder.hidden_uncached(tokens_bt, layers)
    bits = [jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16) for x in (features_btf, hidden_btd)]
    return bits[0], bits[1], jnp.argmax(decoder.head(hidden_btd), axis=-1).astype(jnp.int32)


def feature_cache(target, layers: tuple[int, ...], tokens, lengths, folder=None, *, batch_size: int = CHUNK_ROWS,
                  progress: bool = True) -> dict[str, np.ndarray]:
    """The arrays of the module docstring for `tokens` [n, t] / `lengths` [n] through `target`
    (a jaxspec.Model) at feature `layers`: memory-mapped from `folder` (reused when made the same
    way, resumed when incomplete, rebuilt when made otherwise), or in memory when folder is None."""
    tokens, lengths = np.asarray(tokens, np.int32), np.asarray(lengths, np.int32)
    (n, t), d = tokens.shape, target.config.hidden_size
    shapes = {"features": ((n, t, len(layers) * d), np.uint16), "hidden": ((n, t, d), np.uint16),
              "choice": ((n, t), np.int32)}
    if folder is None:
        arrays, done = {name: np.zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}, 0
    else:
        settings = {"format": FORMAT, "target": target.config.to_dict(), "params": params_digest(target.params),
                    "layers": list(layers), "data": hashlib.sha256(tokens.tobytes() + lengths.tobytes()).hexdigest()}
        arrays, done = _open(Path(folder), settings, shapes)
    _fill(target, layers, tokens, arrays, done, batch_size, None if folder is None else Path(folder), progress)
    return {"tokens": tokens, "lengths": lengths, **arrays}


def _open(folder: Path, settings: dict, shapes: dict):
    """The folder's arrays and how many rows are done (0 after creating them afresh)."""
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if meta.get("settings") == settings and all((folder / f"{name}.npy").exists() for name in shapes):
        arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r+") for name in shapes}
        return arrays, int(meta["rows_done"])
    folder.mkdir(parents=True, exist_ok=True)
    meta_path.unlink(missing_ok=True)
    arrays = {name: np.lib.format.open_memmap(folder / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)
              for name, (shape, dtype) in shapes.items()}
    write_json(meta_path, {"settings": settings, "rows_done": 0})
    return arrays, 0


def _fill(target, layers, tokens, arrays, done: int, batch_size: int, folder, progress: bool) -> None:
    """Computes rows `done`.. in chunks of `batch_size` (the last chunk padded to that size)."""
    n = len(tokens)
    settings = json.loads((folder / "meta.json").read_text())["settings"] if folder is not None else None
    for start in tqdm(range(done, n, batch_size), desc="target features", disable=not progress or done >= n):
        rows = np.arange(start, min(start + batch_size, n))
        out = _target_pass(target.graphdef, target.params, jnp.asarray(tokens[np.resize(rows, batch_size)]),
                           layers=tuple(layers))
        for name, value in zip(("features", "hidden", "choice"), jax.device_get(out)):
            arrays[name][rows] = value[:len(rows)]
        if folder is not None:
            for array in arrays.values():
                array.flush()
            write_json(folder / "meta.json", {"settings": settings, "rows_done": int(rows[-1]) + 1})
