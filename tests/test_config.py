import jax
import pytest
from flax import nnx

import jaxspec
from jaxspec.models.decoder import Decoder
from jaxspec.models.loading import read_gguf


@pytest.mark.parametrize("name, published", [
    ("smollm2-135m", 134.5e6), ("qwen2.5-0.5b", 494.0e6), ("qwen2.5-1.5b", 1543.7e6), ("qwen3-8b", 8190.7e6),
    ("llama3.2-1b", 1235.8e6), ("llama3.1-8b", 8030.3e6), ("mistral-7b", 7248.0e6)])
def test_full_size_presets_build_with_published_parameter_counts(name, published):
    cfg = jaxspec.ModelConfig.preset(name)
    # eval_shape builds the full-size model without allocating it.
    state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    counted = sum(x.size for x in jax.tree.leaves(state))
    assert counted == cfg.num_params
    assert abs(counted - published) / published < 0.002


def test_from_hf_config_reads_transformers_configs():
    from transformers import LlamaConfig, Qwen2Config
    llama = LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                        rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    cfg = jaxspec.ModelConfig.from_hf_config(llama.to_dict())
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.max_position_embeddings) == (100, 32, 3, 4, 2, 64, 128)
    assert cfg.rope_theta == 5000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.architecture == "llama"
    qwen = Qwen2Config(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    cfg = jaxspec.ModelConfig.from_hf_config(qwen.to_dict())
    assert cfg.attention_bias and cfg.architecture == "qwen2"
    # and back: our HF dict builds the same transformers config
    again = jaxspec.ModelConfig.from_hf_config(cfg.to_hf_config())
    assert again.replace(name=cfg.name) == cfg


def test_from_gguf_metadata_of_smollm2_matches_preset(smollm2_path):
    metadata, tensors = read_gguf(smollm2_path)
    cfg = jaxspec.ModelConfig.from_gguf_metadata(metadata, tensors.keys())
    preset = jaxspec.ModelConfig.preset("smollm2-135m")
    assert cfg.replace(name=preset.name, rms_norm_eps=preset.rms_norm_eps) == preset
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-10


def test_config_is_frozen_and_keyword_only():
    cfg = jaxspec.ModelConfig.preset("tiny")
    with pytest.raises(Exception):
        cfg.hidden_size = 3
    with pytest.raises(TypeError):
        jaxspec.ModelConfig(10, 8, 1, 2, 2, 16, 32)


@pytest.mark.parametrize("changes, needle", [
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(hidden_size=65), "divisible"),
    (dict(architecture="gpt2"), "gpt2"),
])
def test_bad_configs_are_rejected_by_name(changes, needle):
    with pytest.raises(ValueError, match=needle):
        jaxspec.ModelConfig.preset("tiny").replace(**changes)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="smollm2-135m"):
        jaxspec.ModelConfig.preset("gpt-5")


def test_unsupported_hf_architecture_names_itself():
    with pytest.raises(ValueError, match="'gpt_neox'.*supported: llama, mistral, qwen2, qwen3, gemma2"):
        jaxspec.ModelConfig.from_hf_config({"model_type": "gpt_neox"})
