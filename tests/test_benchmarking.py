"""Benchmark helpers: the bootstrap interval of a median covers the true median as often as it claims;
the skeleton pair agrees with its target exactly without its layers and less as they grow louder;
prompt sets share one shape; weight parking swaps one group of models in at a time, unchanged."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.tools import benchmarking
from jaxspec.tools.benchmarking import heldout_best_ratios, median_interval, skeleton_pair


def test_median_interval_covers_the_true_median_about_as_often_as_its_level():
    """30 rounds of lognormal ratios (true median 0.96, about 4% spread), 400 independent runs:
    the 90% interval holds the true median in 84-96% of them, and its width shrinks with more
    rounds as 1/sqrt(rounds)."""
    rng = np.random.default_rng(0)
    true = 0.96
    hits, widths = 0, []
    for trial in range(400):
        x = true * np.exp(rng.normal(0.0, 0.04, 30))
        lo, hi = median_interval(x, level=0.9, resamples=500, seed=trial)
        hits += lo <= true <= hi
        widths.append(hi - lo)
    assert 0.84 <= hits / 400 <= 0.96, hits
    wide = np.median(widths)
    narrow = np.median([np.subtract(*median_interval(true * np.exp(rng.normal(0.0, 0.04, 120)), resamples=500,
                                                     seed=s)[::-1]) for s in range(100)])
    assert 0.35 < narrow / wide < 0.65, (narrow, wide)
    with pytest.raises(ValueError, match="level"):
        median_interval([], level=0.9)
    with pytest.raises(ValueError, match="level"):
        median_interval([1.0, 2.0], level=1.5)


def test_heldout_best_ratios_are_unbiased_where_picking_on_the_same_rounds_is_not():
    """Six fixed configurations tied in truth and a method as fast as them, on a machine whose
    speed drifts from round to round, with 6% noise per run (300 simulated 16-round benchmarks):
    against the best fixed configuration picked by its median over the same rounds the method
    looks about 1% slower; against the pick made without each round it is even (the
    mean of the medians within 0.5% of 1). Where one configuration is clearly fastest both picks
    are it, and the ratios are the plain per-round ones. The definition, by hand on three rounds."""
    rng = np.random.default_rng(0)
    fixed = ["k1", "k2", "k3", "k4", "k5", "k6"]
    same_rounds, heldout = [], []
    for _ in range(300):
        drift = np.exp(rng.normal(0.0, 0.2, 16))
        secs = {name: drift * np.exp(rng.normal(0.0, 0.06, 16)) for name in fixed + ["policy"]}
        best = min(fixed, key=lambda name: np.median(secs[name]))
        same_rounds.append(np.median(secs[best] / secs["policy"]))
        heldout.append(np.median(heldout_best_ratios(secs, fixed, "policy")))
    assert np.mean(same_rounds) < 0.995, np.mean(same_rounds)
    assert abs(np.mean(heldout) - 1.0) < 0.005, np.mean(heldout)

    drift = np.exp(rng.normal(0.0, 0.2, 16))
    secs = {"fast": 0.8 * drift * np.exp(rng.normal(0.0, 0.01, 16)), "slow": drift,
            "policy": drift * np.exp(rng.normal(0.0, 0.01, 16))}
    np.testing.assert_allclose(heldout_best_ratios(secs, ["fast", "slow"], "policy"), secs["fast"] / secs["policy"])

    secs = {"a": [1.0, 3.0, 2.0], "b": [2.0, 2.0, 2.5], "m": [1.0, 1.0, 1.0]}
    # Without round 0, a's median is 2.5 and b's 2.25: b, whose round 0 took 2.0. Without round 1:
    # a (1.5 against 2.25), 3.0 in round 1. Without round 2: a (2.0) ties b (2.0), the first kept: 2.0.
    np.testing.assert_allclose(heldout_best_ratios(secs, ["a", "b"], "m"), [2.0, 3.0, 2.0])
    with pytest.raises(ValueError, match="at least 2 rounds"):
        heldout_best_ratios({"a": [1.0], "m": [1.0]}, ["a"], "m")
    with pytest.raises(ValueError, match="at least one candidate"):
        heldout_best_ratios(secs, [], "m")


def test_skeleton_pair_has_its_own_shapes_and_an_acceptance_set_by_its_damping():
    """A draft narrower and shallower than its target: with its layers silenced (damping 0) the
    draft's argmax equals the target's at every position in float32 (both compute the same bigram
    map; in bfloat16 rounding breaks a near-tie now and then); louder layers make them disagree
    more (agreement strictly falls with damping); the weights are those of each config's shape
    and dtype, and a pair that cannot share a vocabulary or would need a wider draft is refused."""
    target_cfg = jaxspec.ModelConfig(vocab_size=512, hidden_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                                     intermediate_size=192, max_position_embeddings=256, tie_word_embeddings=True,
                                     attention_bias=True, name="t")
    draft_cfg = target_cfg.replace(hidden_size=64, num_layers=2, intermediate_size=128, name="d")
    tokens = np.random.default_rng(0).integers(0, 512, (4, 48))
    agreement = []
    for dtype, damping in (("float32", 0.0), ("float32", 0.02), ("float32", 0.3), ("bfloat16", 0.0)):
        target, draft = skeleton_pair(target_cfg, draft_cfg, damping=damping, sharpness=4.0, dtype=dtype)
        assert target.params["layers"][0]["qkv_kxhd"].shape[-1] == 96
        assert draft.params["layers"][0]["qkv_kxhd"].shape[-1] == 64
        assert len(target.params["layers"]) == 3 and len(draft.params["layers"]) == 2
        assert target.dtype == draft.dtype == np.dtype(dtype)
        agree = np.asarray(target.logits(tokens)).argmax(-1) == np.asarray(draft.logits(tokens)).argmax(-1)
        agreement.append(float(agree.mean()))
    assert agreement[0] == 1.0, agreement
    assert 1.0 > agreement[1] > agreement[2], agreement
    assert agreement[3] >= 0.98, agreement
    with pytest.raises(ValueError, match="vocab"):
        skeleton_pair(target_cfg, draft_cfg.replace(vocab_size=256), damping=0.1)
    with pytest.raises(ValueError, match="width"):
        skeleton_pair(draft_cfg, target_cfg, damping=0.1)


def test_prompt_sets_share_their_lengths_and_differ_in_their_tokens():
    """Every set has the first set's prompt lengths (one compiled shape for all of them), within
    8-47 tokens and the vocabulary; the sets' tokens differ; a seed reproduces them."""
    sets = benchmarking.prompt_sets(vocab_size=50, batch=6, count=4, seed=3)
    assert len(sets) == 4 and all(len(s) == 6 for s in sets)
    lengths = [len(p) for p in sets[0]]
    assert all([len(p) for p in s] == lengths for s in sets) and all(8 <= n < 48 for n in lengths)
    assert all(0 <= t < 50 for s in sets for p in s for t in p)
    assert len({str(s) for s in sets}) == 4
    assert benchmarking.prompt_sets(vocab_size=50, batch=6, count=4, seed=3) == sets


def test_first_differences_name_where_each_row_parts():
    """None for an equal row, the first differing position otherwise, the shorter length where one
    row is a prefix of the other."""
    assert benchmarking.first_differences([[1, 2, 3], [1, 2, 3], [1, 2, 3]],
                                          [[1, 2, 3], [1, 5, 3], [1, 2]]) == [None, 1, 2]


def test_weight_parking_holds_one_group_and_restores_it_unchanged(tmp_path):
    """Holding one group parks the other's weights (a jaxspec model's params, a torch module's
    parameter storage) and brings its own back from the files unchanged; a decoder built before
    the swaps decodes as before; round_robin calls `before` ahead of every call, warm-up included;
    a resident parking never parks."""
    torch = pytest.importorskip("torch")
    cfg = jaxspec.ModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                              intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=True, name="p")
    model = jaxspec.Model.random(cfg, seed=0)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(model.params)]
    expected = jaxspec.generate(model, [[1, 2, 3]], max_new_tokens=4).tokens
    linear = torch.nn.Linear(8, 4)
    weight = linear.weight.detach().clone()
    parking = benchmarking.WeightParking(tmp_path)
    parking.add("jax", [model])
    parking.add("torch", [linear])
    calls = []
    fns = {"jax": lambda on_finish: (calls.append(("jax", model.params is not None and linear.weight.numel() == 0)),
                                     jaxspec.generate(model, [[1, 2, 3]], max_new_tokens=4))[1],
           "torch": lambda on_finish: (calls.append(("torch", model.params is None and linear.weight.numel() == 32)),
                                       SimpleNamespace(tokens=[[0]]))[1]}
    results, seconds, _ = benchmarking.round_robin(fns, 2, before=parking.hold)
    assert calls == [("jax", True), ("torch", True)] * 3
    assert results["jax"].tokens == expected and seconds["jax"].shape == (2,)
    parking.hold("jax")
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(model.params), strict=True))
    parking.hold("torch")
    assert torch.equal(linear.weight, weight) and model.params is None
    assert parking.swaps == 7   # every hold but the first brought a group back from its files
    resident = benchmarking.WeightParking(tmp_path / "r", resident=True)
    resident.add("jax", [model])
    resident.hold(None)
    assert model.params is None   # still parked by `parking`; a resident parking touches nothing
