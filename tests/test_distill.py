"""Tests of draft distillation: losses, draft initialisation, learning, resumption, data cache, errors."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.training.distill import distribution_loss
from jaxspec.training.loop import batch_indices, heldout_acceptance

# The package's `distill` attribute is the function; the module is reached through importlib.
distill_lib = importlib.import_module("jaxspec.training.distill")

SMALL = jaxspec.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, max_position_embeddings=128)


def _prompts(seed, count, vocab, low=4, high=12):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(low, high))).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def bigram_target():
    """A random target whose attention output is zeroed, so its next token depends only on the current one.

    What a draft learns about such a target on some prompts carries over to unseen prompts, which is
    what the acceptance test needs; the final norm is sharpened so the distributions are peaked.
    """
    cfg = jaxspec.ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=128, max_position_embeddings=256)
    params = jax.tree.map(lambda x: x, jaxspec.Model.random(cfg, seed=0).params)
    params["final_norm"] = {"scale": params["final_norm"]["scale"] * 4.0}
    for i in range(cfg.num_layers):
        params["layers"][i] = {**params["layers"][i], "o_dnh": jnp.zeros_like(params["layers"][i]["o_dnh"])}
    return jaxspec.Model(cfg, params)


@pytest.fixture(scope="module")
def small_pair():
    target = jaxspec.Model.random(SMALL, seed=0)
    draft = jaxspec.draft_from_target(target, num_layers=1, hidden_size=16, seed=3)
    return target, draft


# --- losses against numpy ---

def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_losses_match_numpy_reference():
    rng = np.random.default_rng(0)
    target_logits = rng.normal(size=(3, 5, 11)) * 2.0
    draft_logits = rng.normal(size=(3, 5, 11)) * 2.0
    p, q = _np_softmax(target_logits), _np_softmax(draft_logits)
    expected = {"forward_kl": np.sum(p * np.log(p / q), -1), "reverse_kl": np.sum(q * np.log(q / p), -1),
                "tvd": 0.5 * np.sum(np.abs(p - q), -1)}
    for name, value in expected.items():
        got = np.asarray(distribution_loss(jnp.asarray(target_logits), jnp.asarray(draft_logits), name))
        # float32 against float64: measured at most 3.2e-7 relative on values 0.44-5.7.
        np.testing.assert_allclose(got, value, rtol=2e-6, atol=0, err_msg=name)
    # Every divergence is zero between a distribution and itself (up to a logit shift): measured
    # at most 1.4e-7, the float32 rounding of the shifted log-softmax.
    for name in expected:
        same = distribution_loss(jnp.asarray(target_logits), jnp.asarray(target_logits + 3.0), name)
        np.testing.assert_allclose(np.asarray(same), 0.0, atol=1e-6)


# --- draft initialisation ---

def test_draft_from_target_with_all_layers_is_the_target(small_pair):
    target, _ = small_pair
    draft = jaxspec.draft_from_target(target, num_layers=SMALL.num_layers)
    tokens = np.array(_prompts(1, 2, SMALL.vocab_size, 10, 11))
    np.testing.assert_array_equal(np.asarray(draft.logits(tokens)), np.asarray(target.logits(tokens)))
    shallow = jaxspec.draft_from_target(target, num_layers=1)
    assert shallow.config.num_layers == 1
    np.testing.assert_array_equal(np.asarray(shallow.params["embed_vd"]), np.asarray(target.params["embed_vd"]))
    np.testing.assert_array_equal(np.asarray(shallow.params["lm_head_vd"]), np.asarray(target.params["lm_head_vd"]))
    np.testing.assert_array_equal(np.asarray(shallow.params["layers"][0]["qkv_kxhd"]),
                                  np.asarray(target.params["layers"][0]["qkv_kxhd"]))
    assert shallow.tokenizer is target.tokenizer


def test_narrow_draft_keeps_the_embeddings_principal_directions(small_pair):
    target, draft = small_pair
    assert draft.config.hidden_size == 16 and draft.config.vocab_size == SMALL.vocab_size
    assert draft.config.resolved_head_dim == SMALL.resolved_head_dim
    embed = np.asarray(target.params["embed_vd"], np.float64)
    small = np.asarray(draft.params["embed_vd"], np.float64)
    # A projection onto the top right singular vectors keeps exactly the top singular values, up to
    # the float32 rounding of the stored table: measured 2.9e-8 relative; the bound is 4 float32 eps.
    np.testing.assert_allclose(np.linalg.svd(small, compute_uv=False), np.linalg.svd(embed, compute_uv=False)[:16],
                               rtol=4 * np.finfo(np.float32).eps)
    assert np.isfinite(np.asarray(draft.logits(np.array([[1, 2, 3]])))).all()


def test_draft_from_target_rejects_bad_sizes(small_pair):
    target, _ = small_pair
    with pytest.raises(ValueError, match="num_layers"):
        jaxspec.draft_from_target(target, num_layers=0)
    with pytest.raises(ValueError, match="num_layers"):
        jaxspec.draft_from_target(target, num_layers=SMALL.num_layers + 1)
    with pytest.raises(ValueError, match="hidden_size"):
        jaxspec.draft_from_target(target, num_layers=1, hidden_size=SMALL.hidden_size * 2)


# --- learning ---

@pytest.fixture(scope="module")
def acceptance_runs(bigram_target, tmp_path_factory):
    """One distillation per loss, sharing the generated data through the cache."""
    target = bigram_target
    draft = jaxspec.draft_from_target(target, num_layers=1, hidden_size=32, seed=1)
    train = _prompts(0, 64, target.config.vocab_size)
    heldout = _prompts(99, 16, target.config.vocab_size)
    assert not {tuple(p) for p in heldout} & {tuple(p) for p in train}
    cache = tmp_path_factory.mktemp("data")
    runs = {}
    for loss in distill_lib.LOSSES:
        trained, history = jaxspec.distill(
            target, draft, train, steps=120, learning_rate=1e-2, seed=0, loss=loss, batch_size=16,
            max_new_tokens=24, temperature=1.0, warmup_steps=10, data_cache=cache, heldout_prompts=heldout,
            progress=False)
        runs[loss] = (trained, history)
    return draft, heldout, runs


@pytest.mark.slow   # 26 s of training: quality, not losslessness (suite time)
@pytest.mark.parametrize("loss", distill_lib.LOSSES)
def test_distillation_raises_heldout_acceptance(bigram_target, acceptance_runs, loss):
    draft, heldout, runs = acceptance_runs
    trained, history = runs[loss]
    before = heldout_acceptance(bigram_target, draft, heldout, max_new_tokens=24)["acceptance_rate"]
    after = heldout_acceptance(bigram_target, trained, heldout, max_new_tokens=24)["acceptance_rate"]
    print(f"{loss}: held-out acceptance {before:.3f} -> {after:.3f}")
    # Measured on this setup: about 0.002 before and 0.6-0.95 after, depending on the loss.
    assert before < 0.05
    assert after > before + 0.4, (loss, before, after)
    # The history records the same measurements, before and after training.
    assert history["eval_step"] == [0, 120]
    assert history["acceptance_rate"][0] == pytest.approx(before)
    assert history["acceptance_rate"][-1] == pytest.approx(after)
    assert history["mean_accepted_length"][-1] > history["mean_accepted_length"][0]
    assert np.mean(history["loss"][-10:]) < 0.6 * np.mean(history["loss"][:5])
    assert trained.config == draft.config and trained.dtype == draft.dtype


# --- schedule, resumption and the data cache ---

# One set of settings for the small runs below, so they share compiled programs.
RUN = dict(steps=12, learning_rate=3e-3, seed=7, batch_size=5, max_new_tokens=6, temperature=1.0, warmup_steps=3,
           progress=False)
EVAL = dict(heldout_prompts=_prompts(5, 2, 64), eval_every=5, eval_max_new_tokens=4)


@pytest.fixture(scope="module")
def uninterrupted(small_pair):
    target, draft = small_pair
    return jaxspec.distill(target, draft, _prompts(0, 12, 64), **RUN, **EVAL)


@pytest.mark.slow   # its training fixture: 16 s (suite time)
def test_learning_rate_schedule_warms_up_then_decays(uninterrupted):
    _, history = uninterrupted
    lr = history["learning_rate"]
    assert len(lr) == len(history["loss"]) == 12 and history["step"] == list(range(1, 13))
    assert lr[0] == 0.0 and lr[3] == pytest.approx(3e-3)
    assert all(a < b for a, b in zip(lr[:3], lr[1:4]))
    assert all(a > b for a, b in zip(lr[3:], lr[4:]))
    # Entry s is the rate step s+1 ran with; the cosine reaches 10% of the peak at `steps`.
    assert 3e-4 < lr[-1] < 4e-4


class _Kill(Exception):
    pass


@pytest.mark.slow   # the same training fixture
def test_killed_run_resumes_to_the_same_params(small_pair, uninterrupted, tmp_path):
    target, draft = small_pair
    full, full_history = uninterrupted
    prompts = _prompts(0, 12, 64)

    def kill_at_10(step, metrics):
        if step == 10:
            raise _Kill

    ckpt = dict(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=4)
    with pytest.raises(_Kill):
        jaxspec.distill(target, draft, prompts, **ckpt, callback=kill_at_10, **RUN, **EVAL)
    steps_seen = []
    resumed, history = jaxspec.distill(target, draft, prompts, **ckpt, callback=lambda step, m: steps_seen.append(step),
                                       **RUN, **EVAL)
    assert steps_seen == [9, 10, 11, 12]  # restarted from the step-8 checkpoint
    # The same steps on the same batches from an exactly restored state: measured bit-identical.
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(full.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert history["loss"] == full_history["loss"]
    assert history["eval_step"] == full_history["eval_step"] == [0, 5, 10, 12]
    assert history["acceptance_rate"] == pytest.approx(full_history["acceptance_rate"])
    # A finished run resumed again does no more steps and returns the same draft.
    again, _ = jaxspec.distill(target, draft, prompts, **ckpt, callback=kill_at_10, **RUN, **EVAL)
    np.testing.assert_array_equal(np.asarray(again.params["embed_vd"]), np.asarray(resumed.params["embed_vd"]))
    with pytest.raises(ValueError, match="checkpoint_dir.*learning_rate"):
        jaxspec.distill(target, draft, prompts, **ckpt, **{**RUN, "learning_rate": 1e-3})


def test_data_cache_is_reused_on_restart(small_pair, tmp_path, monkeypatch, compile_counter):
    target, draft = small_pair
    calls = []
    real_generate = distill_lib.generate

    def counting_generate(*args, **kwargs):
        calls.append(1)
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(distill_lib, "generate", counting_generate)
    prompts = _prompts(0, 12, 64)
    cache = tmp_path / "data"
    first, _ = jaxspec.distill(target, draft, prompts, data_cache=cache, **RUN)
    assert len(calls) == 1 and (cache / "data.npz").exists()
    with compile_counter() as compiles:
        second, _ = jaxspec.distill(target, draft, prompts, data_cache=cache, **RUN)
    assert len(calls) == 1  # read from the cache, not generated again
    assert compiles.count == 0  # and the params are traced: the first run's train step is reused
    np.testing.assert_array_equal(np.asarray(first.params["embed_vd"]), np.asarray(second.params["embed_vd"]))
    # Data made another way (here: another sampling seed) are not reused.
    jaxspec.distill(target, draft, prompts, data_cache=cache, **{**RUN, "seed": 8})
    assert len(calls) == 2
    # A list of temperatures makes one set of continuations per temperature.
    jaxspec.distill(target, draft, prompts, data_cache=cache, **{**RUN, "temperature": [0.0, 1.0]})
    assert len(calls) == 4
    with np.load(cache / "data.npz") as data:
        assert data["tokens"].shape[0] == 2 * len(prompts)


def test_training_data_mask_covers_only_continuations():
    tokens, mask = distill_lib._pack([[5, 6, 7, 8, 9], [1, 2, 3]], [2, 1])
    assert tokens.shape == (2, 8)
    # Position j predicts token j + 1: the mask marks the predictions of generated tokens only.
    np.testing.assert_array_equal(mask[0], [0, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(mask[1], [1, 1, 0, 0, 0, 0, 0, 0])


def test_batch_order_is_a_function_of_seed_and_step():
    a = [batch_indices(3, s, 4, 10) for s in range(5)]
    b = [batch_indices(3, s, 4, 10) for s in range(5)]
    np.testing.assert_array_equal(np.concatenate(a), np.concatenate(b))
    flat = np.concatenate(a)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # whole epochs
    assert not np.array_equal(flat, np.concatenate([batch_indices(4, s, 4, 10) for s in range(5)]))


# --- bad input ---

def test_bad_input_names_the_argument(small_pair):
    target, draft = small_pair
    prompts = _prompts(0, 2, 64)
    ok = dict(steps=1, learning_rate=1e-3, progress=False, max_new_tokens=2)
    other_vocab = jaxspec.Model.random(SMALL.replace(vocab_size=32), seed=1)
    cases = [
        (dict(draft=other_vocab), "vocab_size"),
        (dict(steps=0), "steps"),
        (dict(prompts=[]), "prompts"),
        (dict(prompts=[[]]), "prompts"),
        (dict(loss="l2"), "loss"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(learning_rate=-1.0), "learning_rate"),
        (dict(batch_size=0), "batch_size"),
        (dict(temperature=-1.0), "temperature"),
        (dict(clip_norm=0.0), "clip_norm"),
        (dict(max_new_tokens=0), "max_new_tokens"),
    ]
    for change, name in cases:
        args = {"target": target, "draft": draft, "prompts": prompts, **ok, **change}
        with pytest.raises(ValueError, match=name):
            jaxspec.distill(args.pop("target"), args.pop("draft"), args.pop("prompts"), **args)
