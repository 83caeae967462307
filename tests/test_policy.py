"""The goodput policy's formulas (`jaxspec.policy.goodput`) against simulation, naive loops and brute force."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.policy import goodput as policy
from jaxspec.policy.cost import CostModel


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.95, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_expected_tokens_per_step_matches_simulation(alpha, k):
    rng = np.random.default_rng(int(alpha * 100) + k)
    accepts = rng.random((200_000, k)) < alpha
    emitted = np.cumprod(accepts, axis=1).sum(axis=1) + 1  # accepted prefix + correction/bonus
    assert float(policy.expected_tokens_per_step(alpha, k)) == pytest.approx(emitted.mean(), rel=0.01)


def test_expected_tokens_per_step_at_alpha_one_is_exact():
    assert float(policy.expected_tokens_per_step(1.0, 5)) == 6.0


def with_alpha(alpha_b, weight=1e5):
    alpha_b = jnp.asarray(alpha_b, jnp.float32)
    state = policy.PolicyState.init(len(alpha_b), 8)
    return state.replace(accepted_b=alpha_b * weight, tried_b=jnp.full_like(alpha_b, weight))


def test_observe_counts_what_a_naive_loop_over_the_slots_counts():
    """Slot j of a row was tried if it was verified and every slot before it was accepted; the
    per-slot counts sum the rows that verified something."""
    rng = np.random.default_rng(0)
    state = policy.PolicyState.init(5, 4)
    acc, tried = np.zeros(5), np.zeros(5)
    acc_k, tried_k = np.zeros(4), np.zeros(4)
    for _ in range(20):
        verified, live = rng.integers(0, 5, 5), rng.random(5) < 0.8
        accepted = np.minimum(rng.integers(0, 6, 5), verified)
        state = policy.observe(state, jnp.asarray(verified), jnp.asarray(accepted), jnp.asarray(live))
        seen = [r for r in range(5) if live[r] and verified[r] > 0]
        if seen:
            acc_k *= policy.DECAY
            tried_k *= policy.DECAY
        for r in seen:
            acc[r] *= policy.DECAY
            tried[r] *= policy.DECAY
            for j in range(verified[r]):
                tried[r] += 1
                tried_k[j] += 1
                if j >= accepted[r]:
                    break
                acc[r] += 1
                acc_k[j] += 1
    np.testing.assert_allclose(state.accepted_b, acc, rtol=1e-5)
    np.testing.assert_allclose(state.tried_b, tried, rtol=1e-5)
    np.testing.assert_allclose(state.accepted_k, acc_k, rtol=1e-5)
    np.testing.assert_allclose(state.tried_k, tried_k, rtol=1e-5)


@pytest.mark.parametrize("falloff", [1.0, 0.8])
def test_reach_follows_acceptance_that_falls_along_the_window(falloff):
    """Windows of 5 drafts whose j-th draft is accepted with probability 0.9 * falloff^j given its
    predecessors: the estimated chance that the j-th draft is accepted (predecessors included)
    approaches the product of those rates, the geometric alpha^j when the rate is flat."""
    rng = np.random.default_rng(3)
    rate_k = 0.9 * falloff ** np.arange(5)
    state = policy.PolicyState.init(8, 5)
    for _ in range(300):
        accepted = np.cumprod(rng.random((8, 5)) < rate_k, axis=1).sum(axis=1)
        state = policy.observe(state, jnp.full(8, 5), jnp.asarray(accepted), jnp.ones(8, bool), decay=0.995)
    reach = np.asarray(state.reach_bk(jnp.ones(8, bool), 5)).mean(axis=0)
    np.testing.assert_allclose(reach, np.cumprod(rate_k), atol=0.05)


def test_ageing_fades_the_evidence_back_to_the_prior():
    state = with_alpha([0.1, 0.9], weight=20.0)
    aged = policy.age(state, 400)
    np.testing.assert_allclose(aged.alpha_b(), [policy.PRIOR_ALPHA] * 2, atol=0.01)
    np.testing.assert_allclose(aged.reach_bk(None, 3), [policy.PRIOR_ALPHA ** np.arange(1, 4)] * 2, atol=0.01)
    np.testing.assert_allclose(policy.age(state, 0).alpha_b(), state.alpha_b())


def test_tetris_windows_are_the_rows_shares_of_the_best_slots():
    """Brute force: take the `budget` (row, j) slots with the largest alpha_b^j; each row's
    window is how many of its slots were taken (a prefix of the row)."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        alpha = rng.uniform(0.05, 0.95, 4)
        live = rng.random(4) < 0.8
        k, budget = 3, int(rng.integers(1, 9))
        reach = jnp.asarray(alpha[:, None] ** np.arange(1, k + 1)[None, :], jnp.float32)
        got = np.asarray(policy.windows(reach, jnp.asarray(live), (k, budget)))
        slots = sorted(((alpha[r] ** (j + 1), r) for r in range(4) for j in range(k) if live[r]), reverse=True)
        want = np.bincount([r for _, r in slots[:budget]], minlength=4)
        np.testing.assert_array_equal(got, want)


def brute_force_goodput(alpha_b, live_b, plans, seconds_j, remaining_b=None, behind=0.0, catch_up=0.0,
                        forecast=None):
    """Per plan, from naive per-row sums: the rate of tokens while requests wait (the drafter's
    catch-up spread over HORIZON steps), or for a draining batch the tokens left over the time
    until its slowest rows (the 90th percentile) are done, catch-up included. Draft j of row r is
    reached with chance alpha_r^j, or the drafter's `forecast[r][j - 1]` where that is less."""
    def reach(r, j):
        return min(alpha_b[r] ** j, forecast[r][j - 1]) if forecast is not None else alpha_b[r] ** j

    out = []
    for (k, budget), seconds in zip(plans, seconds_j):
        if budget is None:
            windows = [k if live else 0 for live in live_b]
        else:
            slots = sorted(((reach(r, j + 1), r) for r in range(len(alpha_b)) if live_b[r] for j in range(k)),
                           reverse=True)[:budget]
            windows = np.bincount([r for _, r in slots], minlength=len(alpha_b))
        mean = [1 + sum(reach(r, t) for t in range(1, w + 1)) for r, w in enumerate(windows)]
        entry = np.ceil(behind / policy.CATCH_UP_CHUNK) * catch_up if k > 0 else 0.0
        if remaining_b is None:
            out.append(sum(m for m, live in zip(mean, live_b) if live) / (seconds + entry / policy.HORIZON))
            continue
        steps = sorted((r / m for r, m, live in zip(remaining_b, mean, live_b) if live), reverse=True)
        slowest = max(steps[int(np.floor((1 - policy.DRAIN_QUANTILE) * len(steps)))], 1.0)
        left = sum(r for r, live in zip(remaining_b, live_b) if live)
        out.append(left / (slowest * seconds + entry))
    return np.array(out)


@pytest.mark.parametrize("draining, forecast", [(False, False), (True, False), (False, True), (True, True)])
def test_choice_is_the_brute_force_argmax_and_keeps_the_running_plan_within_the_margin(draining, forecast):
    rng = np.random.default_rng(2)
    cost = CostModel.from_coefficients(draft_fixed=2e-4, draft_per_token=1e-5, target_fixed=2e-3,
                                       target_per_token=4e-5)
    plans = ((0, None), (1, None), (2, None), (4, None), (4, 3), (4, 8))
    for _ in range(40):
        alpha = rng.uniform(0.0, 1.0, 4)
        live = rng.random(4) < 0.85
        live[0] = True
        remaining = rng.integers(1, 40, 4)
        behind, catch_up = float(rng.integers(0, 60)), float(rng.uniform(0, 2e-3))
        seconds = np.array([cost.step_seconds(4, k) if c is None else cost.step_seconds(4, k, packed_tokens=4 + c)
                            for k, c in plans])
        # a free drafter's own running products: some rows propose nothing, others fewer than 4 drafts
        drafts = rng.integers(0, 5, 4)
        fc = np.where(np.arange(4)[None] < drafts[:, None], np.cumprod(rng.uniform(0.3, 1.0, (4, 4)), 1), 0.0)
        fc = fc.astype(np.float32) if forecast else None
        want = brute_force_goodput(alpha, live, plans, seconds, remaining if draining else None, behind, catch_up, fc)
        state = with_alpha(alpha).replace(behind=jnp.float32(behind))
        args = (state, jnp.asarray(live), plans, jnp.asarray(seconds, jnp.float32))
        rem = jnp.asarray(remaining) if draining else None
        fc = None if fc is None else jnp.asarray(fc)
        got = policy.goodput(*args, rem, True, catch_up_seconds=catch_up, forecast_bk=fc)
        np.testing.assert_allclose(got, want, rtol=2e-4)
        choice = policy.choose(*args, None, remaining_b=rem, draining=True, catch_up_seconds=catch_up, forecast_bk=fc)
        assert int(choice) == int(np.argmax(want))
        for current in range(len(plans)):
            stay = want.max() <= want[current] * (1 + policy.MARGIN)
            got = int(policy.choose(*args, current, remaining_b=rem, draining=True, catch_up_seconds=catch_up,
                                    forecast_bk=fc))
            if abs(want.max() / want[current] - 1 - policy.MARGIN) > 1e-4:   # not on the edge
                assert got == (current if stay else int(np.argmax(want)))


def test_ageing_puts_the_drafter_behind_and_a_verified_window_catches_it_up():
    state = policy.age(policy.PolicyState.init(3, 2), 12)
    state = policy.age(state, 5)
    assert float(state.behind) == 17.0
    state = policy.observe(state, jnp.asarray([2, 0, 1]), jnp.asarray([1, 0, 1]), jnp.ones(3, bool))
    assert float(state.behind) == 0.0


def test_a_free_perfect_draft_takes_the_longest_window_and_a_dear_one_plain_decoding():
    plans = tuple((k, None) for k in range(5))
    live = jnp.ones(4, bool)
    for draft, want in ((0.0, 4), (1.0, 0)):
        cost = CostModel.from_coefficients(draft_fixed=draft, draft_per_token=0.0, target_fixed=1e-2,
                                           target_per_token=1e-6)
        seconds = jnp.asarray([cost.step_seconds(4, k) for k, _ in plans], jnp.float32)
        for alpha in (0.99, 1.0):
            assert int(policy.choose(with_alpha([alpha] * 4), live, plans, seconds)) == want


def test_a_draining_batch_waits_on_its_slowest_row():
    """Two rows left, one with 1 token to go and one with 40 at acceptance 0.2: the batch's rate is
    the 41 tokens over the slow row's steps, whatever the fast row would gain; with requests
    waiting it is the rows' sum."""
    state = with_alpha([0.95, 0.2])
    live = jnp.ones(2, bool)
    for k in (0, 1, 3):
        slow = float(policy.expected_tokens_per_step(0.2, k))
        args = (state, live, ((k, None),), jnp.ones(1))
        assert float(policy.goodput(*args, jnp.asarray([1, 40]))[0]) == pytest.approx(41 / (40 / slow), rel=1e-4)
        total = sum(float(policy.expected_tokens_per_step(a, k)) for a in (0.95, 0.2))
        assert float(policy.goodput(*args, jnp.asarray([1, 40]), False)[0]) == pytest.approx(total, rel=1e-4)
