"""Meshes on 8 virtual CPU devices: sharded target, draft on its own slice, two-batch pipeline.

Every mode must reproduce the single-device output token for token (greedy), and the pipelined
engine must reproduce the sequential one exactly under sampling too (per-request RNG streams).
"""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import is_sharded, random_prompts

import jaxspec
from jaxspec.engine.sliced import balanced_split
from jaxspec.tools.benchmarking import layer_skip_pair

CFG = jaxspec.ModelConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4,
                          intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=False,
                          name="mesh-test")
# Very different lengths: one batch of the pipeline drains long before the other (the tail).
BUDGETS = [3, 40, 6, 28, 2, 33, 12, 20, 5]


@pytest.fixture(scope="module")
def pair():
    return layer_skip_pair(CFG, draft_layers=2, damping=0.3, sharpness=4.0)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(np.random.default_rng(0), [5, 11, 3, 17, 8, 2, 13, 6, 9], CFG.vocab_size)


@pytest.fixture(scope="module")
def reference(pair, prompts):
    target, _ = pair
    return jaxspec.generate(target, prompts, max_new_tokens=BUDGETS).tokens


def test_eight_virtual_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("mesh", [
    jaxspec.MeshConfig(target_tp=4, draft_tp=2),
    jaxspec.MeshConfig(target_dp=2, target_tp=2, draft_tp=2),
    jaxspec.MeshConfig(target_tp=2, draft_tp=0),
], ids=["tp4+draft2", "dp2xtp2+draft2", "tp2-shared"])
@pytest.mark.parametrize("selection", ["standard", "tetris"])
def test_mesh_greedy_equals_single_device(pair, prompts, reference, mesh, selection):
    target, draft = pair
    spec = jaxspec.SpecConfig(k=3, selection=selection, extra=2 if selection == "tetris" else 0)
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec, mesh=mesh)
    result = decoder.generate(prompts, max_new_tokens=BUDGETS)
    assert result.tokens == reference
    assert result.stats.accepted_tokens > 0
    # The big weights really are split over the target's tensor axis, not replicated.
    layer = decoder.target.params["layers"][0]
    for name in ("qkv_kxhd", "o_dnh", "gate_up_fxd", "down_df"):
        assert is_sharded(layer[name]), name
    assert is_sharded(decoder.target.params["lm_head_vd"])
    target_devices = set(mesh.target_mesh().devices.flat)
    assert layer["qkv_kxhd"].sharding.device_set == target_devices
    if mesh.separate_draft:
        draft_devices = set(mesh.draft_mesh().devices.flat)
        assert decoder.draft.params["embed_vd"].sharding.device_set == draft_devices
        assert not draft_devices & target_devices


def test_ngram_drafter_on_its_own_slice(pair, prompts, reference):
    target, _ = pair
    decoder = jaxspec.SpeculativeDecoder(target, jaxspec.NgramDrafter(max_ngram=2), spec=jaxspec.SpecConfig(k=3),
                                         mesh=jaxspec.MeshConfig(target_tp=2, draft_tp=1))
    assert decoder.generate(prompts, max_new_tokens=BUDGETS).tokens == reference


@pytest.mark.parametrize("selection", ["standard", "tetris"])
def test_pipelined_greedy_equals_target_with_a_long_tail(pair, prompts, reference, selection):
    target, draft = pair
    spec = jaxspec.SpecConfig(k=3, selection=selection, extra=1 if selection == "tetris" else 0, pipeline=True)
    mesh = jaxspec.MeshConfig(target_tp=2, draft_tp=2)
    result = jaxspec.SpeculativeDecoder(target, draft, spec=spec, mesh=mesh).generate(prompts,
                                                                                      max_new_tokens=BUDGETS)
    assert result.tokens == reference
    assert result.stats.extra["lanes"] == 2


@pytest.mark.parametrize("mesh, pipeline", [
    pytest.param(jaxspec.MeshConfig(target_tp=2, draft_tp=1), False, marks=pytest.mark.slow),   # 14 s
    (jaxspec.MeshConfig(target_tp=2, draft_tp=1), True),
    (jaxspec.MeshConfig(target_dp=2, target_tp=2, draft_tp=0), False),
], ids=["tp2+draft-slice", "tp2+draft-slice-pipelined", "dp2xtp2"])
def test_mesh_sampling_equals_single_program(pair, prompts, mesh, pipeline):
    """Standard selection: each row's random draws depend only on its request, so a sharded
    target (tensor, or data x tensor parallel), with the draft on its own slice or pipelined over
    two batches, must give exactly the single-program output, whose distribution the engine tests
    check against the target's (chi-square)."""
    target, draft = pair
    sampling = jaxspec.SamplingConfig(temperature=1.0, top_k=20)
    want = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=3), sampling=sampling).generate(
        prompts, max_new_tokens=BUDGETS, seed=7).tokens
    sharded = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=3, pipeline=pipeline),
                                         sampling=sampling, mesh=mesh)
    assert sharded.generate(prompts, max_new_tokens=BUDGETS, seed=7).tokens == want


def test_balanced_split_is_near_the_best_equal_size_partition():
    import itertools
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(2, 11))
        budgets = rng.integers(1, 200, n)
        a, b = balanced_split(budgets, n)
        assert sorted(np.concatenate([a, b]).tolist()) == list(range(n))
        assert abs(len(a) - len(b)) <= 1
        # Brute force over every split into halves of sizes floor/ceil(n/2): greedy largest-first
        # may miss the optimum but never by more than the largest single budget.
        best = min(abs(2 * budgets[list(c)].sum() - budgets.sum()) for c in itertools.combinations(range(n), n // 2))
        gap = abs(budgets[a].sum() - budgets[b].sum())
        assert best <= gap <= best + budgets.max(), (budgets.tolist(), gap, best)


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_tp=4, target_dp=2, draft_tp=1), "needs target_dp \\* target_tp \\+ draft_tp = 9 devices, but only 8"),
    (dict(target_tp=0), "target_tp must be an int >= 1, got 0"),
    (dict(draft_tp=-1), "draft_tp must be an int >= 0, got -1"),
])
def test_invalid_mesh_is_rejected(pair, kwargs, message):
    target, draft = pair
    with pytest.raises(ValueError, match=message):
        jaxspec.SpeculativeDecoder(target, draft, mesh=jaxspec.MeshConfig(**kwargs))


@pytest.mark.parametrize("field, value, message", [
    ("num_kv_heads", 2, "target_tp=4 does not divide num_kv_heads=2"),
    ("num_heads", 6, "target_tp=4 does not divide num_heads=6"),
    ("intermediate_size", 130, "target_tp=4 does not divide intermediate_size=130"),
])
def test_model_that_does_not_divide_the_tensor_axis_is_rejected(field, value, message):
    extra = {"num_kv_heads": 2, "hidden_size": 48} if field == "num_heads" else {}
    cfg = CFG.replace(**{field: value}, **extra)
    target = jaxspec.Model.random(cfg.replace(num_layers=1), seed=0)
    with pytest.raises(ValueError, match=message):
        jaxspec.SpeculativeDecoder(target, jaxspec.NgramDrafter(), mesh=jaxspec.MeshConfig(target_tp=4))


def test_draft_that_does_not_divide_its_slice_is_rejected(pair):
    target, _ = pair
    draft = jaxspec.Model.random(CFG.replace(num_layers=1, num_heads=3, num_kv_heads=1, hidden_size=48), seed=1)
    with pytest.raises(ValueError, match="draft_tp=2 does not divide num_heads=3"):
        jaxspec.SpeculativeDecoder(target, draft, mesh=jaxspec.MeshConfig(target_tp=2, draft_tp=2))


@pytest.mark.parametrize("pipeline,selection", [(False, "standard"),
                                                pytest.param(True, "standard", marks=pytest.mark.slow),  # 15 s
                                                pytest.param(True, "tetris", marks=pytest.mark.slow),   # 14 s
                                                pytest.param(False, "tetris", marks=pytest.mark.slow)],   # 9 s
                         ids=["draft-slice", "pipelined", "pipelined-tetris", "draft-slice-tetris"])
def test_goodput_on_two_slices_drafts_where_it_pays_and_equals_the_target(pair, prompts, reference, pipeline,
                                                                           selection, compile_counter):
    """The goodput policy with the draft on its own slice, sequential or pipelined, planning with
    the cost model as given: the longest draft length where it makes drafting free (this pair
    accepts most drafts; with TETRIS, its plan of k + extra drafts), plain decoding throughout
    where it makes the draft dear; the target's greedy output either way, and a second call
    compiles nothing."""
    target, draft = pair
    mesh = jaxspec.MeshConfig(target_tp=2, draft_tp=1)
    free = jaxspec.CostModel.from_coefficients(draft_fixed=0.0, draft_per_token=0.0, target_fixed=1e-2,
                                               target_per_token=1e-6)
    dear = jaxspec.CostModel.from_coefficients(draft_fixed=1.0, draft_per_token=0.0, target_fixed=1e-2,
                                               target_per_token=1e-6)
    longest = 4 if selection == "tetris" else 3
    for cost in (free, dear):
        decoder = jaxspec.SpeculativeDecoder(target, draft, mesh=mesh, spec=jaxspec.SpecConfig(
            k=3 if selection == "standard" else 2, extra=2 if selection == "tetris" else 0, selection=selection,
            policy="goodput", cost_model=cost, pipeline=pipeline))
        decoder.generate(prompts, max_new_tokens=BUDGETS, batch_size=4)
        with compile_counter() as counter:   # four slots for nine requests: refills on both slices
            result = decoder.generate(prompts, max_new_tokens=BUDGETS, batch_size=4)
        assert counter.count == 0, counter.names
        assert result.tokens == reference
        assert result.stats.extra["lanes"] == (2 if pipeline else 1)
        trace = result.stats.extra["k_trace"]
        if cost is free:
            assert result.stats.accepted_tokens > 0 and trace.count(longest) >= 0.9 * len(trace), trace
        else:
            assert set(trace) == {0} and result.stats.drafted_tokens == 0, trace


@pytest.mark.parametrize("pipeline", [pytest.param(False, marks=pytest.mark.slow), True],   # 4 s each
                         ids=["draft-slice", "pipelined"])
def test_goodput_on_two_slices_picks_the_longest_window_at_full_acceptance(pair, prompts, reference, pipeline):
    """The drafter is the target itself (every draft accepted) and drafting is free: every lane
    step verifies the longest window, k = 4, from the opening on."""
    target, _ = pair
    free = jaxspec.CostModel.from_coefficients(draft_fixed=0.0, draft_per_token=0.0, target_fixed=1e-2,
                                               target_per_token=1e-6)
    decoder = jaxspec.SpeculativeDecoder(target, target, mesh=jaxspec.MeshConfig(target_tp=2, draft_tp=2), spec=(
        jaxspec.SpecConfig(k=4, policy="goodput", cost_model=free, pipeline=pipeline)))
    result = decoder.generate(prompts, max_new_tokens=BUDGETS)
    assert set(result.stats.extra["k_trace"]) == {4}
    assert result.stats.acceptance_rate == 1.0 and result.tokens == reference


@pytest.mark.parametrize("pipeline,selection", [pytest.param(False, "standard", marks=pytest.mark.slow),   # 18 s each
                                                # pipelined sampling stays in the default suite in
                                                # test_batching (pipelined with refills, no policy)
                                                pytest.param(True, "standard", marks=pytest.mark.slow),
                                                pytest.param(True, "tetris", marks=pytest.mark.slow)],
                         ids=["draft-slice", "pipelined", "pipelined-tetris"])
def test_goodput_on_two_slices_is_lossless_under_sampling(pipeline, selection):
    """Exact distribution on a 6-token vocabulary, with the lanes' plans changing within the run
    (the optimistic prior drafts, the measured acceptance does not pay for this draft cost, the
    aged evidence probes drafting again), so tokens from drafting and from plain steps are both
    counted. Pipelined, drafting is hidden behind the other lane's verification up to its time,
    so the draft is made dearer there."""
    from exactness import VOCAB6_PROMPT, assert_matches_distribution, exact_joint, vocab6_models

    target, draft, _ = vocab6_models()
    sampling = jaxspec.SamplingConfig(temperature=0.7, top_k=3)
    cost = jaxspec.CostModel.from_coefficients(draft_fixed=8e-3 if pipeline else 3e-3,
                                               draft_per_token=0.0, target_fixed=5e-3, target_per_token=0.0)
    spec = jaxspec.SpecConfig(k=2 if selection == "standard" else 1, extra=1 if selection == "tetris" else 0,
                              selection=selection, policy="goodput", cost_model=cost,
                              pipeline=pipeline)
    rows = 2000
    result = jaxspec.SpeculativeDecoder(target, draft, spec=spec, sampling=sampling, mesh=jaxspec.MeshConfig(
        target_tp=1, draft_tp=1)).generate([VOCAB6_PROMPT] * rows, max_new_tokens=6, seed=37, batch_size=1000)
    assert_matches_distribution([t[:4] for t in result.tokens], exact_joint(target, VOCAB6_PROMPT, 4, sampling), rows)
    trace = result.stats.extra["k_trace"]
    assert 0 in trace and max(trace) > 0, trace


def test_plan_seconds_add_up_sequentially_and_overlap_when_pipelined():
    """Sequential: a step is the cost model's whole step (`CostModel.step_seconds`). Pipelined (a
    lane step): the drafting and the verification it is split into run at once, so the longer one."""
    from jaxspec.engine.plans import StepPlan, plan_seconds

    cost = jaxspec.CostModel.from_coefficients(draft_fixed=2e-3, draft_per_token=1e-5, target_fixed=5e-3,
                                               target_per_token=2e-5, target_per_context_token=1e-8,
                                               target_per_attention=1e-9, speculation_fixed=1e-4,
                                               speculation_per_row=1e-6)
    ks = (0, 1, 2, 3, 4)
    plans = [StepPlan(k=k) for k in ks] + [StepPlan(k=4, capacity=12)]
    whole = [cost.step_seconds(8, k, 256) for k in ks] + [cost.step_seconds(8, 4, 256, packed_tokens=8 + 12)]
    sequential = plan_seconds(cost, 8, plans, 256)
    pipelined = plan_seconds(cost, 8, plans, 256, pipelined=True)
    np.testing.assert_allclose(sequential, whole, rtol=1e-6)
    for plan, both, longer in zip(plans, whole, pipelined):
        drafting = plan.k * (2e-3 + 8 * 1e-5)
        assert longer == pytest.approx(max(drafting, both - drafting), rel=1e-6)
    assert pipelined[0] == sequential[0] and pipelined[4] > pipelined[1]   # the draft outgrows the verification
    # A hybrid's free plan skips the draft model: the step less its draft positions, or `cost.free`'s step
    # in plain steps (profiled at another time: on this machine, at another speed).
    free_plans = [StepPlan(k=k, free=True) for k in ks[1:]]
    np.testing.assert_allclose(plan_seconds(cost, 8, free_plans, 256),
                               [whole[k] - k * (2e-3 + 8 * 1e-5) for k in ks[1:]], rtol=1e-6)
    alone = jaxspec.CostModel.from_coefficients(draft_fixed=0, draft_per_token=1e-6, target_fixed=4e-3,
                                                target_per_token=3e-5)
    np.testing.assert_allclose(plan_seconds(dataclasses.replace(cost, free=alone), 8, plans + free_plans, 256),
                               whole + [(4e-3 + 3e-5 * 8 * (k + 1) + k * 8e-6) * whole[0] / (4e-3 + 3e-5 * 8)
                                        for k in ks[1:]], rtol=1e-6)


@pytest.mark.slow  # two processes, 45 s
def test_two_processes_on_localhost_share_one_mesh(tmp_path):
    """jax.distributed with a local coordinator: the target's tensor axis spans two processes, and
    each process gets the single-device greedy output (scripts/multihost_smoke.py)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "multihost_smoke.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = tmp_path / "smoke.json"
    run = subprocess.run([sys.executable, str(script), "--output", str(out), "--timeout", "300"], env=env,
                         capture_output=True, text=True, timeout=400)
    summary = json.loads(out.read_text())
    assert run.returncode == 0, summary.get("output_tails")
    assert [r["global_devices"] for r in summary["reports"]] == [4, 4]
    assert all(r["same_as_single_device"] for r in summary["reports"])
