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


def test_fit_points_recovers_every_step_coefficient_including_the_cost_of_speculating():
    """Synthetic steps over the profile's grid, from known coefficients with multiplicative noise:
    the fit recovers them, and predicts plain decoding and k = 1 at batch 1 (where the old model,
    linear in k, was 75% off) within a few percent."""
    true = CostModel.from_coefficients(draft_fixed=4e-4, draft_per_token=2e-6, target_fixed=1.2e-3,
                                       target_per_token=1e-4, target_per_context_token=2e-7,
                                       target_per_attention=5e-8, speculation_fixed=1.5e-3,
                                       speculation_per_row=8e-5)
    rng = np.random.default_rng(4)
    points = [(b, k, s, true.step_seconds(b, k, s) * rng.normal(1.0, 0.02))
              for b in (1, 2, 4, 8, 16, 32, 64) for k in (0, 1, 2, 4, 6) for s in (128, 256)]
    fitted = CostModel.fit_points(points, target_name="t")
    for name in ("target_fixed", "target_per_token", "speculation_fixed", "speculation_per_row"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=0.25), name
    for b, k in ((1, 0), (1, 1), (64, 0), (64, 1), (16, 4)):
        assert fitted.step_seconds(b, k, 200) == pytest.approx(true.step_seconds(b, k, 200), rel=0.05), (b, k)
    assert fitted.fit["step"]["points"] == len(points) and fitted.target_name == "t"
    # Without the speculation terms the same points cannot be described.
    x = np.array([[k, k * b, 1.0, b * (k + 1), b * s, b * (k + 1) * s] for b, k, s, _ in points])
    _, linear_in_k = fit_linear(x, np.array([p[3] for p in points]))
    assert linear_in_k["worst_heldout_rel_error"] > 2 * fitted.fit["step"]["worst_heldout_rel_error"]


def test_fit_points_leaves_out_timings_that_noise_made_near_zero_or_stalled():
    """A loaded machine once timed a plain step at the 1e-7 s floor, and the relative fit, weighing
    that point by 1 / y, set every verification coefficient to 0. The same synthetic profile as
    above with two such points and a stalled one: the fit still recovers the true step times and
    reports the three points it left out."""
    true = CostModel.from_coefficients(draft_fixed=4e-4, draft_per_token=2e-6, target_fixed=1.2e-3,
                                       target_per_token=1e-4, target_per_context_token=2e-7,
                                       target_per_attention=5e-8, speculation_fixed=1.5e-3,
                                       speculation_per_row=8e-5)
    rng = np.random.default_rng(5)
    shapes = [(b, k, s) for b in (1, 2, 4, 8, 16, 32, 64) for k in (0, 1, 2, 4, 6) for s in (128, 256)]
    points = [(b, k, s, true.step_seconds(b, k, s) * rng.normal(1.0, 0.02)) for b, k, s in shapes]
    for i, seconds in ((shapes.index((1, 0, 128)), 1e-7), (shapes.index((4, 0, 256)), 1e-7),
                       (shapes.index((2, 1, 128)), 8 * true.step_seconds(2, 1, 128))):
        points[i] = (*shapes[i], seconds)
    fitted = CostModel.fit_points(points)
    assert fitted.fit["step"]["outliers"] == 3
    for b, k, s in shapes:
        assert fitted.step_seconds(b, k, s) == pytest.approx(true.step_seconds(b, k, s), rel=0.05), (b, k, s)
    # Clean timings lose nothing.
    clean = [(b, k, s, true.step_seconds(b, k, s)) for b, k, s in shapes]
    assert CostModel.fit_points(clean).fit["step"]["outliers"] == 0


def test_a_step_timing_is_never_far_below_the_loops_average_step(tiny_model, monkeypatch):
    """`time_steps` takes a step as (loop of 7 steps - loop of 1) / 6. On a clock where every
    one-step loop stalls for longer than six steps take, that difference is negative; the timing
    falls back to a tenth of the long loop's average step instead of a floor of zero."""
    import types

    from jaxspec.drafters import NgramDrafter
    from jaxspec.engine import loop

    step, stall, now = 1e-3, 1e-2, [0.0]

    def timed_loop(*args, **kwargs):
        steps = int(args[-1])
        now[0] += steps * step + (stall if steps == 1 else 0.0)
        return args[6]

    monkeypatch.setattr(loop, "_steps_loop", timed_loop)
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    drafter = NgramDrafter().bind_vocab(tiny_model.config.vocab_size)
    seconds = loop.time_steps(tiny_model, drafter, 0, 1, 64, repeats=2)
    assert seconds == pytest.approx(0.1 * step)   # the long loop's average: 7 steps in 7 steps' time
    stall = 0.0   # and a quiet clock gives the step itself
    assert loop.time_steps(tiny_model, drafter, 0, 1, 64, repeats=2) == pytest.approx(step)


def test_a_profile_compiles_its_grid_side_by_side_before_it_times(tiny_model, compile_counter, monkeypatch):
    """`time_points` first compiles every shape's programs (`loop.warm_steps`), on as many threads
    as the host has cores; its timing passes then compile nothing, and every shape is timed."""
    import os
    import threading

    from jaxspec.cost import time_points
    from jaxspec.drafters import NgramDrafter
    from jaxspec.engine import loop

    shapes = [(1, 0, 96), (1, 2, 96), (2, 1, 96), (2, 2, 128)]
    real_time, real_warm = loop.time_steps, loop.warm_steps
    warmed, threads, compiled_while_timing = [], set(), []

    def warm(target, drafter, k, batch, cache_len, **kwargs):
        threads.add(threading.get_ident())
        warmed.append((batch, k, cache_len))
        return real_warm(target, drafter, k, batch, cache_len, **kwargs)

    def timed(*args, **kwargs):
        with compile_counter() as counter:
            seconds = real_time(*args, **kwargs)
        compiled_while_timing.extend(counter.names)
        return seconds

    monkeypatch.setattr(loop, "warm_steps", warm)
    monkeypatch.setattr(loop, "time_steps", timed)
    drafter = NgramDrafter().bind_vocab(tiny_model.config.vocab_size)
    with compile_counter() as counter:
        points = time_points(tiny_model, drafter, shapes, passes=2)
    assert sorted(warmed) == sorted(shapes) and counter.count > 0
    assert len(threads) == min(len(shapes), len(os.sched_getaffinity(0)))
    assert compiled_while_timing == []
    assert [point[:3] for point in points] == shapes and all(point[3] > 0 for point in points)


def test_speculation_terms_apply_only_to_drafting_steps():
    cost = CostModel.from_coefficients(draft_fixed=0.0, draft_per_token=0.0, target_fixed=1.0, target_per_token=0.0,
                                       speculation_fixed=2.0, speculation_per_row=0.5)
    assert cost.step_seconds(4, 0, 10) == pytest.approx(1.0)
    assert cost.step_seconds(4, 1, 10) == pytest.approx(1.0 + 2.0 + 2.0)
    assert cost.step_seconds(4, 5, 10, packed_tokens=9) == pytest.approx(1.0 + 2.0 + 2.0)


def test_fit_never_returns_negative_costs():
    rng = np.random.default_rng(1)
    x = np.array([[1.0, b] for b in range(1, 17)])
    y = 1e-3 + 0.0 * x[:, 1] + rng.normal(0, 1e-5, len(x))  # no per-token cost at all
    coef, _ = fit_linear(x, y)
    assert (coef >= 0).all() and coef[0] == pytest.approx(1e-3, rel=0.05)


def test_nonnegative_fit_is_the_best_over_every_set_of_free_coefficients():
    """On noisy sub-millisecond profiles (the step model's 8 columns), the fit equals the brute-force
    optimum: the least-squares solution of every subset of columns, kept where all its coefficients
    are >= 0, the smallest residual of those (coefficients outside the subset are 0)."""
    import itertools

    from jaxspec.cost import _nonnegative_lstsq

    rng = np.random.default_rng(7)
    for trial in range(20):
        points = [(b, k, s) for b in (1, 4) for k in (0, 1, 2) for s in (64, 128)]
        x = np.array([[k, k * b, 1.0, b * (k + 1), b * s, b * (k + 1) * s, float(k > 0), float(k > 0) * b]
                      for b, k, s in points])
        truth = rng.uniform(0, 1, 8) * np.array([3e-5, 1e-6, 5e-5, 1e-6, 1e-8, 1e-9, 2e-5, 1e-6])
        y = (x @ truth) * rng.lognormal(0.0, 0.3, len(points))   # timing noise of 30%
        a, t = x / y[:, None], np.ones(len(y))                     # relative errors, as fit_linear weighs
        best_residual = np.inf
        for size in range(1, 9):
            for subset in itertools.combinations(range(8), size):
                sol = np.linalg.lstsq(a[:, subset], t, rcond=None)[0]
                if (sol >= -1e-12).all():
                    coef = np.zeros(8)
                    coef[list(subset)] = sol
                    residual = np.sum((a @ coef - t) ** 2)
                    if residual < best_residual - 1e-12:
                        best_residual = residual
        got = _nonnegative_lstsq(a, t)
        assert (got >= 0).all()
        assert np.sum((a @ got - t) ** 2) == pytest.approx(best_residual, rel=1e-6, abs=1e-12), trial
        assert (x[[k == 0 for _, k, _ in points]] @ got > 0).all()    # a plain step is never free


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


def test_tracker_takes_the_round_trip_out_of_segments_of_any_length():
    """Segments cost steps * step time + a fixed round trip: with the round trip known, short and
    long segments give the same per-step times, and each segment's prediction adds it back."""
    predicted = np.array([1.0, 2.0])
    true, round_trip = np.array([1.5, 3.0]), 2.0
    tracker = StepTimeTracker(predicted, round_trip=round_trip)
    for plan, steps in [(0, 4), (1, 64), (0, 4), (1, 32), (0, 8)]:
        tracker.observe(plan, steps, steps * true[plan] + round_trip)
    np.testing.assert_allclose(tracker.corrected(), true, rtol=1e-9)
    tracker.observe(1, 4, 4 * true[1] + round_trip)
    plan, steps, predicted_per_step, measured_per_step = tracker.history[-1]
    assert predicted_per_step == pytest.approx(measured_per_step) == pytest.approx(true[1] + round_trip / 4)
    # Without it, the 4-step segments look dearer per step than the long ones.
    naive = StepTimeTracker(predicted)
    for plan, steps in [(0, 4), (1, 64), (0, 4), (1, 32), (0, 8)]:
        naive.observe(plan, steps, steps * true[plan] + round_trip)
    assert naive.corrected()[0] > 1.1 * true[0]
    with pytest.raises(ValueError, match="round_trip"):
        StepTimeTracker(predicted, round_trip=-1.0)


def test_tracker_corrects_untried_plans_by_the_error_of_their_kind():
    """The profile got plain steps right and drafting steps 2x too fast: an untried drafting plan
    follows the drafting plans' error, not the average over all plans."""
    predicted = np.array([1.0, 2.0, 3.0, 4.0])
    true = predicted * np.array([1.0, 2.0, 2.0, 2.0])
    tracker = StepTimeTracker(predicted, kinds=[False, True, True, True])
    run_segments(tracker, true, [0, 1] * 6, steps=32)
    # (A kind's ratio is itself shrunk toward the overall one by a few steps' worth.)
    np.testing.assert_allclose(tracker.corrected(), true, rtol=0.05)
    one_kind = StepTimeTracker(predicted)
    run_segments(one_kind, true, [0, 1] * 6, steps=32)
    assert one_kind.corrected()[3] < 0.85 * true[3]
    with pytest.raises(ValueError, match="kinds"):
        StepTimeTracker(predicted, kinds=[True, False])


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
    tracker.observe(0, 40, 40.0)
    assert tracker.explore(0, tokens) == 1
    tracker.observe(1, 4, 4.0)
    assert tracker.explore(0, tokens) is None
    # Trials are held to a tenth of the run's time, their own included: a trial waits until
    # enough else ran, and the next one too.
    tracker = StepTimeTracker(np.ones(4))
    tokens = np.array([1.0, 0.95, 0.9, 0.5])
    tracker.observe(0, 30, 30.0)
    assert tracker.explore(0, tokens, steps=4) is None          # 4 s of trial in 34 s: too much
    tracker.observe(0, 10, 10.0)
    assert tracker.explore(0, tokens, steps=4) == 1             # 4 s in 44 s
    tracker.observe(1, 4, 4.0, trial=True)
    assert tracker.explore(0, tokens, steps=4) is None
    tracker.observe(0, 40, 40.0)
    assert tracker.explore(0, tokens, steps=4) == 2
    assert tracker.explore(0, tokens, steps=40) is None         # a longer trial is dearer
    # Plans measured at the run's shape before it started are not trialled again.
    tracker = StepTimeTracker(np.ones(3), measured=[True, True, False])
    tracker.observe(0, 40, 40.0)
    assert tracker.explore(0, np.array([1.0, 0.99, 0.5])) is None
    assert tracker.explore(0, np.array([1.0, 0.99, 0.98])) == 2
    assert tracker.explore(1, np.array([0.99, 1.0, 0.5]), baseline=0) is None
    with pytest.raises(ValueError, match="predicted_j"):
        StepTimeTracker(np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="measured"):
        StepTimeTracker(np.ones(3), measured=[True])


def test_tracker_trials_the_plain_decoding_baseline_first_and_outside_the_budget():
    tracker = StepTimeTracker(np.ones(4))
    tokens = np.array([0.9, 1.0, 0.98, 0.5])          # baseline (plan 0) within 15% of the chosen plan 1
    tracker.observe(2, 4, 4.0, trial=True)             # the trial budget is spent
    assert tracker.explore(1, tokens) is None
    assert tracker.explore(1, tokens, baseline=0) == 0
    tracker.observe(0, 4, 4.0, trial=True)
    assert tracker.explore(1, tokens, baseline=0) is None          # measured once is enough
    far = StepTimeTracker(np.ones(3))
    far.observe(1, 40, 40.0)
    assert far.explore(1, np.array([0.5, 1.0, 0.99]), baseline=0) == 2   # not within the margin


def test_tracker_trials_a_plan_whose_warm_up_time_the_other_kinds_error_contradicts():
    """A warm-up timed the drafting plans 20x too cheap: the run drafts, measures drafting 20x
    dearer, and scales the plain plan (whose kind has not run) up by the same error, so by the
    corrected times alone the run would draft for good. The plain plan, judged by its own
    warm-up time, is within the margin: it is trialled (outside the budget, as the baseline),
    and once measured the corrected times rank it first."""
    measured_time = np.array([1.0, 0.1, 0.15])
    true = np.array([1.0, 2.0, 3.0])
    tokens = np.array([1.0, 1.6, 2.0])
    tracker = StepTimeTracker(measured_time, kinds=[False, True, True], measured=[True, True, True])
    run_segments(tracker, true, [1, 1, 1])
    corrected = tracker.corrected()
    assert np.argmax(tokens / corrected) == 1 and corrected[0] > 10    # plain looks 20x dearer
    assert tracker.explore(1, tokens, baseline=0) == 0
    # Not named the baseline, it waits for the budget (priced at its corrected time).
    assert tracker.explore(1, tokens) is None
    run_segments(tracker, true, [0], steps=32)
    assert np.argmax(tokens / tracker.corrected()) == 0
    assert tracker.explore(0, tokens, baseline=0) is None
    # Scaled down by the other kind's drift, a plan still far behind is not trialled (the batch-64
    # case: plain decoding ran 20% faster than its warm-up, the drafting plans are 30% behind).
    fast = StepTimeTracker(np.array([1.0, 2.3, 3.5]), kinds=[False, True, True], measured=[True] * 3)
    run_segments(fast, np.array([0.8, 1.84, 2.8]), [0] * 3)
    assert fast.explore(0, np.array([1.0, 1.6, 2.0]), baseline=0) is None


def test_tracker_trials_a_close_plan_that_the_other_kinds_error_scales_down():
    """Batch 1 as one benchmark's warm-up timed it: plain decoding 26% dear, drafting (k = 6, 4
    tokens a step) 45% dear, so the run decodes plainly. Plain decoding runs at 0.79 of its
    warm-up time; drafting, not run, takes that ratio and still looks 1% behind. Scaled down by
    more than the margin, it is in doubt: trialled once the budget allows (the seventh call here),
    after which the corrected times rank it first, as the true times do. At a ratio within the
    margin it would not have been."""
    true = np.array([0.72, 2.47])
    warm = np.array([0.905, 3.65])
    tokens = np.array([1.0, 3.99])
    assert np.argmax(tokens / true) == 1
    tracker = StepTimeTracker(warm, kinds=[False, True], measured=[True, True], round_trip=1.45)
    proposals = []
    for _ in range(7):
        tracker.new_call()
        tracker.observe(0, 95, 95 * true[0] + 1.45)
        corrected = tracker.corrected()
        assert np.argmax(tokens / corrected) == 0 and tokens[1] / corrected[1] > 0.98 * tokens[0] / corrected[0]
        proposals.append(tracker.explore(0, tokens, baseline=0, steps=16))
    # A 16-step trial (48 s) fits a tenth of the time observed from the seventh call on.
    assert proposals == [None] * 6 + [1]
    tracker.observe(1, 16, 16 * true[1] + 1.45, trial=True)
    assert np.argmax(tokens / tracker.corrected()) == 1
    # Plain decoding 10% faster than its warm-up (within the margin): drafting keeps its place.
    within = StepTimeTracker(np.array([0.8, 2.6]), kinds=[False, True], measured=[True, True], round_trip=1.45)
    for _ in range(6):
        within.new_call()
        within.observe(0, 95, 95 * 0.72 + 1.45)
    assert within.explore(0, np.array([1.0, 3.2]), baseline=0, steps=16) is None


def test_a_short_trial_of_the_contradicted_plan_is_not_drowned_by_the_other_kinds_error():
    """As above, but the plain trial is cut to 7 steps (a row finished) and drafting runs on after
    it: the overall ratio, mostly drafting's 20x, pulls plain decoding's own ratio by at most the
    margin, so it stays first for the segments its measurement lasts (shrunk toward the overall
    ratio by its prior, the trial alone had left it 2.7x dear), and is in doubt again, not
    condemned, once drafting's newer segments have decayed it below a run."""
    measured_time, true = np.array([1.0, 0.15, 0.25]), np.array([1.0, 3.0, 5.0])
    tokens = np.array([1.0, 1.1, 1.11])
    tracker = StepTimeTracker(measured_time, kinds=[False, True, True], measured=[True] * 3, round_trip=0.5)
    for steps in (64, 24):
        tracker.observe(1, steps, steps * true[1] + 0.5)
    assert tracker.explore(1, tokens, baseline=0) == 0
    tracker.observe(0, 7, 7 * true[0] + 0.5, trial=True)
    for n in range(12):
        corrected = tracker.corrected()
        assert np.argmax(tokens / corrected) == 0 and corrected[0] < 1.15 * true[0], (n, corrected)
        tracker.observe(1, 24, 24 * true[1] + 0.5)       # the device's choice ran on (as it may)
    for _ in range(30):
        tracker.observe(1, 24, 24 * true[1] + 0.5)
    assert tracker.explore(1, tokens, baseline=0) == 0


def test_a_trialled_plan_is_not_contradicted_again_until_its_timing_is_old():
    """The machine runs at half its warm-up's speed, every plan alike; the run drafts. Plain
    decoding, judged by its warm-up time, is contradicted and trialled (measured as slow as the
    rest). As calls halve its trial's weight its ratio drifts back toward drafting's, but the
    doubt was answered: it is not trialled again until its timing is `retime_segments` segments
    old (batch 1 had trialled it every 3-4 calls, each trial 16 plain steps where drafting ran
    1.5x as fast)."""
    warm = np.array([1.0, 2.0])
    true = 2.0 * warm
    tokens = np.array([1.0, 2.9])
    tracker = StepTimeTracker(warm, kinds=[False, True], measured=[True] * 2, round_trip=0.5)
    tracker.new_call()
    tracker.observe(1, 30, 30 * true[1] + 0.5)
    assert tracker.explore(1, tokens, baseline=0, steps=16) == 0
    tracker.observe(0, 16, 16 * true[0] + 0.5, trial=True)
    proposals = []
    for _ in range(tracker.retime_segments + 2):
        tracker.new_call()
        tracker.observe(1, 30, 30 * true[1] + 0.5)
        proposals.append(tracker.explore(1, tokens, baseline=0, steps=16))
    first = proposals.index(0)
    assert set(proposals[:first]) == {None} and first >= tracker.retime_segments - 2, proposals


def test_a_tied_plan_is_re_timed_every_few_segments_and_a_plan_behind_the_margin_is_not():
    """Batch 1 with one segment a call: the warm-up timed drafting (plan 1) 1% behind plain
    decoding where it is truly 30% ahead. Tied within the margin, drafting is run again once its
    timing is 4 segments old (not 16, `retime_segments`), after which the corrected times rank it
    first; then plain decoding, 23% behind, is not offered as a tie (not while its own timing
    holds its corrected time; as that fades toward drafting's ratio, it may be). A plan 6% behind
    by its corrected time is not a tie at a 4% margin, nor is a plan of the chosen one's kind."""
    true = np.array([0.72, 2.2])
    warm = np.array([0.72, 2.9])
    tokens = np.array([1.0, 3.99])
    assert 0.99 < (tokens[1] / warm[1]) / (tokens[0] / warm[0]) < 1.0
    tracker = StepTimeTracker(warm, kinds=[False, True], measured=[True, True], round_trip=1.4)
    ties = []
    due = []   # the cheap check the engine asks first: is any plan of the other kind due?
    for _ in range(4):
        tracker.new_call()
        ties.append(tracker.retime_tie(0, tokens, margin=0.04, segments=4))
        due.append(tracker.tie_due(0, segments=4))
        tracker.observe(0, 95, 95 * true[0] + 1.4)
    ties.append(tracker.retime_tie(0, tokens, margin=0.04, segments=4))
    due.append(tracker.tie_due(0, segments=4))
    assert ties == [None] * 4 + [1] and due == [False] * 4 + [True]
    tracker.new_call()
    tracker.observe(1, 24, 24 * true[1] + 1.4)
    assert np.argmax(tokens / tracker.corrected()) == 1
    for _ in range(5):
        tracker.new_call()
        assert tracker.retime_tie(1, tokens, margin=0.04, segments=4) is None
        tracker.observe(1, 24, 24 * true[1] + 1.4)
    behind = StepTimeTracker(np.array([1.0, 1.06, 1.0]), kinds=[False, True, True], measured=[True] * 3)
    for _ in range(8):
        behind.observe(0, 40, 40.0)
    assert behind.retime_tie(0, np.array([1.0, 1.0, 0.9]), margin=0.04, segments=4) is None
    assert behind.retime_tie(0, np.array([1.0, 1.0, 0.9]), margin=0.08, segments=4) == 1
    # Within a kind, a tie is not offered (its kind's correction covers it).
    assert behind.retime_tie(1, np.array([0.5, 1.0, 1.06]), margin=0.04, segments=4) is None
    # Plain decoding ran the last 8 segments: no plan of its kind is due for drafting plan 1.
    assert behind.tie_due(0, segments=4) and not behind.tie_due(1, segments=4)


def test_a_segment_timed_at_zero_is_logged_but_times_nothing():
    """A run's opening segment is timed as the call's time less the opening's estimated cost, which
    can exceed it (clipped to zero): such a segment says nothing of its plan's steps. It is logged
    (`history`, which lean calls read) but leaves every corrected time as it was; folded in, it
    made its plan's corrected time zero."""
    tracker = StepTimeTracker(np.array([1.0, 2.0]), kinds=[False, True], round_trip=0.5)
    tracker.observe(0, 10, 12.0)
    before = tracker.corrected().copy()
    tracker.observe(1, 8, 0.0)
    assert np.array_equal(tracker.corrected(), before) and np.all(before > 0)
    assert tracker.segments == 1 and tracker.total_seconds == 12.0
    assert [(plan, steps) for plan, steps, *_ in tracker.history] == [(0, 10), (1, 8)]


def test_a_lone_surprising_segment_waits_for_the_next_to_confirm_it():
    """One-sided timing noise: a segment descheduled for 6 ms, 15x its steps, is held back; the
    plan's next segment, as timed, drops it. Two in a row count (a real slowdown costs one
    segment's delay). A trial that surprised is proposed again, and what no segment confirmed
    counts at the next call."""
    tracker = StepTimeTracker(np.array([0.02, 0.06]), kinds=[False, True], measured=[True] * 2)
    tracker.observe(0, 40, 40 * 0.02)
    before = tracker.corrected()
    tracker.observe(0, 16, 16 * 0.02 + 6.0)
    np.testing.assert_allclose(tracker.corrected(), before)
    tracker.observe(0, 40, 40 * 0.02)
    assert tracker.corrected()[0] == pytest.approx(0.02)
    # Sustained: counted from the second segment on.
    tracker.observe(0, 16, 16 * 0.5)
    assert tracker.corrected()[0] == pytest.approx(0.02)
    tracker.observe(0, 16, 16 * 0.5)
    assert tracker.corrected()[0] > 0.15
    # A surprising trial of plain decoding is in doubt until a second one: it is trialled again.
    tokens = np.array([1.0, 1.2])
    trial = StepTimeTracker(np.array([0.02, 0.06]), kinds=[False, True], measured=[True] * 2)
    trial.observe(1, 40, 40 * 0.06)
    trial.observe(0, 16, 16 * 0.02 + 6.0, trial=True)
    assert np.argmax(tokens / trial.corrected()) == 0 and trial.in_doubt(1)
    trial.observe(1, 40, 40 * 0.06)
    assert trial.explore(1, tokens, baseline=0) == 0
    trial.new_call()
    assert trial.corrected()[0] > 0.1 and not trial.in_doubt(1)
    with pytest.raises(ValueError, match="surprise"):
        StepTimeTracker(np.ones(2), surprise=1.0)


def test_tracker_re_times_a_close_runner_up_once_its_measurement_is_old():
    """A decoder keeps its tracker across calls: a plan measured at warm-up and not run since is
    re-timed after `retime_segments` segments if it is within the margin (and the budget allows),
    never if it is far behind; a re-timed plan waits that long again."""
    tracker = StepTimeTracker(np.ones(3), kinds=[False, True, True], measured=[True] * 3, retime_segments=5)
    tokens = np.array([1.0, 0.95, 0.5])
    for n in range(1, 5):
        tracker.observe(0, 40, 40.0)
        assert tracker.explore(0, tokens, steps=4) is None, n
    tracker.observe(0, 40, 40.0)
    assert tracker.explore(0, tokens, steps=4) == 1                     # 5 segments since the warm-up
    tracker.observe(1, 4, 4.0, trial=True)
    for n in range(5):
        assert tracker.explore(0, tokens, steps=4) is None, n
        tracker.observe(0, 40, 40.0)
    assert tracker.explore(0, tokens, steps=4) == 1
    # Across calls: a new call's log starts empty; what was learned stays.
    before = tracker.corrected()
    tracker.new_call()
    assert tracker.history == [] and np.array_equal(tracker.corrected(), before)
    with pytest.raises(ValueError, match="retime_segments"):
        StepTimeTracker(np.ones(2), retime_segments=0)


def test_a_timing_of_one_plan_renews_its_whole_kind():
    """Plain decoding runs; six drafting plans, all within the margin by their warm-up times, were
    timed there. Each trial of one of them times their kind, whose plans share its correction: over
    60 segments a drafting plan is trialled once per `retime_segments` segments, not once per
    plan. Nor is one of them offered as a tie, by `retime_tie`, until their kind's timing is old,
    whichever plan ran; and plain decoding, timed in every segment, renews nothing of theirs. A
    tracker whose plans are all of one kind re-times none of the chosen plan's runners-up."""
    n, every = 7, 6
    kinds = [False] + [True] * (n - 1)
    tracker = StepTimeTracker(np.linspace(1.0, 2.0, n), kinds=kinds, measured=[True] * n, retime_segments=every,
                              explore_budget=1.0)
    tokens = np.linspace(1.0, 1.9, n)           # drafting 5-10% behind plain decoding: within the margin
    trials = []
    for segment in range(60):
        trial = tracker.explore(0, tokens, steps=4)
        if trial is not None:
            assert trial > 0
            trials.append(segment)
            tracker.observe(trial, 4, 4 * tracker.predicted_j[trial], trial=True)
        else:
            tracker.observe(0, 40, 40.0)
    gaps = np.diff(trials)
    assert len(trials) >= 60 // (every + 1) - 1 and np.all(gaps >= every), trials
    # Ties, across kinds: due only once the kind's last timing, by any of its plans, is old.
    ties = StepTimeTracker(np.ones(3), kinds=[False, True, True], measured=[True] * 3)
    ties.observe(2, 40, 40.0)
    for _ in range(4):
        assert ties.retime_tie(0, np.ones(3), margin=0.04, segments=4) is None
        ties.observe(0, 40, 40.0)
    assert ties.retime_tie(0, np.ones(3), margin=0.04, segments=4) in (1, 2)
    one_kind = StepTimeTracker(np.ones(3), measured=[True] * 3, retime_segments=3)
    for _ in range(10):
        one_kind.observe(0, 40, 40.0)
        assert one_kind.explore(0, np.array([1.0, 0.99, 0.98]), steps=4) is None


def test_one_short_segment_does_not_swing_a_kind_of_one_plan():
    """Plain decoding is a kind of its own. One 1-step plain segment (a drain's last token, after a
    switch, timed 30% dear) moves the plain plan only part way; drafting's long segments agree
    with the prediction."""
    tracker = StepTimeTracker(np.array([2.5, 4.0, 10.0]), kinds=[False, True, True], measured=[True] * 3)
    tracker.observe(1, 54, 54 * 4.0)
    tracker.observe(0, 1, 1.3 * 2.5)
    assert 1.0 < tracker.ratio()[0] < 1.15, tracker.ratio()     # under half the way


def test_older_calls_count_less_so_a_kind_not_run_since_drifts_back():
    """A dear drafting segment in one call, then calls of plain decoding only: with each call's
    sums halved, the drafting plans return to the overall (plain decoding's) ratio within a few
    calls; without it (call_decay=1) they keep the old measurement."""
    def calls(call_decay):
        tracker = StepTimeTracker(np.array([2.5, 4.0, 10.0]), kinds=[False, True, True], measured=[True] * 3,
                                  call_decay=call_decay)
        tracker.new_call()
        tracker.observe(1, 54, 54 * 4.0 * 1.5)                 # drafting timed 1.5x its warm-up
        tracker.observe(0, 40, 40 * 2.5)
        for _ in range(6):
            tracker.new_call()
            tracker.observe(0, 95, 95 * 2.5)                   # plain decoding as timed
        return tracker.ratio()

    assert calls(0.5)[1] < 1.1 and calls(1.0)[1] > 1.3, (calls(0.5), calls(1.0))
    with pytest.raises(ValueError, match="call_decay"):
        StepTimeTracker(np.ones(2), call_decay=0.0)


def test_a_tracker_not_in_doubt_proposes_no_trial():
    """`in_doubt` is the engine's shortcut past predicting every plan's tokens: over random
    histories (plans measured or not before the run, kinds, segments of random plans and times,
    new calls, random token estimates), whenever it says no plan besides the chosen one is in
    doubt, `explore` proposes nothing; and it does say so on some histories and not on others."""
    rng = np.random.default_rng(11)
    seen = set()
    for case in range(300):
        n = int(rng.integers(2, 6))
        tracker = StepTimeTracker(rng.uniform(0.5, 2.0, n), kinds=rng.integers(0, 2, n) > 0,
                                  measured=rng.random(n) < 0.7, retime_segments=int(rng.integers(2, 20)),
                                  round_trip=float(rng.uniform(0, 0.2)))
        for _ in range(int(rng.integers(0, 40))):
            if rng.random() < 0.1:
                tracker.new_call()
            plan = int(rng.integers(0, n))
            tracker.observe(plan, int(rng.integers(1, 30)), float(rng.uniform(0.1, 40.0)), trial=rng.random() < 0.2)
        chosen = int(rng.integers(0, n))
        doubt = tracker.in_doubt(chosen)
        seen.add(doubt)
        for _ in range(5):
            trial = tracker.explore(chosen, rng.uniform(0.5, 4.0, n), baseline=int(rng.integers(0, n)),
                                    steps=int(rng.integers(1, 64)))
            assert doubt or trial is None, case
    assert seen == {True, False}


def test_a_calls_last_plain_token_neither_skews_nor_renews_plain_decodings_time():
    """Batch 1 as on the tiny-8L pair: the warm-up timed plain decoding 17% dear and drafting 6%
    cheap, so the decoder drafts (k = 3), and each call ends on a 1-step plain segment (a drain's
    switch) whose wall time is mostly a jittery round trip. Those glimpses weigh little and do not
    count as timing plain decoding, so it is re-timed once its warm-up time is old, and from then
    on the decoder mostly decodes plainly, as the true step times say it should (a drafting call
    now and then re-times drafting as its measurement ages). Taken at full weight as fresh
    measurements (the rule before), they held plain decoding at 0.74-0.93 and the decoder
    drafted in all 24 calls."""
    rng = np.random.default_rng(3)
    warm, true, round_trip = np.array([0.70, 1.70]), np.array([0.60, 1.80]), 0.9
    tokens = np.array([1.0, 2.73])                     # k = 3 at alpha 0.75
    assert np.argmax(tokens / true) == 0 and np.argmax(tokens / warm) == 1
    tracker = StepTimeTracker(warm, round_trip=round_trip, kinds=[False, True], measured=[True, True])
    choices = []
    for _ in range(24):
        tracker.new_call()
        choice = int(np.argmax(tokens / tracker.corrected()))
        trial = tracker.explore(choice, tokens, baseline=0, steps=64)
        if trial is not None:
            tracker.observe(trial, 64, 64 * true[trial] + round_trip, trial=True)
            choice = int(np.argmax(tokens / tracker.corrected()))
        if choice == 0:
            tracker.observe(0, 95, 95 * true[0] + round_trip)
        else:
            tracker.observe(1, 34, 34 * true[1] + round_trip)
            tracker.observe(0, 1, true[0] + round_trip + rng.uniform(0.1, 0.6))   # the glimpse
        choices.append(choice)
    assert choices[-12:].count(0) >= 8, choices
    assert abs(tracker.corrected()[0] / true[0] - 1) < 0.05, tracker.corrected()


def test_a_plan_due_for_re_timing_is_judged_by_its_warm_up_time_too():
    """Drafting runs 14% behind its warm-up time (not enough to contradict the other kind's
    warm-up); plain decoding, not run since its warm-up, is scaled up by that error and by its
    corrected time falls outside the margin. Once its warm-up time is `retime_segments` segments
    old it is re-timed all the same, as by that time it is within the margin; a plan far behind by
    both is not."""
    warm = np.array([0.70, 1.80, 2.0])
    tokens = np.array([1.0, 3.1, 2.0])
    tracker = StepTimeTracker(warm, kinds=[False, True, True], measured=[True] * 3, retime_segments=12)
    for _ in range(11):
        tracker.observe(1, 31, 31 * 1.14 * warm[1])
        assert tracker.explore(1, tokens, baseline=0, steps=64) is None
    corrected = tracker.corrected()
    assert tokens[0] / corrected[0] < 0.85 * tokens[1] / corrected[1] < tokens[0] / warm[0], corrected
    tracker.observe(1, 31, 31 * 1.14 * warm[1])
    assert tracker.explore(1, tokens, baseline=0, steps=64) == 0
    tracker.observe(0, 64, 64 * 0.6, trial=True)
    assert np.argmax(tokens / tracker.corrected()) == 0
    # Plan 2 is stale too, but a third behind plan 1 by its warm-up time: never trialled.
    for _ in range(8):
        tracker.observe(0, 95, 95 * 0.6)
        assert tracker.explore(0, tokens, steps=4) != 2


def test_profile_passes_spread_a_drifting_machine_over_the_grid(tiny_model, monkeypatch):
    """On a machine that slows by half over the profile and stalls now and then, shuffled passes
    with a median keep the fitted step times in proportion across the grid (the common slow-down
    is the tracker's to correct); timing each shape's repeats one after another, in grid order,
    bends the fit by the drift."""
    truth = CostModel.from_coefficients(draft_fixed=2e-4, draft_per_token=2e-5, target_fixed=8e-4,
                                        target_per_token=3e-5, target_per_context_token=2e-7,
                                        speculation_fixed=3e-4, speculation_per_row=2e-5)
    batches, ks, cache_lens, passes = (1, 4, 16, 64), (0, 1, 2, 4), (128, 256), 3
    shapes = [(b, k, s) for b in batches for k in ks for s in cache_lens]
    calls = []

    def machine(target, drafter, k, batch, cache_len, *, repeats, **_):
        assert repeats == 1
        calls.append((batch, k, cache_len))
        drift = 1.0 + 0.5 * len(calls) / (passes * len(shapes))
        stall = 5e-3 if len(calls) % 13 == 3 else 0.0   # 7x a batch-1 step
        return truth.step_seconds(batch, k, cache_len) * drift + stall

    def spread(cost):   # largest over smallest ratio of predicted to true step time over the grid
        ratio = np.array([cost.step_seconds(*shape) / truth.step_seconds(*shape) for shape in shapes])
        return ratio.max() / ratio.min()

    from jaxspec.engine import loop
    monkeypatch.setattr(loop, "time_steps", machine)
    monkeypatch.setattr(loop, "warm_steps", lambda *args, **kwargs: None)
    cost = CostModel.profile(tiny_model, None, batches=batches, ks=ks, cache_lens=cache_lens, passes=passes)
    assert sorted(calls) == sorted(shapes * passes)   # every shape once per pass
    assert cost.fit["step"]["passes"] == passes
    calls.clear()
    one_by_one = [(*shape, float(np.median([machine(None, None, shape[1], shape[0], shape[2], repeats=1)
                                            for _ in range(passes)]))) for shape in shapes]
    assert spread(cost) < 1.2 < 1.35 < spread(CostModel.fit_points(one_by_one))
    for name in ("passes", "repeats"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
            CostModel.profile(tiny_model, None, batches=batches, ks=ks, cache_lens=cache_lens, **{name: 0})
