"""Cost models: the fit recovers known coefficients, persistence round-trips, provenance is checked."""

import warnings

import numpy as np
import pytest

import jaxspec
from jaxspec.cost import CostModel, StepTimeTracker, fit_linear


def test_fit_recovers_known_coefficients_from_noisy_timings():
    rng = np.random.default_rng(0)
    true = np.array([2e-3, 3e-5, 4e-8, 5e-9])  # fixed, per batched token, per context slot, per attention pair
    grid = np.array([[1.0, b * t, b * s, b * t * s] for b in (1, 2, 4, 8, 16) for t in (1, 2, 4, 8)
                     for s in (128, 512, 2048)])
    seconds = grid @ true * rng.normal(1.0, 0.03, len(grid))  # 3% multiplicative noise
    coef, fit = fit_linear(grid, seconds)
    np.testing.assert_allclose(coef, true, rtol=0.1)
    assert fit["r2"] > 0.98 and fit["worst_heldout_rel_error"] < 0.15 and fit["heldout"] == len(grid) // 4


def test_fit_never_returns_negative_costs():
    rng = np.random.default_rng(1)
    x = np.array([[1.0, b] for b in range(1, 17)])
    y = 1e-3 + 0.0 * x[:, 1] + rng.normal(0, 1e-5, len(x))  # no per-token cost at all
    coef, _ = fit_linear(x, y)
    assert (coef >= 0).all() and coef[0] == pytest.approx(1e-3, rel=0.05)


def test_predictions_follow_the_contract():
    cost = CostModel.from_coefficients(draft_fixed=1.0, draft_per_token=0.1, target_fixed=2.0, target_per_token=0.01,
                                       target_per_context_token=0.001, target_per_attention=1e-4)
    assert cost.draft_seconds(8) == pytest.approx(1.8)
    assert cost.verify_seconds(40, 1000) == pytest.approx(2.0 + 0.4 + 1.0)
    assert cost.verify_seconds(40, 1000, 5000) == pytest.approx(2.0 + 0.4 + 1.0 + 0.5)
    # k = 3 at batch 8 with a 100-slot cache: 3 draft positions + a 32-token verification whose
    # attention computes 8 rows x 4 queries x 100 slots.
    assert cost.step_seconds(8, 3, 100) == pytest.approx(3 * 1.8 + 2.0 + 0.32 + 0.8 + 0.32)
    # Packed TETRIS: 20 tokens of token-wise work, attention still over the padded window.
    assert cost.step_seconds(8, 3, 100, packed_tokens=20) == pytest.approx(3 * 1.8 + 2.0 + 0.2 + 0.8 + 0.32)


def test_save_load_round_trip_and_device_warning(tmp_path):
    cost = CostModel.from_coefficients(draft_fixed=1e-3, draft_per_token=1e-5, target_fixed=4e-3, target_per_token=2e-5,
                                       target_per_context_token=1e-8, target_name="t", draft_name="d", dtype="float32",
                                       mesh_shape=(1, 4), device_kind="NVIDIA H100 80GB HBM3")
    path = tmp_path / "cost.json"
    cost.save(path)
    with pytest.warns(UserWarning, match="measured on 'NVIDIA H100 80GB HBM3'"):
        loaded = CostModel.load(path)
    assert loaded == cost and loaded.mesh_shape == (1, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CostModel.load(path, expect_device_kind="NVIDIA H100 80GB HBM3")


def test_bad_coefficients_and_files_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="target_per_token must be a finite number of seconds >= 0"):
        CostModel.from_coefficients(draft_fixed=0, draft_per_token=0, target_fixed=1, target_per_token=-1)
    (tmp_path / "bad.json").write_text('{"draft_fixed": 1}')
    with pytest.raises(ValueError, match="missing cost-model coefficients"):
        CostModel.load(tmp_path / "bad.json")


@pytest.mark.slow  # a minute of timing; the CLI profile test covers the path
def test_profile_predicts_the_steps_it_timed(tiny_model):
    """A real (small) profile: the fit reproduces its own timings, drafting and longer windows cost more."""
    draft = jaxspec.Model.random(tiny_model.config.replace(num_layers=1, name="tiny-1L"), seed=1)
    cost = CostModel.profile(tiny_model, draft, batches=(1, 4, 16), ks=(0, 1, 3), cache_lens=(64, 128), repeats=3)
    assert cost.target_name == "tiny" and cost.draft_name == "tiny-1L" and cost.device_kind
    assert cost.fit["step"]["points"] == 18
    # Step times of this tiny model are tens of microseconds, so single points are noisy; the fit
    # must still describe the typical point.
    errors = [abs(cost.step_seconds(b, k, s) / seconds - 1) for b, k, s, seconds in cost.fit["step"]["points_seconds"]]
    assert np.median(errors) < 0.5, errors
    assert cost.step_seconds(16, 3, 128) > cost.step_seconds(16, 0, 128) > 0
    with pytest.raises(ValueError, match="ks must include 0"):
        CostModel.profile(tiny_model, draft, ks=(1, 2))


# --- online correction ---

def run_segments(tracker, true_j, plans, steps=8, rng=None, noise=0.0):
    for plan in plans:
        jitter = 1.0 + (rng.normal(0, noise) if rng is not None else 0.0)
        tracker.observe(plan, steps, steps * true_j[plan] * jitter)


def test_tracker_follows_the_machines_drift_for_plans_it_has_not_run():
    predicted = np.array([1.0, 2.0, 3.0])
    tracker = StepTimeTracker(predicted)
    run_segments(tracker, 1.5 * predicted, [0] * 6)          # the machine is 1.5x slower than profiled
    np.testing.assert_allclose(tracker.corrected(), 1.5 * predicted, rtol=1e-9)


def test_tracker_learns_each_plans_own_error_under_noise():
    predicted = np.array([1.0, 2.0, 3.0])
    true = np.array([1.2, 2.0, 5.0])                          # plan 2 mispredicted by 40%
    tracker = StepTimeTracker(predicted)
    rng = np.random.default_rng(0)
    run_segments(tracker, true, [0, 1, 2] * 20, rng=rng, noise=0.1)
    np.testing.assert_allclose(tracker.corrected(), true, rtol=0.1)
    # Every segment records the prediction it was judged by: early ones wrong, late ones close.
    first, last = tracker.history[2], tracker.history[-1]
    assert first[0] == 2 and abs(first[2] / first[3] - 1) > 0.3 and abs(last[2] / last[3] - 1) < 0.2


def test_one_segment_moves_a_plan_only_part_way():
    tracker = StepTimeTracker(np.array([1.0, 1.0]), prior_steps=8.0)
    tracker.observe(0, 4, 4 * 1.0)    # plan 0 as predicted
    tracker.observe(1, 4, 4 * 3.0)    # one short segment says plan 1 is 3x dearer
    corrected = tracker.corrected()
    assert 1.0 < corrected[1] < 3.0 and corrected[0] < corrected[1]


def test_tracker_explores_close_untried_plans_only():
    tracker = StepTimeTracker(np.array([1.0, 1.0, 1.0]))
    tokens = np.array([1.0, 0.95, 0.5])                       # plan 1 is within 15% of plan 0, plan 2 is not
    assert tracker.explore(0, tokens) == 1
    tracker.observe(1, 4, 4.0)
    assert tracker.explore(0, tokens) is None
    # Trials are held to a tenth of the steps run: the next one waits until enough others ran.
    tracker = StepTimeTracker(np.ones(4))
    tokens = np.array([1.0, 0.95, 0.9, 0.5])
    assert tracker.explore(0, tokens) == 1
    tracker.observe(1, 4, 4.0, trial=True)
    assert tracker.explore(0, tokens) is None
    tracker.observe(0, 40, 40.0)
    assert tracker.explore(0, tokens) == 2
    with pytest.raises(ValueError, match="predicted_j"):
        StepTimeTracker(np.array([1.0, 0.0]))
