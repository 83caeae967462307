"""Cost models: the fit recovers known coefficients, persistence round-trips, provenance is checked."""

import dataclasses
import warnings

import numpy as np
import pytest

import jaxspec
from jaxspec.policy.cost import CostModel, fit_linear


def test_fit_recovers_known_coefficients_from_noisy_timings():
    rng = np.random.default_rng(0)
    true = np.array([2e-3, 3e-5, 4e-8, 5e-9])  # fixed, per batched token, per context slot, per attention pair
    grid = np.array([[1.0, b * t, b * s, b * t * s] for b in (1, 2, 4, 8, 16) for t in (1, 2, 4, 8)
                     for s in (128, 512, 2048)])
    seconds = grid @ true * rng.normal(1.0, 0.03, len(grid))  # 3% multiplicative noise
    coef, fit = fit_linear(grid, seconds)
    # Measured with this noise: coefficients 0.6%, 0.7%, 6.5% and 1.5% off (the context term is the
    # least determined), 1 - r2 = 5e-3, the worst held-out point 5.8% off (about 2 sigma of the
    # noise). The bounds are 3-4x those.
    assert (np.abs(coef / true - 1) < [0.03, 0.03, 0.2, 0.06]).all(), coef / true - 1
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
    # Measured: these coefficients 0.5%, 1.2%, 3.5% and 4.9% off (up to 8% with other noise
    # seeds), the predictions at most 1.2%.
    for name in ("target_fixed", "target_per_token", "speculation_fixed", "speculation_per_row"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=0.15), name
    for b, k in ((1, 0), (1, 1), (64, 0), (64, 1), (16, 4)):
        assert fitted.step_seconds(b, k, 200) == pytest.approx(true.step_seconds(b, k, 200), rel=0.04), (b, k)
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
    for b, k, s in shapes:   # measured at most 2.1% off (1.2-2.1% over three noise seeds)
        assert fitted.step_seconds(b, k, s) == pytest.approx(true.step_seconds(b, k, s), rel=0.05), (b, k, s)
    # Clean timings lose nothing.
    clean = [(b, k, s, true.step_seconds(b, k, s)) for b, k, s in shapes]
    assert CostModel.fit_points(clean).fit["step"]["outliers"] == 0


def test_a_step_timing_is_never_far_below_the_loops_average_step(tiny_model, monkeypatch):
    """`time_steps` takes a step as (loop of 7 steps - loop of 1) / 6. On a clock where every
    one-step loop stalls for longer than six steps take, that difference is negative; the timing
    falls back to a tenth of the long loop's average step instead of a floor of zero."""
    import types

    from jaxspec.drafting import NgramDrafter
    from jaxspec.engine import timing

    step, stall, now = 1e-3, 1e-2, [0.0]

    def compiled(steps):   # a segment of `steps` steps, called with its traced arguments
        def timed_loop(params, state, control):
            now[0] += steps * step + (stall if steps == 1 else 0.0)
            return state, None
        return types.SimpleNamespace(compile=lambda options=None: timed_loop)

    monkeypatch.setattr(timing, "run_on_device", types.SimpleNamespace(
        lower=lambda program, params, state, control, segment: compiled(segment.steps)))
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    drafter = NgramDrafter().bind_vocab(tiny_model.config.vocab_size)
    seconds = timing.time_steps(tiny_model, drafter, 0, 1, 64, repeats=2)
    assert seconds == pytest.approx(0.1 * step)   # the long loop's average: 7 steps in 7 steps' time
    stall = 0.0   # and a quiet clock gives the step itself
    assert timing.time_steps(tiny_model, drafter, 0, 1, 64, repeats=2) == pytest.approx(step)


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
    # 1% noise over 16 points: measured 0.12% off (0.12-0.28% over three seeds).
    assert (coef >= 0).all() and coef[0] == pytest.approx(1e-3, rel=0.01)


def test_nonnegative_fit_is_the_best_over_every_set_of_free_coefficients():
    """On noisy sub-millisecond profiles (the step model's 8 columns), the fit equals the brute-force
    optimum: the least-squares solution of every subset of columns, kept where all its coefficients
    are >= 0, the smallest residual of those (coefficients outside the subset are 0)."""
    import itertools

    from jaxspec.policy.cost import _nonnegative_lstsq

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
        # The same least-squares solves: measured at most 7e-16 apart; the next-best feasible subset
        # is at least 5e-4 worse (relative) in these trials.
        assert np.sum((a @ got - t) ** 2) == pytest.approx(best_residual, rel=1e-9, abs=0), trial
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
    free = CostModel.from_coefficients(draft_fixed=0, draft_per_token=2e-6, target_fixed=3e-3, target_per_token=1e-5)
    dataclasses.replace(cost, free=free).save(path)   # a hybrid's free plans priced apart (`profile --free`)
    assert CostModel.load(path, expect_device_kind="NVIDIA H100 80GB HBM3").free == free
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CostModel.load(path, expect_device_kind="NVIDIA H100 80GB HBM3")


def test_bad_coefficients_and_files_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="target_per_token must be a finite number of seconds >= 0"):
        CostModel.from_coefficients(draft_fixed=0, draft_per_token=0, target_fixed=1, target_per_token=-1)
    with pytest.raises(ValueError, match="free must be a CostModel"):
        CostModel.from_coefficients(draft_fixed=0, draft_per_token=0, target_fixed=1, target_per_token=0, free=0.1)
    (tmp_path / "bad.json").write_text('{"draft_fixed": 1}')
    with pytest.raises(ValueError, match="missing cost-model coefficients"):
        CostModel.load(tmp_path / "bad.json")


@pytest.mark.slow  # a minute of timing; the CLI profile test covers the path
def test_profile_predicts_the_steps_it_timed(tiny_model):
    """A real (small) profile: the fit reproduces its own timings, drafting and longer windows cost more."""
    draft = jaxspec.Model.random(tiny_model.config.replace(num_layers=1, name="tiny-1L"), seed=1)
    cost = CostModel.profile(tiny_model, draft, batches=(1, 4, 16), ks=(0, 1, 3), cache_lens=(64, 128))
    assert cost.target_name == "tiny" and cost.draft_name == "tiny-1L" and cost.device_kind
    assert cost.fit["step"]["points"] == 18
    # Step times of this tiny model are tens of microseconds, so single points are noisy; the fit
    # must still describe the typical point.
    errors = [abs(cost.step_seconds(b, k, s) / seconds - 1) for b, k, s, seconds in cost.fit["step"]["points_seconds"]]
    assert np.median(errors) < 0.5, errors
    assert cost.step_seconds(16, 3, 128) > cost.step_seconds(16, 0, 128) > 0
    with pytest.raises(ValueError, match="ks must include 0"):
        CostModel.profile(tiny_model, draft, ks=(1, 2))


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

    from jaxspec.engine import timing
    monkeypatch.setattr(timing, "time_steps", machine)
    monkeypatch.setattr(timing, "step_timer", lambda *args, **kwargs: (lambda steps: 0.0))
    cost = CostModel.profile(tiny_model, None, batches=batches, ks=ks, cache_lens=cache_lens, passes=passes)
    assert sorted(calls) == sorted(shapes * passes)   # every shape once per pass
    assert cost.fit["step"]["passes"] == passes
    calls.clear()
    one_by_one = [(*shape, float(np.median([machine(None, None, shape[1], shape[0], shape[2], repeats=1)
                                            for _ in range(passes)]))) for shape in shapes]
    assert spread(cost) < 1.2 < 1.35 < spread(CostModel.fit_points(one_by_one))
    with pytest.raises(ValueError, match="passes must be an int >= 1"):
        CostModel.profile(tiny_model, None, batches=batches, ks=ks, cache_lens=cache_lens, passes=0)


def test_a_tree_step_prices_its_draft_passes_and_its_verified_nodes():
    """A (3, 2) tree verifying 3 nodes per row at batch 4: one draft position over the 4 rows, two
    over 8 node tokens, one speculation overhead, 16 verified tokens attending over the tree's
    11 columns (hand-summed from the coefficients)."""
    from jaxspec.drafting.trees import TreeShape
    cost = CostModel.from_coefficients(draft_fixed=1.0, draft_per_token=0.1, target_fixed=10.0, target_per_token=0.01,
                                       target_per_context_token=0.001, target_per_attention=1e-4,
                                       speculation_fixed=0.5, speculation_per_row=0.05)
    draft = (1.0 + 0.1 * 4) + 2 * (1.0 + 0.1 * 8)
    verify = 10.0 + 0.01 * 16 + 0.001 * 4 * 100 + 1e-4 * 4 * 11 * 100
    assert cost.step_seconds(4, 3, 100, tree=TreeShape(3, 2)) == pytest.approx(draft + 0.5 + 0.05 * 4 + verify)
