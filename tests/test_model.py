"""The decoder and its ragged KV cache against the uncached forward (an independent path)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_prompts
from flax import nnx

import jaxspec

# Cached and uncached float32 forwards of the tiny model sum in different orders: measured at
# most 2.9e-6 apart on logits of magnitude <= 3.6 (a few float32 ulps of the largest); the bound is
# about 3.5x that. A KV cache kept in bfloat16 moves them by ~1e-2, an off-by-one mask by ~1.
F32_LOGITS = dict(rtol=0, atol=1e-5)


def naive_greedy(model, prompt, n, width=64):
    """Greedy decoding by re-running the uncached forward on the whole growing sequence.

    The sequence is right-padded to a fixed width (one compilation); causal attention makes the
    logits at position len - 1 independent of the padding after it.
    """
    seq, out = list(prompt), []
    for _ in range(n):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(seq)] = seq
        token = int(np.asarray(model.logits(padded))[0, len(seq) - 1].argmax())
        out.append(token)
        seq.append(token)
    return out


def test_cached_generation_equals_naive_loop_on_ragged_batch(tiny_model):
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, range(1, 21), tiny_model.config.vocab_size)
    result = jaxspec.generate(tiny_model, prompts, max_new_tokens=10)
    for prompt, tokens in zip(prompts, result.tokens):
        assert tokens == naive_greedy(tiny_model, prompt, 10)


def test_multi_token_decode_at_per_row_positions_matches_uncached_logits(tiny_model):
    """Prefill ragged prompts, then feed T = 4 tokens per row at each row's own position."""
    m, rng = tiny_model, np.random.default_rng(1)
    lengths = np.array([3, 9, 1, 14])
    seqs = rng.integers(0, m.config.vocab_size, (4, 20))
    prefill = np.where(np.arange(16)[None] < lengths[:, None], seqs[:, :16], 0)
    cache = m.init_cache(4, 64)
    _, cache = m.forward(m.params, jnp.asarray(prefill), cache)
    cache = cache.commit(jnp.asarray(lengths))
    window = np.stack([seqs[b, lengths[b]:lengths[b] + 4] for b in range(4)])
    logits, _ = m.forward(m.params, jnp.asarray(window), cache)
    for b in range(4):
        full = np.asarray(m.logits(seqs[b:b + 1, :lengths[b] + 4]))[0, lengths[b]:]
        np.testing.assert_allclose(np.asarray(logits[b]), full, **F32_LOGITS)


def brute_attention(q_btnh, k_bskh, v_bskh, q_pos_bt, window=None):
    """Softmax attention query by query, head by head, over the keys at slots <= the query's
    position (slot j holds position j) and, with a window, > position - window; in float64."""
    b, t, n, h = q_btnh.shape
    g = n // k_bskh.shape[2]
    out = np.zeros(q_btnh.shape)
    for i in range(b):
        for j in range(t):
            for head in range(n):
                lo = 0 if window is None else max(0, q_pos_bt[i, j] - window + 1)
                keys = k_bskh[i, lo:q_pos_bt[i, j] + 1, head // g].astype(np.float64)
                w = np.exp(keys @ q_btnh[i, j, head] / np.sqrt(h) - (keys @ q_btnh[i, j, head] / np.sqrt(h)).max())
                out[i, j, head] = (w / w.sum()) @ v_bskh[i, lo:q_pos_bt[i, j] + 1, head // g]
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("impl, block", [("plain", 128), ("blocked", 128), ("blocked", 16), ("blocked", 7),
                                         ("xla", 128)])
def test_attention_over_the_cache_matches_brute_force(impl, block, window, monkeypatch):
    """Each attention path over a cache buffer, with ragged rows (one past every live slot but
    one) and several queries per row; the blocked path at blocks that split the buffer unevenly
    (with a sliding window it starts past the blocks no query reaches)."""
    from jaxspec.models import attention
    monkeypatch.setattr(attention, "ATTENTION", impl)
    monkeypatch.setattr(attention, "BLOCK", block)
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((3, 4, 6, 8), (3, 61, 2, 8), (3, 61, 2, 8)))
    lengths = np.array([0, 20, 57]) if window is None else np.array([40, 20, 57])   # the window: past block 0
    q_pos = lengths[:, None] + np.arange(4)
    got = attention.attend_cache(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_pos),
                                 jnp.asarray(lengths + 4), attention.Options(window=window))
    # Measured at most 3.4e-7 from the float64 reference on outputs <= 1.8 (about 3 float32 ulps).
    np.testing.assert_allclose(np.asarray(got), brute_attention(q, k, v, q_pos, window), rtol=0, atol=1.5e-6)


def _blocked_case(window, tree):
    """attend_cache's arguments: ragged rows (junk past the live slots, the longest row filling all 50) with 4
    queries each, a chain of new tokens or a draft tree (root, two children, a grandchild) at slots base + j."""
    from jaxspec.models import attention
    rng = np.random.default_rng(8)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((3, 4, 6, 8), (3, 50, 2, 8), (3, 50, 2, 8)))
    base = np.array([40, 30, 46])
    ancestor = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    q_pos = base[:, None] + (np.array([0, 1, 1, 2]) if tree else np.arange(4))
    tree = (jnp.asarray(base), jnp.asarray(np.stack([ancestor] * 3))) if tree else None
    return [jnp.asarray(x) for x in (q, k, v, q_pos, base + 4)], dict(opts=attention.Options(window=window), tree=tree)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block", [16, 7])
def test_blocked_attention_under_live_slot_bounds_equals_plain(block, window, tree, monkeypatch):
    """The blocked path's static block count, bounded by exactly the longest live row, by a bucket past the
    buffer or not at all (every block; with a window, from its first block on, so blocks past the buffer's end,
    which must add nothing), equals the plain path. The bound is per thread: another thread's traces see none."""
    import concurrent.futures

    from jaxspec.models import attention
    args, kwargs = _blocked_case(window, tree)
    monkeypatch.setattr(attention, "ATTENTION", "plain")
    want = np.asarray(attention.attend_cache(*args, **kwargs))
    monkeypatch.setattr(attention, "ATTENTION", "blocked")
    monkeypatch.setattr(attention, "BLOCK", block)
    for bound in (50, 64, None):
        with attention.live_slots(bound):
            got = attention.attend_cache(*args, **kwargs)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                assert pool.submit(attention._LIVE_SLOTS.get).result() is None
        # Float32 sums in another order: measured at most 3.6e-7 apart on outputs <= 2.5 (a few ulps).
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1.5e-6)
    assert attention._LIVE_SLOTS.get() is None


@pytest.mark.parametrize("window, tree", [(None, False), (5, True)])
def test_blocked_attention_compiles_to_loops_of_known_trip_count(window, tree, monkeypatch):
    """No loop whose trip count depends on data (XLA's GPU runtime reads such a loop's condition back to the
    host every iteration): one while of ceil(min(bound, 50) / 16) blocks, and no conditional."""
    from jaxspec.models import attention
    monkeypatch.setattr(attention, "ATTENTION", "blocked")
    monkeypatch.setattr(attention, "BLOCK", 16)
    args, kwargs = _blocked_case(window, tree)
    for bound, trips in ((40, 3), (64, 4), (None, 4)):
        with attention.live_slots(bound):
            hlo = jax.jit(lambda *a: attention.attend_cache(*a, **kwargs)).lower(*args).compile().as_text()
        whiles = [line for line in hlo.splitlines() if " while(" in line]
        assert "conditional(" not in hlo and len(whiles) == 1
        assert f'"known_trip_count":{{"n":"{trips}"}}' in whiles[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_into_an_empty_cache_attends_to_the_prompt_only(tiny_model, dtype, monkeypatch):
    """`empty=True` (prefills) attends over the t new tokens instead of the whole buffer: the same
    logits and the same cache as the general path (with plain attention, the same arithmetic), and
    the uncached model's logits."""
    from jaxspec.models import attention
    monkeypatch.setattr(attention, "ATTENTION", "plain")
    jax.clear_caches()   # programs traced with another path would be reused
    m = tiny_model if dtype == "float32" else jaxspec.Model(
        tiny_model.config, jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_model.params), dtype="bfloat16")
    rng = np.random.default_rng(6)
    lengths = np.array([3, 9, 1, 12])
    tokens = np.where(np.arange(12)[None] < lengths[:, None], rng.integers(0, m.config.vocab_size, (4, 12)), 0)
    last = jnp.asarray(lengths - 1)[:, None]
    fast, fast_cache = m.forward(m.params, jnp.asarray(tokens), m.init_cache(4, 80), last, empty=True)
    slow, slow_cache = m.forward(m.params, jnp.asarray(tokens), m.init_cache(4, 80), last)
    # bfloat16: measured bit-identical; float32: 1.4e-6 apart (dots of other shapes), within F32_LOGITS.
    np.testing.assert_allclose(np.asarray(fast), np.asarray(slow), **F32_LOGITS)
    for a, b in zip(jax.tree.leaves(fast_cache), jax.tree.leaves(slow_cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **F32_LOGITS)
    if dtype == "float32":
        for b in range(4):
            full = np.asarray(m.logits(tokens[b:b + 1, :lengths[b]]))[0, -1]
            np.testing.assert_allclose(np.asarray(fast[b, 0]), full, **F32_LOGITS)


def test_rolling_back_is_only_lowering_lengths(tiny_model):
    """Write a window of junk, roll back, write the real tokens: same logits as never writing junk."""
    m, rng = tiny_model, np.random.default_rng(2)
    seq = rng.integers(0, m.config.vocab_size, (2, 12))
    cache = m.init_cache(2, 32)
    _, cache = m.forward(m.params, jnp.asarray(seq[:, :8]), cache)
    cache = cache.commit(jnp.full((2,), 8))
    junk = rng.integers(0, m.config.vocab_size, (2, 5))
    _, dirty = m.forward(m.params, jnp.asarray(junk), cache)
    dirty = dirty.commit(jnp.asarray([9, 8]))  # row 0 keeps one junk token, row 1 none
    tail = np.stack([np.r_[seq[0, 9:12], 0], seq[1, 8:12]])
    logits, _ = m.forward(m.params, jnp.asarray(tail), dirty)
    ref0 = np.asarray(m.logits(np.r_[seq[0, :8], junk[0, :1], seq[0, 9:12]][None]))[0, 9:12]
    ref1 = np.asarray(m.logits(seq[1:2]))[0, 8:12]
    np.testing.assert_allclose(np.asarray(logits[0, :3]), ref0, **F32_LOGITS)
    np.testing.assert_allclose(np.asarray(logits[1]), ref1, **F32_LOGITS)


def test_logits_at_selects_the_same_rows_as_full_logits(tiny_model):
    m = tiny_model
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (3, 7)))
    full, _ = m.forward(m.params, tokens, m.init_cache(3, 16))
    picked, _ = m.forward(m.params, tokens, m.init_cache(3, 16), jnp.asarray([[6], [0], [3]]))
    # Measured bit-identical; 1e-6 (8 float32 ulps) leaves XLA free to fuse the gather differently.
    np.testing.assert_allclose(np.asarray(picked[:, 0]), np.asarray(full)[[0, 1, 2], [6, 0, 3]], rtol=1e-6, atol=0)


def test_fused_projections_are_the_separate_matrices(tiny_model):
    """Blocks run q/k/v and gate/up fused; checkpoints hold them apart. Fusing inverts unfusing on
    arrays (float, int8 with scales, biases; numpy too) and shapes, and a block's fused projections
    give, head for head, the separate matrices' products (query head kv * g + j beside kv head kv,
    as attention groups them). transformers' own models check the whole path (test_families)."""
    from jaxspec.models.convert import fuse_layers, unfuse_layers
    from jaxspec.models.decoder import rotary
    from jaxspec.models.loading import _our_shapes
    cfg = tiny_model.config.replace(attention_bias=True, architecture="qwen2", num_heads=8, num_kv_heads=2)
    model = jaxspec.Model.random(cfg, seed=5)
    for params in (model.params, model.quantize("int8").params, jax.tree.map(np.asarray, model.params)):
        separate = unfuse_layers(params)
        assert "q_nhd" in separate["layers"][0] and "qkv_kxhd" not in separate["layers"][0]
        jax.tree.map(np.testing.assert_array_equal, fuse_layers(separate), params)
        jax.tree.map(np.testing.assert_array_equal, unfuse_layers(fuse_layers(separate)), separate)
    shapes = _our_shapes(cfg, jnp.float32, "int8")   # of the checkpoint layout
    round_trip = jax.eval_shape(lambda p: unfuse_layers(fuse_layers(p)), shapes)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), round_trip) == jax.tree.map(lambda s: (s.shape, s.dtype), shapes)
    layer = unfuse_layers(model.params)["layers"][1]
    block = nnx.merge(model.graphdef, model.params).layers[1]
    x_md = jax.random.normal(jax.random.key(0), (5, cfg.hidden_size))
    pos_m = jnp.arange(5) + 3
    q, k, v = block.qkv(x_md, pos_m)
    y = block.attn_norm(x_md)
    proj = {name: jnp.einsum("md,ahd->mah", y, layer[name]) + layer[bias]
            for name, bias in (("q_nhd", "q_bias_nh"), ("k_khd", "k_bias_kh"), ("v_khd", "v_bias_kh"))}
    np.testing.assert_allclose(q, rotary(proj["q_nhd"], pos_m, block.theta, block.rope_scaling), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, rotary(proj["k_khd"], pos_m, block.theta, block.rope_scaling), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, proj["v_khd"], rtol=1e-5, atol=1e-5)
    attn = jax.random.normal(jax.random.key(1), (5, cfg.num_heads, cfg.resolved_head_dim))
    out = jnp.einsum("mnh,dnh->md", attn, layer["o_dnh"])
    y = block.mlp_norm(x_md + out)
    mlp = (jax.nn.silu(y @ layer["gate_fd"].T) * (y @ layer["up_fd"].T)) @ layer["down_df"].T
    np.testing.assert_allclose(block.finish(x_md, attn), x_md + out + mlp, rtol=1e-5, atol=1e-5)


def test_qwen2_style_bias_and_untied_head(tiny_model):
    """A config with q/k/v bias keeps cached == uncached; bias changes the output."""
    cfg = tiny_model.config.replace(attention_bias=True, architecture="qwen2")
    m = jaxspec.Model.random(cfg, seed=4)
    assert "qkv_bias_kxh" in m.params["layers"][0] and "lm_head_vd" in m.params
    prompts = random_prompts(np.random.default_rng(4), [5, 12], cfg.vocab_size)
    result = jaxspec.generate(m, prompts, max_new_tokens=6)
    for prompt, tokens in zip(prompts, result.tokens):
        assert tokens == naive_greedy(m, prompt, 6)


def assert_bfloat16_tracks_float32(model):
    """The model in bfloat16 against itself in float32, over 320 positions (bfloat16 holds integers
    exactly only up to 256, so positions past it show whether rotary angles are computed in float32).

    bfloat16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3). Measured on the tiny model over
    four token draws: relative L2 error of all logits 0.012-0.013 (about 3 unit roundoffs; rounding
    the weights alone gives 0.006), 0.023-0.033 at the worst position, 97.5-98% top-1 agreement.
    The bounds are about 2.5x those errors.
    """
    m16 = jaxspec.Model(model.config, jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params), dtype="bfloat16")
    tokens = np.random.default_rng(5).integers(0, model.config.vocab_size, (2, 320))
    l32 = np.asarray(model.logits(tokens))
    l16 = np.asarray(m16.logits(tokens))
    assert l16.dtype == np.float32  # logits stay float32 whatever the compute dtype
    rel = np.linalg.norm(l16 - l32) / np.linalg.norm(l32)
    worst = np.max(np.linalg.norm(l16 - l32, axis=-1) / np.linalg.norm(l32, axis=-1))
    top1 = np.mean(l16.argmax(-1) == l32.argmax(-1))
    assert rel < 0.03 and worst < 0.08 and top1 >= 0.95, (rel, worst, top1)


def test_bfloat16_model_tracks_float32(tiny_model):
    assert_bfloat16_tracks_float32(tiny_model)


@pytest.fixture
def fresh_programs():
    """Drops compiled programs before and after a test that patches model code (set up before
    `monkeypatch`, so the patch is undone first)."""
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_the_bfloat16_bounds_catch_rotary_positions_left_in_bfloat16(tiny_model, fresh_programs, monkeypatch):
    """A missing float32 upcast of the rotary positions (`decoder.rotary` fed positions in the
    compute dtype) fails them: measured 0.11 relative L2, 0.92 at the worst position, 93% top-1."""
    from jaxspec.models import decoder
    rotary = decoder.rotary
    monkeypatch.setattr(decoder, "rotary", lambda x, pos, *args: rotary(x, pos.astype(x.dtype), *args))
    with pytest.raises(AssertionError):
        assert_bfloat16_tracks_float32(tiny_model)


def _transcendental_dtypes(model, cache_len=16) -> set:
    """(primitive, operand dtype) of every rsqrt / exp / sin / cos in the traced cached forward:
    the RMSNorm statistics, the softmax (plain or online) and the rotary angles."""
    from jax.extend import core as jcore

    def eqns(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                        yield from eqns(getattr(sub, "jaxpr", sub))

    tokens = jnp.zeros((2, 8), jnp.int32)
    traced = jax.make_jaxpr(lambda p, t: model.forward(p, t, model.init_cache(2, cache_len))[0])(model.params, tokens)
    return {(e.primitive.name, str(e.invars[0].aval.dtype)) for e in eqns(traced.jaxpr)
            if e.primitive.name in ("rsqrt", "exp", "sin", "cos")}


@pytest.mark.parametrize("impl", ["plain", "blocked"])
def test_bfloat16_models_normalise_rotate_and_softmax_in_float32(tiny_model, impl, monkeypatch):
    """On CPU, XLA computes bfloat16 elementwise arithmetic in float32 anyway, so a missing upcast
    in RMSNorm or the softmax moves the logits by less than bfloat16's own error (measured 0.0104
    -> 0.0124 relative L2) and no tolerance can see it; the traced program can. A GPU runs such
    ops in bfloat16."""
    from jaxspec.models import attention, decoder
    monkeypatch.setattr(attention, "ATTENTION", impl)
    monkeypatch.setattr(attention, "BLOCK", 8)
    m16 = jaxspec.Model(tiny_model.config, jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_model.params),
                        dtype="bfloat16")
    assert _transcendental_dtypes(m16) == {(name, "float32") for name in ("rsqrt", "exp", "sin", "cos")}
    # The same check on an RMSNorm that normalises in the compute dtype: rsqrt in bfloat16.
    monkeypatch.setattr(decoder.RMSNorm, "__call__", lambda self, x: x * jax.lax.rsqrt(
        jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.scale[...].astype(x.dtype))
    assert ("rsqrt", "bfloat16") in _transcendental_dtypes(m16)


def test_logits_rejects_bad_tokens(tiny_model):
    with pytest.raises(ValueError, match="outside \\[0, 256\\)"):
        tiny_model.logits([[1, 256]])
    with pytest.raises(ValueError, match="shape"):
        tiny_model.logits([1, 2, 3])


def test_params_carry_logical_axes_for_every_weight(tiny_model):
    axes = tiny_model.logical_axes
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_params = jax.tree.leaves(tiny_model.params)
    assert len(flat_axes) == len(flat_params)
    for names, value in zip(flat_axes, flat_params):
        assert len(names) == value.ndim
    assert axes["layers"][0]["qkv_kxhd"] == ("kv_heads", "fused", "head_dim", "embed")
    assert axes["layers"][0]["gate_up_fxd"] == ("mlp", "fused", "embed")
    assert axes["embed_vd"] == ("vocab", "embed")
