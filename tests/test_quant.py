"""Weight-only int8: the rounding per output channel, the model it defines, lossless decoding with
int8 targets and drafts (one device and a tensor-parallel mesh), loading and saving; and the
attention paths (SDPA, cuDNN's interface on GPUs; blocks up to the live length) against the plain one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import is_sharded, random_prompts
from test_loading import write_hf_folder

import jaxspec
from jaxspec.models import quant
from jaxspec.tools.benchmarking import layer_skip_pair

CFG = jaxspec.ModelConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4,
                          intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=False,
                          attention_bias=True, name="quant-test")
BUDGETS = [12, 30, 5, 21]


def reference_quantize(w: np.ndarray, in_axes: int):
    """Channel by channel, the textbook symmetric rule: scale = max |w| / 127, q = round(w / scale);
    matrices are [out axes..., in axes...]."""
    flat = w.reshape(-1, int(np.prod(w.shape[-in_axes:])))
    q, s = np.zeros(flat.shape, np.int8), np.zeros(flat.shape[0], np.float32)
    for c in range(flat.shape[0]):
        s[c] = np.abs(flat[c]).max() / 127.0
        q[c] = np.rint(flat[c] / s[c])
    return q.reshape(w.shape), s.reshape(w.shape[:-in_axes])


@pytest.mark.parametrize("shape, in_axes", [((48, 4, 8), 1), ((4, 8, 48), 2), ((48, 96), 1)])
def test_quantize_array_matches_per_channel_rounding(shape, in_axes):
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    want_q, want_s = reference_quantize(w, in_axes)
    for impl in (np.asarray, jnp.asarray):   # the loaders quantize numpy, Model.quantize jax arrays
        q, s = quant.quantize_array(impl(w), in_axes)
        np.testing.assert_array_equal(np.asarray(q), want_q)
        np.testing.assert_array_equal(np.asarray(s), want_s)   # the same float32 division: bit-exact
    # Round to nearest: off by at most half a step, plus the float32 rounding of the product.
    step = want_s.reshape(want_s.shape + (1,) * in_axes)
    err = np.abs(want_q * step - w)
    assert (err <= step / 2 + np.finfo(np.float32).eps * np.abs(w)).all()


def dequantized(model):
    """The float model whose weights are the int8 model's values times their scales."""
    def walk(node):
        out = {}
        for key, child in node.items():
            if isinstance(child, dict):
                out[key] = walk(child)
            elif not str(key).endswith("_scale"):
                scale = node.get(quant.scale_name(key)) if isinstance(key, str) else None
                out[key] = child if scale is None else np.asarray(child, np.float32) * np.asarray(scale).reshape(
                    scale.shape + (1,) * (child.ndim - scale.ndim))   # scales over the leading (output) axes
        return out
    return jaxspec.Model(model.config, jax.tree.map(jnp.asarray, walk(model.params)))


@pytest.mark.parametrize("tie", [False, True])
def test_int8_model_computes_with_its_dequantized_weights(tie):
    model = jaxspec.Model.random(CFG.replace(tie_word_embeddings=tie), seed=3)
    q = model.quantize("int8")
    layer = q.params["layers"][0]
    assert layer["qkv_kxhd"].dtype == jnp.int8 and layer["qkv_kxhd_scale"].shape == (4, 4, 8)   # kv, g + 2, h
    assert layer["gate_up_fxd_scale"].shape == (128, 2) and layer["qkv_bias_kxh"].dtype == jnp.float32
    assert layer["o_dnh_scale"].shape == (64,) and q.params["embed_vd"].dtype == jnp.float32
    assert ("lm_head_vd_scale" in q.params) == (not tie)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
    ref = dequantized(q)
    # Measured 4.3e-6 apart (float32 rounding of the scaled outputs) on logits <= 4.1; scales
    # rounded to bfloat16 move them by 0.04.
    np.testing.assert_allclose(np.asarray(q.logits(tokens)), np.asarray(ref.logits(tokens)), rtol=0, atol=2e-5)
    # ... and it is still the model: per-channel int8 of these random weights moves the logits by
    # 0.026 relative L2 (0.022-0.026 over six seeds); rounding down instead of to nearest gives 0.063.
    full = np.asarray(model.logits(tokens))
    assert np.linalg.norm(np.asarray(q.logits(tokens)) - full) / np.linalg.norm(full) < 0.04
    prompts = random_prompts(np.random.default_rng(1), [5, 9], 256)
    assert jaxspec.generate(q, prompts, max_new_tokens=16).tokens == \
        jaxspec.generate(ref, prompts, max_new_tokens=16).tokens


@pytest.fixture(scope="module")
def int8_pair():
    target, draft = layer_skip_pair(CFG, draft_layers=2, damping=0.3)
    return target.quantize("int8"), draft.quantize("int8")


@pytest.mark.parametrize("mode", ["standard", "tetris", "tp2"])
def test_int8_speculative_greedy_equals_int8_target(int8_pair, mode):
    target, draft = int8_pair
    prompts = random_prompts(np.random.default_rng(2), [7, 3, 12, 5], CFG.vocab_size)
    want = jaxspec.generate(target, prompts, max_new_tokens=BUDGETS).tokens
    spec = jaxspec.SpecConfig(k=3, selection="tetris" if mode == "tetris" else "standard",
                              extra=2 if mode == "tetris" else 0)
    mesh = jaxspec.MeshConfig(target_tp=2, draft_tp=0) if mode == "tp2" else None
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec, mesh=mesh)
    result = decoder.generate(prompts, max_new_tokens=BUDGETS)
    assert result.tokens == want
    assert result.stats.accepted_tokens > 0
    if mesh is not None:
        layer = decoder.target.params["layers"][0]
        assert layer["gate_up_fxd"].dtype == jnp.int8
        assert is_sharded(layer["gate_up_fxd"]) and is_sharded(layer["gate_up_fxd_scale"])


def test_int8_loads_tensor_by_tensor_and_round_trips(tmp_path):
    model = jaxspec.Model.random(CFG, seed=4)
    folder = write_hf_folder(tmp_path / "hf", model)
    direct = jaxspec.load(folder, quantize="int8")
    after = jaxspec.load(folder).quantize("int8")
    assert direct.quantization == "int8"
    jax.tree.map(np.testing.assert_array_equal, direct.params, after.params)
    direct.save(tmp_path / "saved")
    again = jaxspec.load(tmp_path / "saved")
    assert again.quantization == "int8" and again.params["layers"][1]["gate_up_fxd"].dtype == jnp.int8
    jax.tree.map(np.testing.assert_array_equal, again.params, direct.params)
    as_bf16 = jaxspec.load(tmp_path / "saved", dtype="bfloat16")
    assert as_bf16.params["layers"][1]["gate_up_fxd"].dtype == jnp.int8
    assert as_bf16.params["layers"][1]["gate_up_fxd_scale"].dtype == jnp.float32
    assert as_bf16.params["embed_vd"].dtype == jnp.bfloat16
    tokens = np.arange(1, 20)[None]
    # bfloat16 compute against float32: measured 0.013 relative L2; the bound of
    # test_model.assert_bfloat16_tracks_float32.
    got, want = np.asarray(as_bf16.logits(tokens)), np.asarray(direct.logits(tokens))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.03


def test_bad_quantization_requests_are_named(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="quantize must be None or one of"):
        tiny_model.quantize("int4")
    with pytest.raises(ValueError, match="quantize must be None or one of"):
        jaxspec.load(write_hf_folder(tmp_path / "hf", tiny_model), quantize="fp8")
    q = tiny_model.quantize("int8")
    with pytest.raises(ValueError, match="already quantized"):
        q.quantize("int8")
    with pytest.raises(ValueError, match="draft is int8-quantized"):
        jaxspec.distill(tiny_model, q, [[1, 2, 3]], steps=1, learning_rate=1e-3)
    with pytest.raises(ValueError, match="target is int8-quantized"):
        jaxspec.draft_from_target(q, 1)


@pytest.fixture
def attention_path(request):
    """An attention path other than the plain reference, compiled fresh and restored after: SDPA
    (`jax.nn.dot_product_attention`'s XLA implementation: the interface, masks and live lengths the
    cuDNN path on GPUs gets), or blocks of 8 cache slots (several per row, the last overlapping)."""
    from jaxspec.models import attention
    jax.clear_caches()
    attention.ATTENTION, attention.BLOCK = request.param, 8
    yield request.param
    attention.ATTENTION, attention.BLOCK = "auto", 128
    jax.clear_caches()


@pytest.mark.parametrize("attention_path, selection", [
    pytest.param("xla", "standard", marks=pytest.mark.slow), ("blocked", "tetris"),   # 17 s (suite time)
    pytest.param("xla", "tetris", marks=pytest.mark.slow),
    pytest.param("blocked", "standard", marks=pytest.mark.slow)], indirect=["attention_path"])
def test_attention_paths_are_lossless(int8_pair, attention_path, selection):
    """Greedy decoding with each attention path equals the plain path's output, for plain decoding
    and for speculative windows (padded and packed verification), with int8 weights."""
    from jaxspec.models import attention
    target, draft = int8_pair
    prompts = random_prompts(np.random.default_rng(5), [9, 4, 15, 6], CFG.vocab_size)
    tokens = np.random.default_rng(6).integers(0, 256, (2, 20))
    got_logits = np.asarray(target.logits(tokens))
    spec = jaxspec.SpecConfig(k=3, selection=selection, extra=2 if selection == "tetris" else 0)
    got_plain = jaxspec.generate(target, prompts, max_new_tokens=BUDGETS).tokens
    got_spec = jaxspec.SpeculativeDecoder(target, draft, spec=spec).generate(prompts, max_new_tokens=BUDGETS)
    attention.ATTENTION = "plain"
    jax.clear_caches()
    want = jaxspec.generate(target, prompts, max_new_tokens=BUDGETS).tokens
    # Uncached logits: blocked runs the plain path (bit-identical); XLA's SDPA was measured 9.6e-6
    # from it on logits <= 15 (a few float32 ulps).
    np.testing.assert_allclose(got_logits, np.asarray(target.logits(tokens)), rtol=0, atol=4e-5)
    assert got_plain == want and got_spec.tokens == want
    assert got_spec.stats.accepted_tokens > 0
