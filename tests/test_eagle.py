"""EAGLE-3 heads (`jaxspec.models.eagle`) and the target features they read, against
transformers' hidden states and an independent numpy forward."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_loading import hf_reference

import jaxspec
from jaxspec.models import eagle
from jaxspec.models.model import forward, forward_packed

# float32 hidden states against transformers' (values <= 0.1): measured at most 2.1e-8 apart.
HIDDEN = dict(rtol=0, atol=1e-7)
# float32 logits, hidden states and cached keys of a head against a float32 numpy forward, or against
# the head run another way (values <= 5.6): measured at most 3.0e-6 apart (a few float32 ulps of the
# largest); the bound is about 3x that.
F32 = dict(rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    ref = hf_reference("llama", False)
    folder = tmp_path_factory.mktemp("hf")
    ref.save_pretrained(folder, safe_serialization=True)
    return ref, jaxspec.load(folder)


def test_features_are_the_residual_stream_entering_the_chosen_layers(hf_pair):
    """transformers' hidden_states[i] is the input of layer i; features (0, 1, 2) concatenate
    them in that order, for ragged cached decoding and for packed verification alike."""
    import torch
    ref, ours = hf_pair
    tokens = np.random.default_rng(0).integers(0, 97, (2, 24))
    with torch.no_grad():
        states = ref(torch.tensor(tokens), output_hidden_states=True).hidden_states
    layers = (0, 1, 2)
    want = np.concatenate([states[i].numpy() for i in layers], axis=-1)
    lengths = np.array([9, 17])
    cache = ours.init_cache(2, 64)
    prompt = np.where(np.arange(17)[None] < lengths[:, None], tokens[:, :17], 0)
    _, cache, got = forward(ours.graphdef, ours.params, jnp.asarray(prompt), cache, features=layers)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(got[b, :lengths[b]]), want[b, :lengths[b]], **HIDDEN)
    cache = cache.commit(jnp.asarray(lengths))
    window = np.stack([tokens[b, lengths[b]:lengths[b] + 4] for b in range(2)])
    _, _, got = forward(ours.graphdef, ours.params, jnp.asarray(window), cache, features=layers)
    counts = np.array([3, 4])
    _, _, packed = forward_packed(ours.graphdef, ours.params, jnp.asarray(window), jnp.asarray(counts), cache, 8,
                                  features=layers)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(got[b]), want[b, lengths[b]:lengths[b] + 4], **HIDDEN)
        np.testing.assert_allclose(np.asarray(packed[b, :counts[b]]), want[b, lengths[b]:lengths[b] + counts[b]],
                                   **HIDDEN)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotary(x_tnh, theta):
    half = x_tnh.shape[-1] // 2
    angles = np.arange(len(x_tnh))[:, None, None] / theta ** (np.arange(half) * 2.0 / (2 * half))
    x1, x2 = x_tnh[..., :half], x_tnh[..., half:]
    return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1)


def _causal_gqa(q_tnh, k_tkh, v_tkh):
    """Causal grouped-query attention of one sequence, a head at a time."""
    (t, n, h), k = q_tnh.shape, k_tkh.shape[1]
    out = np.zeros_like(q_tnh)
    for i in range(n):
        scores = q_tnh[:, i] @ k_tkh[:, i // (n // k)].T / np.sqrt(h)
        scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, i] = probs / probs.sum(-1, keepdims=True) @ v_tkh[:, i // (n // k)]
    return out


def numpy_head(p, config, embed_vd, features_tf, tokens_t):
    """EAGLE-3's step written out for one sequence at positions 0..t-1, causal."""
    c = config.layer
    eps = c.rms_norm_eps
    hidden = features_tf @ p["fc_fd"]
    x = np.concatenate([_rms(embed_vd[tokens_t], p["input_norm"]["scale"], eps),
                        _rms(hidden, p["hidden_norm"]["scale"], eps)], axis=-1)
    q = _rotary(np.einsum("tx,xnh->tnh", x, p["q_xnh"]), c.rope_theta)
    kk = _rotary(np.einsum("tx,xkh->tkh", x, p["k_xkh"]), c.rope_theta)
    v = np.einsum("tx,xkh->tkh", x, p["v_xkh"])
    x = hidden + np.einsum("tnh,nhd->td", _causal_gqa(q, kk, v), p["o_nhd"])
    y = _rms(x, p["mlp_norm"]["scale"], eps)
    gate = y @ p["gate_du"]
    x = x + (gate / (1 + np.exp(-gate)) * (y @ p["up_du"])) @ p["down_ud"]
    return _rms(x, p["final_norm"]["scale"], eps) @ p["lm_head_dw"], x


@pytest.fixture(scope="module")
def head_and_target():
    target = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny"), seed=0)
    head = eagle.EagleHead.init(target, draft_vocab_size=100, token_counts=np.arange(256) % 7, seed=1)
    rng = np.random.default_rng(2)   # norms away from 1, so that each one matters
    for name in ("input_norm", "hidden_norm", "mlp_norm", "final_norm"):
        head.params[name]["scale"] = jnp.asarray(rng.uniform(0.5, 1.5, target.config.hidden_size), jnp.float32)
    return head, target


def test_head_forward_matches_an_independent_numpy_step_all_at_once_and_token_by_token(head_and_target):
    head, target = head_and_target
    rng = np.random.default_rng(3)
    t = 11
    features = rng.normal(size=(1, t, head.config.feature_size)).astype(np.float32)
    tokens = rng.integers(0, 256, (1, t))
    params = jax.tree.map(np.asarray, head.params)
    want_logits, want_hidden = numpy_head(params, head.config, np.asarray(target.params["embed_vd"]), features[0],
                                          tokens[0])
    hidden = eagle.fuse(head.graphdef, head.params, jnp.asarray(features))
    logits, out, _ = eagle.head_forward(head.graphdef, head.params, target.params["embed_vd"], hidden,
                                        jnp.asarray(tokens), head.init_cache(1, 16))
    np.testing.assert_allclose(np.asarray(logits[0]), want_logits, **F32)
    np.testing.assert_allclose(np.asarray(out[0]), want_hidden, **F32)
    cache = head.init_cache(1, 16)
    for i in range(t):
        step, _, cache = eagle.head_forward(head.graphdef, head.params, target.params["embed_vd"], hidden[:, i:i + 1],
                                            jnp.asarray(tokens[:, i:i + 1]), cache)
        cache = cache.commit(cache.lengths + 1)
        np.testing.assert_allclose(np.asarray(step[0, 0]), want_logits[i], **F32)


def test_draft_vocabulary_maps_back_to_target_ids(head_and_target):
    head, target = head_and_target
    ids = head.draft_ids
    counts = np.arange(256) % 7
    assert len(ids) == 100 and np.all(np.diff(ids) > 0) and counts[ids].min() >= np.delete(counts, ids).max()
    # The LM head starts as the target's over the draft ids.
    np.testing.assert_array_equal(np.asarray(head.params["lm_head_dw"]),
                                  np.asarray(target.params["lm_head_vd"])[ids].T)
    logits = np.random.default_rng(4).normal(size=(2, 3, 100)).astype(np.float32)
    full = np.asarray(eagle.to_target_logits(jnp.asarray(logits), ids, 256))
    assert np.all(np.isneginf(np.delete(full, ids, axis=-1)))
    np.testing.assert_array_equal(full[..., ids], logits)
    np.testing.assert_array_equal(full.argmax(-1), ids[logits.argmax(-1)])


def test_bad_heads_are_refused_with_the_limit(head_and_target):
    _, target = head_and_target
    with pytest.raises(ValueError, match=r"feature_layers must be target layer indices in \[0, 2\)"):
        eagle.EagleHead.init(target, feature_layers=(0, 1, 2))
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 256\]"):
        eagle.EagleHead.init(target, draft_vocab_size=300)
    assert eagle.default_feature_layers(32) == (2, 16, 29)


# --- EagleDrafter in the engine ---

from exactness import VOCAB6_PROMPT, assert_matches_distribution, exact_joint  # noqa: E402

from jaxspec.sampling import SamplingConfig  # noqa: E402


@pytest.fixture(scope="module")
def vocab6_heads():
    """A 6-token target and two heads: the full vocabulary, and a 4-token draft vocabulary that
    cannot propose tokens 0 and 3. Untrained heads agree with a random target by chance; with this
    seed both accept 3-16% of drafted tokens at k = 3, fixed or goodput (seeds 0-7 ranged 0-71%)."""
    cfg = jaxspec.ModelConfig.preset("tiny").replace(vocab_size=6, num_layers=4, name="tiny-v6-4L")
    target = jaxspec.Model.random(cfg, seed=6)
    full = eagle.EagleHead.init(target, seed=5)
    reduced = eagle.EagleHead.init(target, draft_vocab_size=4, token_counts=[0, 5, 5, 0, 5, 5], seed=6)
    assert list(reduced.draft_ids) == [1, 2, 4, 5]
    return target, full, reduced


_CHEAP_HEAD = jaxspec.CostModel.from_coefficients(draft_fixed=1e-4, draft_per_token=0.0, target_fixed=1e-3,
                                                  target_per_token=1e-5)


@pytest.mark.parametrize("spec", [jaxspec.SpecConfig(k=3), jaxspec.SpecConfig(k=3, extra=1, selection="tetris"),
                                  # one of the longest lossless runs: in the slow step (CI runs it)
                                  pytest.param(jaxspec.SpecConfig(k=3, policy="goodput", cost_model=_CHEAP_HEAD),
                                               marks=pytest.mark.slow)],
                         ids=["standard", "tetris", "goodput"])
def test_eagle_greedy_output_is_the_targets_own(vocab6_heads, spec):
    target, full, reduced = vocab6_heads
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, 6, n)) for n in (3, 9, 5, 12, 2, 7)]
    want = jaxspec.generate(target, prompts, max_new_tokens=24).tokens
    for head in (full, reduced):
        decoder = jaxspec.SpeculativeDecoder(target, jaxspec.EagleDrafter(head), spec=spec)
        got = decoder.generate(prompts, max_new_tokens=24, batch_size=4)   # 6 requests in 4 slots: refills
        assert got.tokens == want
        assert got.stats.acceptance_rate > 0   # some windows were accepted in part or whole


@pytest.mark.slow
def test_a_profiled_eagle_cost_model_prices_the_heads_steps(vocab6_heads):
    """CostModel.profile times real steps with the head as the drafter (k = 0 included) and fits
    them; the timings themselves are noise on a loaded machine and are not compared here."""
    target, _, reduced = vocab6_heads
    cost = jaxspec.CostModel.profile(target, jaxspec.EagleDrafter(reduced), batches=(1, 4), ks=(0, 1, 3),
                                     cache_lens=(64,), passes=1)
    assert cost.draft_name == "tiny-v6-4L-eagle3"
    points = cost.fit["step"]["points_seconds"]
    assert sorted((b, k) for b, k, _, _ in points) == [(b, k) for b in (1, 4) for k in (0, 1, 3)]
    assert all(sec > 0 and cost.step_seconds(b, k, s) > 0 for b, k, s, sec in points)


@pytest.mark.parametrize("head_index", [1, 2], ids=["full-vocab", "reduced-vocab"])
def test_eagle_sampling_matches_the_targets_distribution(vocab6_heads, head_index):
    """Four tokens: the prefill's, the window's two drafts and its bonus."""
    target, heads = vocab6_heads[0], vocab6_heads[1:]
    sampling, rows = SamplingConfig(temperature=1.0, top_p=0.8), 4000
    decoder = jaxspec.SpeculativeDecoder(target, jaxspec.EagleDrafter(heads[head_index - 1]),
                                         spec=jaxspec.SpecConfig(k=2), sampling=sampling)
    result = decoder.generate([VOCAB6_PROMPT] * rows, max_new_tokens=4, seed=31)
    assert_matches_distribution(result.tokens, exact_joint(target, VOCAB6_PROMPT, 4, sampling), rows)
    assert 0 < result.stats.acceptance_rate < 1


@pytest.mark.slow  # 16 s; the greedy and sampled EAGLE runs below check the same state's output
def test_the_head_state_after_decoding_equals_a_recomputation_from_scratch(vocab6_heads):
    """After ragged rows decode through drafting steps of several lengths and plain steps (partial
    and full acceptances, rollbacks), the head's committed cache, last output and first-draft
    logits equal the head run once over each row's kept sequence with the target's features
    recomputed from scratch."""
    from jaxspec.engine import step as engine
    from jaxspec.engine.plans import Program, Schedule, StepPlan
    from jaxspec.sampling import request_keys

    target, head, _ = vocab6_heads
    drafter = jaxspec.EagleDrafter(head)
    params, sampling = drafter.params, SamplingConfig()
    rng = np.random.default_rng(8)
    prompts = [list(rng.integers(0, 6, n)) for n in (3, 8, 5)]
    b, p, out_len, cache_len = 3, 8, 32, 48
    tokens = jnp.asarray([row + [0] * (p - len(row)) for row in prompts], jnp.int32)
    lengths = jnp.asarray([len(row) for row in prompts], jnp.int32)
    max_new, keys, eos = jnp.full((b,), 30, jnp.int32), request_keys(0, np.arange(b)), jnp.int32(-1)
    program = Program(target=target.graphdef, drafter=drafter, schedule=Schedule(plans=(StepPlan(k=1),)),
                      sampling=sampling, cache_len=cache_len, out_len=out_len)
    requests = engine.Requests(tokens_bp=tokens, prompt_len_b=lengths, max_new_b=max_new, keys_b=keys, eos_id=eos)
    state, feats = engine.initial_state(program, target.params, requests)
    draft_state = drafter.absorb(params, drafter.init(params, tokens, lengths, cache_len), feats,
                                 state.seq_bl[:, 1:p + 1], lengths)
    state = state.replace(draft_state=draft_state)
    step = jax.jit(engine.speculative_step, static_argnums=(0, 1))
    for k in (3, 0, 3, 1, 0, 0, 3, 1):
        state = step(program, StepPlan(k=k), (target.params, params), state)
    assert int(state.counters.accepted.sum()) > 0
    pending = np.asarray(state.target_cache.lengths)
    assert_head_state_is_recomputed(target, head, state.draft_state, np.asarray(state.seq_bl), pending, pending + 1)


def assert_head_state_is_recomputed(model, head, got, seq_bl, committed_b, known_b):
    """The head's committed rows (one per `model` cache position, `committed_b`) equal the head run
    once over the row's sequence with `model`'s features recomputed from scratch: keys of the rows
    whose next token is known (below `known_b`), last output and first-draft logits when known."""
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), committed_b)
    width = 40   # every row padded to one width (causal: padding changes no earlier row), one compile
    for r in range(len(committed_b)):
        n = min(committed_b[r], known_b[r] - 1)
        seq = np.pad(seq_bl[r:r + 1, :n + 1], ((0, 0), (0, width + 1 - (n + 1))))
        _, _, f = forward(model.graphdef, model.params, jnp.asarray(seq[:, :-1]), model.init_cache(1, 64),
                          empty=True, features=head.config.feature_layers)
        hidden = eagle.fuse(head.graphdef, head.params, f)
        logits, out, cache = _head_forward(head.graphdef, head.params, head.embed_vd, hidden,
                                           jnp.asarray(seq[:, 1:]), head.init_cache(1, 64))
        np.testing.assert_allclose(np.asarray(got.cache.k[0][r, :n]), np.asarray(cache.k[0][0, :n]), **F32)
        if n == committed_b[r]:
            np.testing.assert_allclose(np.asarray(got.logits_bw[r]), np.asarray(logits[0, n - 1]), **F32)
            np.testing.assert_allclose(np.asarray(got.hidden_bd[r]), np.asarray(out[0, n - 1]), **F32)


_head_forward = jax.jit(eagle.head_forward, static_argnums=0)


@pytest.mark.slow
def test_a_head_under_a_chain_level_follows_that_levels_model(vocab6_heads):
    """EAGLE as the lowest level of a chain (target <- middle model <- head on the middle model's
    features): after proposals followed by partial and full acceptance and by several plain outer
    steps (which the level's `catch_up` feeds), the head's state equals a recomputation from
    scratch; and the chain's greedy output is the target's own."""
    from jaxspec.engine.chain import ChainDrafter

    target = vocab6_heads[0]
    middle = jaxspec.Model.random(target.config.replace(num_layers=3, name="tiny-v6-3L"), seed=7)
    head = eagle.EagleHead.init(middle, seed=8)
    inner = jaxspec.SpeculativeDecoder(middle, jaxspec.EagleDrafter(head), spec=jaxspec.SpecConfig(k=2))
    chain, k, cache_len = ChainDrafter(inner), 3, 64
    rng = np.random.default_rng(10)
    prompts = [list(rng.integers(0, 6, n)) for n in (3, 8, 5)]
    p = max(map(len, prompts))
    seq = np.zeros((3, cache_len), np.int32)
    for r, row in enumerate(prompts):
        seq[r, :len(row) + 1] = row + [int(rng.integers(0, 6))]    # the prompt and the target's first token
    lengths = np.array([len(row) for row in prompts], np.int32)
    state = chain.init(chain.params, jnp.asarray(seq[:, :p]), jnp.asarray(lengths), cache_len)
    propose = jax.jit(chain.propose, static_argnums=(4, 6))
    pending = lengths.copy()
    for accepted in ([0, 3, 1], [3, 0, 2], [-6, 1, -4], [2, -5, 3]):   # negative: that many plain steps
        lag = int(jnp.max(chain.lag(state, jnp.asarray(seq), jnp.asarray(pending))))
        if lag:   # as the engine does before drafting (after plain steps)
            state = chain.catch_up(chain.params, state, jnp.asarray(seq), jnp.asarray(pending), lag)
        proposal, state = propose(chain.params, state, jnp.asarray(seq), jnp.asarray(pending), k,
                                  jax.random.split(jax.random.key(0), 3), SamplingConfig())
        drafts = np.asarray(proposal.tokens_bk)
        known = pending + 1 + k
        full = seq.copy()
        for r in range(3):
            full[r, pending[r] + 1:pending[r] + 1 + k] = drafts[r]
        assert_head_state_is_recomputed(middle, head, state.inner_state, full, np.asarray(state.cache.lengths), known)
        for r, a in enumerate(accepted):
            kept = list(drafts[r, :max(a, 0)]) + list(rng.integers(0, 6, 1 if a >= 0 else -a))
            seq[r, pending[r] + 1:pending[r] + 1 + len(kept)] = kept
            pending[r] += len(kept)
    prompts = [list(rng.integers(0, 6, n)) for n in (3, 9, 5, 12)]
    want = jaxspec.generate(target, prompts, max_new_tokens=20).tokens
    got = jaxspec.SpeculativeDecoder(target, inner, spec=jaxspec.SpecConfig(k=3)).generate(prompts, max_new_tokens=20)
    assert got.tokens == want


def test_eagle_on_a_tensor_parallel_target_is_lossless(vocab6_heads):
    """The head on the target's (data 2 x tensor 2) mesh, sharded by the same rules; a separate
    draft slice is refused."""
    from conftest import is_sharded

    target, _, reduced = vocab6_heads
    rng = np.random.default_rng(15)
    prompts = [list(rng.integers(0, 6, n)) for n in (3, 9, 5, 12)]
    want = jaxspec.generate(target, prompts, max_new_tokens=20).tokens
    mesh = jaxspec.MeshConfig(target_tp=2, target_dp=2, draft_tp=0)
    decoder = jaxspec.SpeculativeDecoder(target, jaxspec.EagleDrafter(reduced), spec=jaxspec.SpecConfig(k=3),
                                         mesh=mesh)
    assert is_sharded(decoder.drafter.head.params["q_xnh"]) and is_sharded(decoder.drafter.head.params["lm_head_dw"])
    got = decoder.generate(prompts, max_new_tokens=20)
    assert got.tokens == want and got.stats.acceptance_rate > 0
    with pytest.raises(ValueError, match="separate draft slice"):
        jaxspec.SpeculativeDecoder(target, jaxspec.EagleDrafter(reduced), mesh=jaxspec.MeshConfig(target_tp=2,
                                                                                                   draft_tp=1))


# --- training ---

from jaxspec.training.eagle import heldout_loss, train_eagle, ttt_logits  # noqa: E402


def test_the_unrolled_training_forward_is_sequential_teacher_forced_drafting(head_and_target):
    """Training-time test at step s, row j: the head absorbed rows 0..j from the target's features,
    then drafted s times feeding its own outputs with the true tokens; the same logits as the
    cached drafting loop computes."""
    head, target = head_and_target
    rng = np.random.default_rng(9)
    t, steps = 10, 3
    tokens = rng.integers(0, 256, (1, t + steps + 1))
    features = jnp.asarray(rng.normal(size=(1, t, head.config.feature_size)), jnp.float32)
    embed = target.params["embed_vd"]
    unrolled = jax.jit(ttt_logits, static_argnums=(0, 5))(head.graphdef, head.params, embed, features,
                                                          jnp.asarray(tokens[:, :t]), steps)
    padded = np.pad(tokens[:, :t], ((0, 0), (0, steps + 1)))
    hidden = eagle.fuse(head.graphdef, head.params, features)
    head_forward = jax.jit(eagle.head_forward, static_argnums=0)
    for j in (0, 4, t - 1):
        cache = head.init_cache(1, 32)
        logits, out, cache = head_forward(head.graphdef, head.params, embed, hidden[:, :j + 1],
                                                jnp.asarray(padded[:, 1:j + 2]), cache)
        cache = cache.commit(cache.lengths + j + 1)
        step_logits, h = logits[:, -1], out[:, -1]
        for s in range(steps):
            np.testing.assert_allclose(np.asarray(unrolled[s][0, j]), np.asarray(step_logits[0]), **F32)
            step_logits, h, cache = head_forward(head.graphdef, head.params, embed, h[:, None],
                                                       jnp.asarray(padded[:, j + 2 + s:j + 3 + s]), cache)
            cache = cache.commit(cache.lengths + 1)
            step_logits, h = step_logits[:, 0], h[:, 0]


@functools.cache
def tiny_setup():
    """A tiny target, its own greedy continuations as data (256 to train on, 8 held out) and a fresh head."""
    target = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny").replace(num_layers=4, vocab_size=64), seed=11)
    rng = np.random.default_rng(12)
    prompts = [list(rng.integers(0, 64, 4)) for _ in range(264)]
    data = [p + t for p, t in zip(prompts, jaxspec.generate(target, prompts, max_new_tokens=28).tokens)]
    return target, eagle.EagleHead.init(target, seed=13), data


def tiny_run(steps: int, **kwargs):
    """`tiny_setup` and the result of training its head for `steps`."""
    target, head, data = tiny_setup()
    return (target, head, data) + train_eagle(target, head, data[:256], steps=steps, learning_rate=3e-3,
                                              batch_size=32, seq_len=32, ttt_steps=2, progress=False, **kwargs)


@pytest.mark.slow   # training quality, not losslessness; make test was at the 10-minute mark
def test_training_lowers_held_out_loss_and_raises_acceptance():
    """Trained on a tiny target's own greedy continuations, the head agrees with the target far
    more often; on held-out sequences its loss falls and greedy decoding accepts far more drafts
    (and stays lossless)."""
    target, head, data, trained, history = tiny_run(160, heldout=tiny_setup()[2][256:], eval_every=80, eval_k=2,
                                                    eval_max_new_tokens=20)
    assert min(history["agree"][-1]) > max(history["agree"][0]) + 0.25
    assert history["eval_step"] == [0, 80, 160]
    accepted = history["heldout_accepted_length"]
    # Soft labels: the loss's floor is the target's own entropy (high for a random tiny target).
    assert history["heldout_loss"][-1] < history["heldout_loss"][0] - 0.5 and accepted[-1] > accepted[0] + 0.2, (
        history["heldout_loss"], accepted)
    # Full held-out sequences, recomputed: measured 1.3e-7 relative (one float32 ulp) from the history's.
    assert heldout_loss(target, trained, data[256:], seq_len=32, ttt_steps=2) == pytest.approx(
        history["heldout_loss"][-1], rel=1e-6)
    held_out = [row[:6] for row in data[256:]]
    want = jaxspec.generate(target, held_out, max_new_tokens=20).tokens
    rates = []
    for h in (head, trained):
        decoder = jaxspec.SpeculativeDecoder(target, jaxspec.EagleDrafter(h), spec=jaxspec.SpecConfig(k=2))
        result = decoder.generate(held_out, max_new_tokens=20)
        assert result.tokens == want
        rates.append(result.stats.acceptance_rate)
    assert rates[1] > max(5 * rates[0], rates[0] + 0.1), rates


@pytest.mark.slow  # 16 s; the shared training loop's resume is also test_distill's
def test_a_killed_training_run_resumes_to_the_same_params(tmp_path):
    """Killed after step 5 with checkpoints every 2 steps, a rerun resumes from step 4 (and from
    the finished feature cache) and ends with the uninterrupted run's params and history."""
    *_, full, full_history = tiny_run(8)

    def kill_after_5(step, metrics):
        if step == 5:
            raise KeyboardInterrupt

    where = dict(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, feature_cache_dir=tmp_path / "features")
    with pytest.raises(KeyboardInterrupt):
        tiny_run(8, callback=kill_after_5, **where)
    seen = []
    *_, resumed, history = tiny_run(8, callback=lambda step, m: seen.append(step), **where)
    assert seen == [5, 6, 7, 8]
    # The same steps on the same batches from an exactly restored state: measured bit-identical.
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed.params,
                 full.params)
    assert history["loss"] == full_history["loss"]
    target, head, data = tiny_setup()
    with pytest.raises(ValueError, match="checkpoint_dir.*hparams"):
        train_eagle(target, head, data[:256], steps=8, learning_rate=1e-3, batch_size=32, seq_len=32, ttt_steps=2,
                    progress=False, checkpoint_dir=tmp_path / "ckpt")


def test_the_feature_cache_holds_the_targets_features_and_labels_and_resumes(tmp_path, monkeypatch):
    """Stored features are the layer inputs of an uncached pass, stored choices are the target's
    argmax and the stored hidden states give the target's logits at any ids (labels); a build
    killed after two chunks resumes and ends with the same files as one uninterrupted build."""
    from jaxspec.training import feature_cache as fc

    target = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny").replace(num_layers=4), seed=5)
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, 256, (20, 12)).astype(np.int32)
    lengths = rng.integers(3, 13, 20).astype(np.int32)
    layers = (0, 2, 3)
    whole = fc.feature_cache(target, layers, tokens, lengths, None, batch_size=4, progress=False)
    logits = np.asarray(target.logits(jnp.asarray(tokens)))
    np.testing.assert_array_equal(whole["choice"], logits.argmax(-1))
    decoder = nnx.merge(target.graphdef, target.params)
    ids = jnp.asarray([3, 17, 200])
    labels = decoder.head(fc.stored(whole["hidden"]).astype(jnp.float32), ids=ids)
    # Hidden states stored in bfloat16: the labels measured at most 6.5e-3 off on logits <= 4.5.
    np.testing.assert_allclose(np.asarray(labels), logits[..., np.asarray(ids)], rtol=0, atol=0.02)
    # Features within one bfloat16 unit roundoff (2^-8, relative) of the float32 pass, plus the
    # float32 difference of batching by 4 rows (measured 6.3e-7); truncating instead of rounding
    # to bfloat16 is 1.5e-2 off.
    _, feats = decoder.hidden_uncached(jnp.asarray(tokens), layers)
    np.testing.assert_allclose(np.asarray(fc.stored(whole["features"]), np.float32), np.asarray(feats),
                               rtol=2 ** -8, atol=3e-6)
    calls = []
    real = fc._target_pass

    def dies_on_the_third_chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(fc, "_target_pass", dies_on_the_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        fc.feature_cache(target, layers, tokens, lengths, tmp_path, batch_size=4, progress=False)
    assert json.loads((tmp_path / "meta.json").read_text())["rows_done"] == 8
    resumed = fc.feature_cache(target, layers, tokens, lengths, tmp_path, batch_size=4, progress=False)
    assert len(calls) == 3 + 3      # the two finished chunks were not recomputed
    for name in ("features", "hidden", "choice"):
        np.testing.assert_array_equal(np.asarray(resumed[name]), whole[name])
    other = fc.feature_cache(target, (1, 2, 3), tokens, lengths, tmp_path, batch_size=4, progress=False)
    assert len(calls) == 6 + 5 and other["features"].shape == whole["features"].shape   # other layers: rebuilt


# --- checkpoints in the published EAGLE-3 layout ---

def _reference_checkpoint(folder, target, w, layers, seed=21):
    """An EAGLE-3 folder written from scratch in the reference's PyTorch layout (not by jaxspec)."""
    import json

    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    c = target.config
    d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim
    u, v = c.intermediate_size, c.vocab_size
    f = len(layers) * d
    mat = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    norm = lambda: rng.uniform(0.5, 1.5, d).astype(np.float32)  # noqa: E731
    ids = np.sort(rng.choice(v, w, replace=False))
    tensors = {"fc.weight": mat(d, f), "midlayer.self_attn.q_proj.weight": mat(n * h, 2 * d),
               "midlayer.self_attn.k_proj.weight": mat(k * h, 2 * d),
               "midlayer.self_attn.v_proj.weight": mat(k * h, 2 * d),
               "midlayer.self_attn.o_proj.weight": mat(d, n * h), "midlayer.mlp.gate_proj.weight": mat(u, d),
               "midlayer.mlp.up_proj.weight": mat(u, d), "midlayer.mlp.down_proj.weight": mat(d, u),
               "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
               "midlayer.post_attention_layernorm.weight": norm(), "norm.weight": norm(),
               "lm_head.weight": mat(w, d), "d2t": (ids - np.arange(w)).astype(np.int64),
               "t2d": np.isin(np.arange(v), ids)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": d, "intermediate_size": u,
        "num_attention_heads": n, "num_key_value_heads": k, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "vocab_size": v, "draft_vocab_size": w,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}))
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors, ids


def reference_layout_head(t, config, embed_vd, features_tf, tokens_t, norm_before_residual=False):
    """EAGLE-3's step on the reference's tensors as stored (x @ W.T), one sequence, causal; with
    `norm_before_residual` (vLLM's reading of speculators heads) the residual is the normed hidden."""
    c = config.layer
    eps, n, k, h = c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.resolved_head_dim
    hidden = features_tf @ t["fc.weight"].T
    x = np.concatenate([_rms(embed_vd[tokens_t], t["midlayer.input_layernorm.weight"], eps),
                        _rms(hidden, t["midlayer.hidden_norm.weight"], eps)], axis=-1)
    size = len(tokens_t)
    q = _rotary((x @ t["midlayer.self_attn.q_proj.weight"].T).reshape(size, n, h), c.rope_theta)
    kk = _rotary((x @ t["midlayer.self_attn.k_proj.weight"].T).reshape(size, k, h), c.rope_theta)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).reshape(size, k, h)
    residual = _rms(hidden, t["midlayer.hidden_norm.weight"], eps) if norm_before_residual else hidden
    x = residual + _causal_gqa(q, kk, v).reshape(size, -1) @ t["midlayer.self_attn.o_proj.weight"].T
    y = _rms(x, t["midlayer.post_attention_layernorm.weight"], eps)
    gate = y @ t["midlayer.mlp.gate_proj.weight"].T
    mlp = gate / (1 + np.exp(-gate)) * (y @ t["midlayer.mlp.up_proj.weight"].T)
    x = x + mlp @ t["midlayer.mlp.down_proj.weight"].T
    return _rms(x, t["norm.weight"], eps) @ t["lm_head.weight"].T


def test_a_reference_written_checkpoint_loads_and_scores_like_the_reference(tmp_path):
    target = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny").replace(num_layers=4), seed=0)
    tensors, ids = _reference_checkpoint(tmp_path / "eagle", target, 40, (0, 2, 3))
    head = jaxspec.load(tmp_path / "eagle", target=target)
    assert head.config.feature_layers == (0, 2, 3)
    np.testing.assert_array_equal(head.draft_ids, ids)
    rng = np.random.default_rng(22)
    features = rng.normal(size=(1, 9, head.config.feature_size)).astype(np.float32)
    tokens = rng.integers(0, 256, (1, 9))
    want = reference_layout_head(tensors, head.config, np.asarray(target.params["embed_vd"]), features[0], tokens[0])
    logits, _, _ = eagle.head_forward(head.graphdef, head.params, head.embed_vd,
                                      eagle.fuse(head.graphdef, head.params, jnp.asarray(features)),
                                      jnp.asarray(tokens), head.init_cache(1, 16))
    np.testing.assert_allclose(np.asarray(logits[0]), want, **F32)
    # The reference's own releases store pytorch_model.bin (float16): the same head, each weight
    # rounded to float16 (relative 2^-11; half of float16's subnormal spacing, 2^-25, below 2^-14).
    import torch

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "eagle" / "config.json").read_text())
    torch.save({name: torch.from_numpy(value).to(torch.float16) if value.dtype == np.float32 else
                torch.from_numpy(value) for name, value in tensors.items()}, tmp_path / "bin" / "pytorch_model.bin")
    from_bin = jaxspec.load(tmp_path / "bin", target=target)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2 ** -11, atol=2 ** -25), from_bin.params,
                 head.params)
    # jaxspec writes the same layout back: a round trip keeps every tensor.
    head.save(tmp_path / "again")
    again = jaxspec.load(tmp_path / "again", target=target)
    jax.tree.map(np.testing.assert_array_equal, again.params, head.params)
    np.testing.assert_array_equal(again.draft_ids, ids)


def test_a_speculators_format_head_loads_and_scores_like_the_reference(tmp_path):
    """The speculators layout (`transformer_layer_config`, tensors under `layers.0.`), with
    norm_before_residual set, scores like the reference forward with that variant, and saves back
    to the EAGLE-3 layout with the flag kept."""
    import json

    from safetensors.numpy import save_file
    target = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny").replace(num_layers=4), seed=0)
    tensors, ids = _reference_checkpoint(tmp_path / "ref", target, 40, (0, 2, 3))
    ref = json.loads((tmp_path / "ref" / "config.json").read_text())
    layer = {key: ref[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "num_hidden_layers", "rms_norm_eps", "rope_theta",
                                       "vocab_size")}
    folder = tmp_path / "spec"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer,
        "draft_vocab_size": 40, "norm_before_residual": True, "target_hidden_size": 64,
        "eagle_aux_hidden_state_layer_ids": [0, 2, 3],
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}}}))
    save_file({name.replace("midlayer.", "layers.0."): value for name, value in tensors.items()},
              str(folder / "model.safetensors"))
    head = jaxspec.load(folder, target=target)
    assert head.config.norm_before_residual and head.config.feature_layers == (0, 2, 3)
    np.testing.assert_array_equal(head.draft_ids, ids)
    rng = np.random.default_rng(23)
    features = rng.normal(size=(1, 7, head.config.feature_size)).astype(np.float32)
    tokens = rng.integers(0, 256, (1, 7))
    want = reference_layout_head(tensors, head.config, np.asarray(target.params["embed_vd"]), features[0], tokens[0],
                                 norm_before_residual=True)
    logits, _, _ = eagle.head_forward(head.graphdef, head.params, head.embed_vd,
                                      eagle.fuse(head.graphdef, head.params, jnp.asarray(features)),
                                      jnp.asarray(tokens), head.init_cache(1, 16))
    np.testing.assert_allclose(np.asarray(logits[0]), want, **F32)
    head.save(tmp_path / "again")
    again = jaxspec.load(tmp_path / "again", target=target)
    assert again.config.norm_before_residual
    jax.tree.map(np.testing.assert_array_equal, again.params, head.params)


def test_bad_checkpoints_name_the_tensor_or_the_limit(tmp_path):
    from safetensors.numpy import load_file, save_file
    target = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny").replace(num_layers=4), seed=0)
    folder = tmp_path / "eagle"
    _reference_checkpoint(folder, target, 40, (0, 2, 3))
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'midlayer.hidden_norm.weight' \(expected shape \(64,\)\)"):
        jaxspec.load(folder, target=target)
    _reference_checkpoint(folder, target, 40, (0, 2, 3))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :64]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'fc.weight' has shape \(64, 64\), but the config needs \(64, 192\)"):
        jaxspec.load(folder, target=target)
    _reference_checkpoint(folder, target, 40, (0, 2, 9))
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \(0, 2, 9\) must lie in \[0, 4\)"):
        jaxspec.load(folder, target=target)
    with pytest.raises(ValueError, match="needs target="):
        jaxspec.load(folder)
