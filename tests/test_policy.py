"""Goodput policy (`jaxspec.policy`): acceptance models against simulation, choices against brute
force, acceptance tracking, calibration and memory. Decoding under the policy: `test_control.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import policy
from jaxspec.cost import CostModel


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.95, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_expected_tokens_per_step_matches_simulation(alpha, k):
    rng = np.random.default_rng(int(alpha * 100) + k)
    accepts = rng.random((200_000, k)) < alpha
    emitted = np.cumprod(accepts, axis=1).sum(axis=1) + 1  # accepted prefix + correction/bonus
    assert float(policy.expected_tokens_per_step(alpha, k)) == pytest.approx(emitted.mean(), rel=0.01)


def test_expected_tokens_per_step_at_alpha_one_is_exact():
    assert float(policy.expected_tokens_per_step(1.0, 5)) == 6.0


def state_with_alpha(alpha_b, weight=1e4):
    alpha_b = jnp.asarray(alpha_b, jnp.float32)
    state = policy.PolicyState.init(len(alpha_b), 0)
    return state.with_row_counts(alpha_b * weight, jnp.full_like(alpha_b, weight))


def brute_force_k(alpha_b, live_b, ks, cost, batch, cache_len):
    best, best_rate = None, -1.0
    for i, k in enumerate(ks):
        tokens = sum(float(policy.expected_tokens_per_step(a, k)) for a, live in zip(alpha_b, live_b) if live)
        rate = tokens / cost.step_seconds(batch, k, cache_len)
        if rate > best_rate * (1 + 1e-6):
            best, best_rate = i, rate
    return best


def test_choice_is_the_brute_force_argmax():
    rng = np.random.default_rng(0)
    ks = (0, 1, 2, 3, 4, 5, 6)
    for _ in range(200):
        b = int(rng.integers(1, 9))
        alpha_b = rng.uniform(0, 1, b)
        live_b = rng.random(b) < 0.8
        cost = CostModel.from_coefficients(draft_fixed=rng.uniform(0, 2e-3), draft_per_token=rng.uniform(0, 1e-4),
                                           target_fixed=rng.uniform(1e-3, 2e-2), target_per_token=rng.uniform(0, 1e-3),
                                           target_per_context_token=rng.uniform(0, 1e-6),
                                           target_per_attention=rng.uniform(0, 1e-7),
                                           speculation_fixed=rng.uniform(0, 2e-3),
                                           speculation_per_row=rng.uniform(0, 1e-4))
        seconds = jnp.asarray([cost.step_seconds(b, k, 256) for k in ks], jnp.float32)
        # Little evidence (a few trials' worth), so the optimistic estimate differs from the plain one.
        state = state_with_alpha(alpha_b, weight=float(rng.uniform(0.5, 20)))
        for optimistic, alpha_used in ((True, state.planning_alpha_b()), (False, state.alpha_b())):
            got = policy.choose_k(state, jnp.asarray(live_b), ks, seconds, optimistic=optimistic)
            want = brute_force_k(np.asarray(alpha_used), live_b, ks, cost, b, 256)
            if live_b.any():
                assert int(got) == want
                rates = [sum(float(policy.expected_tokens_per_step(a, k)) for a, live in zip(alpha_used, live_b)
                             if live) / cost.step_seconds(b, k, 256) for k in ks]
                if optimistic:
                    # While speculation is off: probe with k = 1 if some k > 0 may beat plain
                    # decoding by more than the switch margin.
                    probe = policy.probe_choice(state, jnp.asarray(live_b), ks, seconds)
                    gain = max(rates[1:]) / rates[0] - 1
                    if abs(gain - policy.SWITCH_MARGIN) > 1e-4:
                        assert int(probe) == (1 if gain > policy.SWITCH_MARGIN else 0)
                # With a plan running, it is kept unless the best beats it by more than the margin,
                # which is wider while the batch has few trials.
                current = int(rng.integers(len(ks)))
                got = policy.choose_k(state, jnp.asarray(live_b), ks, seconds, optimistic=optimistic,
                                      current=current)
                needed = policy.SWITCH_MARGIN + policy.THIN_EVIDENCE / np.sqrt(1 + float(np.sum(state.trials_b)))
                gain = rates[want] / rates[current] - 1
                if abs(gain - needed) > 1e-4:   # float32 on device: skip exact ties
                    assert int(got) == (want if gain > needed else current)


def test_ageing_shrinks_the_evidence_so_speculation_that_was_switched_off_is_probed_again():
    """After speculation went off on alpha = 0.5, the plain estimate keeps it off; the optimistic one
    probes it again only once the evidence has aged (about 100 steps without drafting)."""
    ks = (0, 1, 2, 3)
    cost = CostModel.from_coefficients(draft_fixed=5e-4, draft_per_token=0.0, target_fixed=2e-3,
                                       target_per_token=0.0, speculation_fixed=1e-3)
    seconds = jnp.asarray([cost.step_seconds(4, k, 64) for k in ks], jnp.float32)
    live = jnp.ones((4,), bool)
    state = state_with_alpha([0.5] * 4, weight=20.0)
    aged = policy.age(state, 10)
    np.testing.assert_allclose(aged.trials_b, 20.0 * policy.OFF_DECAY ** 10, rtol=1e-5)
    np.testing.assert_allclose(aged.alpha_b(), policy.age(state, 0).alpha_b(), atol=0.02)   # alpha itself kept
    assert int(policy.choose_k(state, live, ks, seconds, optimistic=False)) == 0
    assert int(policy.choose_k(policy.age(state, 10), live, ks, seconds, optimistic=True)) == 0
    assert int(policy.choose_k(policy.age(state, 150), live, ks, seconds, optimistic=True)) > 0
    assert int(policy.choose_k(policy.age(state, 150), live, ks, seconds, optimistic=False)) == 0


def test_opening_drafts_what_the_prior_expects_or_probes_with_the_cheapest_draft_length():
    """Before anything is seen: the prior's choice when it drafts; the smallest k when only the
    optimistic estimate expects speculation to pay; plain decoding when even that does not."""
    ks = (0, 1, 2, 3, 4)
    live = np.ones(4, bool)
    state = policy.PolicyState.init(4, 0)
    prior = np.full(4, policy.PRIOR_ALPHA)
    hopeful = np.asarray(state.planning_alpha_b())
    outcomes = set()

    def rate(alpha_b, j, seconds):
        return sum(float(policy.expected_tokens_per_step(a, ks[j])) for a in alpha_b) / float(seconds[j])

    for draft_cost in np.geomspace(1e-5, 1e-1, 40):
        cost = CostModel.from_coefficients(draft_fixed=draft_cost, draft_per_token=0.0, target_fixed=2e-3,
                                           target_per_token=1e-4)
        seconds = jnp.asarray([cost.step_seconds(4, k, 64) for k in ks], jnp.float32)
        got = int(policy.opening_choice(state, jnp.asarray(live), ks, seconds))

        by_prior, by_hope = brute_force_k(prior, live, ks, cost, 4, 64), brute_force_k(hopeful, live, ks, cost, 4, 64)
        if ks[by_prior] > 0:
            assert got == by_prior, draft_cost
            outcomes.add("prior")
        elif rate(hopeful, by_hope, seconds) > (1 + policy.SWITCH_MARGIN) * rate(hopeful, 0, seconds):
            assert got == 1, draft_cost
            outcomes.add("probe")
        else:
            assert got == 0, draft_cost
            outcomes.add("plain")
    assert outcomes == {"prior", "probe", "plain"}   # the sweep saw all three cases


def test_seeded_acceptance_is_the_pooled_rate_of_the_rows_that_saw_trials():
    rng = np.random.default_rng(3)
    for _ in range(50):
        b = int(rng.integers(1, 12))
        trials = np.where(rng.random(b) < 0.3, 0.0, rng.uniform(0, 30, b))   # some rows saw nothing (padding)
        accepted = trials * rng.uniform(0, 1, b)
        alpha, weight = np.asarray(policy.seed_acceptance(accepted, trials))
        seen = trials > 0
        if not seen.any():
            assert (alpha, weight) == (pytest.approx(policy.PRIOR_ALPHA), 0.0)
            continue
        assert alpha == pytest.approx(accepted[seen].sum() / trials[seen].sum(), rel=1e-5)
        assert weight == pytest.approx(min(trials[seen].mean(), policy.SEED_WEIGHT), rel=1e-5)
        state = policy.PolicyState.init(3, 0, seed=(alpha, weight))
        np.testing.assert_allclose(state.evidence_b(), weight, rtol=1e-6)
        np.testing.assert_allclose(state.seed_accepted_b, alpha * weight, rtol=1e-5, atol=1e-6)
        assert not np.any(state.trials_b)                                 # the row's own counts: none yet


def test_a_seeded_row_keeps_drafting_through_a_dip_and_the_seed_ages_while_speculation_is_off():
    """One row drafting k = 4 meets a hard stretch (its acceptances per step 2, 0, 0, 4, 0: the
    opening of a batch-1 benchmark prompt whose later tokens are 85% accepted). Seeded with what
    the decoder measured before (0.8 over a window of trials), it keeps drafting; the same
    outcomes without a seed turn speculation off. Drafting observes without decaying the seed;
    plain steps age it like everything else, so a long plain stretch forgets it."""
    ks = (0, 1, 2, 3, 4)
    seconds = jnp.asarray([0.8, 1.6, 1.9, 2.1, 2.4]) * 1e-3
    live = jnp.ones((1,), bool)

    def after_dip(seed):
        state = policy.PolicyState.init(1, 4, seed=seed)
        for accepted in (2, 0, 0, 4, 0):
            state = policy.observe(state, jnp.zeros((1, 4)), jnp.asarray([4]), jnp.asarray([accepted]), live)
        return state

    seeded, bare = after_dip((0.8, policy.SEED_WEIGHT)), after_dip(None)
    assert int(policy.choose_k(seeded, live, ks, seconds, optimistic=False, current=4)) == 4
    assert int(policy.choose_k(bare, live, ks, seconds, optimistic=False, current=4)) == 0
    np.testing.assert_allclose(seeded.seed_trials_b, policy.SEED_WEIGHT)   # drafting kept the seed whole
    aged = policy.age(seeded, 500)
    assert float(aged.evidence_b()[0]) < 1e-3
    assert float(aged.alpha_b()[0]) == pytest.approx(policy.PRIOR_ALPHA, abs=1e-3)


def test_the_forecast_weighs_recent_acceptance_by_how_far_the_row_has_to_go():
    """`forecast_alpha_b` over r remaining tokens: recent acceptance weighted by the mean of
    exp(-t / FORECAST_TOKENS) over those tokens (summed here directly), the seed's rate for the
    rest; rows without a seed keep their recent estimate."""
    state = policy.PolicyState.init(3, 4, seed=(0.8, policy.SEED_WEIGHT), live_b=jnp.asarray([True, True, False]))
    live = jnp.ones((3,), bool)
    for accepted in (0, 1, 0):
        state = policy.observe(state, jnp.zeros((3, 4)), jnp.asarray([4, 4, 4]), jnp.asarray([accepted] * 3), live)
    recent = np.asarray(state.alpha_b())
    for r in (1, 5, 16, 80, 1000):
        t = np.arange(r) + 0.5                   # midpoints of the remaining tokens
        weight = np.mean(np.exp(-t / policy.FORECAST_TOKENS))
        want = weight * recent[:2] + (1 - weight) * 0.8
        got = np.asarray(state.forecast_alpha_b(jnp.full((3,), r)))
        np.testing.assert_allclose(got[:2], want, atol=2e-3 * max(1.0, 16 / r))
        assert got[2] == pytest.approx(recent[2])            # no seed: the recent estimate


def test_a_dip_stops_drafting_only_near_the_rows_end():
    """The dip of the test above (acceptances 2, 0, 0, 4, 0 at k = 4), seeded with a measured 0.8
    over a window of trials, at step times where that rate favours drafting and the dip favours
    plain decoding. Draft lengths follow recent acceptance either way; a stop, which stands for
    the rest of the row, is judged over its remaining tokens: with 80 tokens to go the row keeps
    drafting, with 3 it stops, as it does without a seed or without the remaining tokens. A row
    running above its seed (all accepted) chooses as it would without the forecast."""
    ks = (0, 1, 2, 3, 4)
    seconds = jnp.asarray([0.8, 1.6, 1.9, 2.1, 2.4]) * 1e-3
    live = jnp.ones((1,), bool)

    def after(outcomes, seed=(0.8, policy.SEED_WEIGHT)):
        state = policy.PolicyState.init(1, 4, seed=seed)
        for accepted in outcomes:
            state = policy.observe(state, jnp.zeros((1, 4)), jnp.asarray([4]), jnp.asarray([accepted]), live)
        return state

    def choice(state, remaining, draining=False):
        drain = None if remaining is None else (jnp.asarray([remaining], jnp.float32), jnp.bool_(draining))
        return int(policy.choose_k(state, live, ks, seconds, optimistic=False, current=4, drain=drain))

    dip = after((2, 0, 0, 4, 0, 1, 0))
    assert policy.goodput_of_ks(dip.alpha_b(), live, ks, seconds).argmax() == 0      # recent: plain wins
    for draining in (False, True):
        assert choice(dip, 80.0, draining) > 0
        assert choice(dip, 3.0, draining) == 0
        assert choice(after((2, 0, 0, 4, 0, 1, 0), seed=None), 80.0, draining) == 0
    assert choice(dip, None) == 0
    burst = after((4, 4, 4, 4), seed=(0.3, policy.SEED_WEIGHT))
    for remaining in (3.0, 80.0):
        assert choice(burst, remaining) == choice(burst, None) == 4


def test_a_long_memory_keeps_the_opening_from_probing_what_it_has_measured():
    """Batch 1, a k = 1..3 step costing 2.2-2.6 plain steps, a remembered acceptance of 0.72
    (plain decoding best by the plain estimate, k = 3 ahead by 9% under the seed's optimism). With
    the seed's own weight as the only evidence the opening probes k = 1; with a memory of 100
    trials behind the same rate it opens plain."""
    ks = (0, 1, 2, 3)
    seconds = jnp.asarray([0.6, 1.3, 1.45, 1.56]) * 1e-3
    live = jnp.ones((1,), bool)
    thin = policy.PolicyState.init(1, 0, seed=(0.72, policy.SEED_WEIGHT, 0.0))
    long = policy.PolicyState.init(1, 0, seed=(0.72, policy.SEED_WEIGHT, policy.MEMORY_EVIDENCE))
    assert float(long.memory_trials) == policy.MEMORY_EVIDENCE
    rates = np.asarray(policy.goodput_of_ks(thin.alpha_b(), live, ks, seconds))
    assert rates.argmax() == 0 and rates[1:].max() > rates[0] / 1.1              # a near tie, plain ahead
    assert int(policy.opening_choice(thin, live, ks, seconds)) == 1
    assert int(policy.opening_choice(long, live, ks, seconds)) == 0
    assert float(long.planning_alpha_b()[0]) < float(thin.planning_alpha_b()[0])


@pytest.mark.parametrize("positions", [0, 2, 4, 6])
def test_run_totals_count_every_trial_undecayed(positions):
    """`total_accepted` / `total_trials` sum every live row's outcomes over the run: a row with a
    drafts verified and a accepted tried min(a + 1, v) of them (the accepted ones and the first
    rejection), counted directly here; neither total decays, in drafting steps or in plain ones.
    Whether the state tracks no draft positions, fewer than the drafts (2 of 4) or all of them."""
    rng = np.random.default_rng(8)
    b, k = 5, 4
    state = policy.PolicyState.init(b, 0, seed=(0.7, 3.0), positions=positions)
    want_accepted = want_trials = 0.0
    for step in range(30):
        verified_b = rng.integers(0, k + 1, b)
        accepted_b = np.minimum(rng.integers(0, k + 1, b), verified_b)
        live_b = rng.random(b) < 0.8
        state = policy.observe(state, jnp.log(jnp.asarray(rng.uniform(0.05, 1, (b, k)), jnp.float32)),
                               jnp.asarray(verified_b), jnp.asarray(accepted_b), jnp.asarray(live_b))
        want_accepted += float(np.sum(np.where(live_b, accepted_b, 0)))
        want_trials += float(np.sum(np.where(live_b, np.minimum(accepted_b + 1, verified_b), 0)))
        if step % 10 == 9:
            state = policy.age(state, 7)
    assert float(state.total_accepted) == pytest.approx(want_accepted)
    assert float(state.total_trials) == pytest.approx(want_trials)


def test_calibration_counts_every_tried_slot_in_its_confidence_bin():
    """Without decay, each bin's counts are a histogram of the live rows' tried and accepted
    slots by draft confidence, counted slot by slot here."""
    rng = np.random.default_rng(11)
    b, k, bins = 6, 5, policy.CALIBRATION_BINS
    state = policy.PolicyState.init(b, 0)
    want_tried, want_hit = np.zeros(bins), np.zeros(bins)
    for _ in range(20):
        conf = rng.uniform(0.0, 1.0, (b, k))
        conf[0, 0] = 1.0   # the top bin's edge
        verified_b = rng.integers(0, k + 1, b)
        accepted_b = np.minimum(rng.integers(0, k + 1, b), verified_b)
        live_b = rng.random(b) < 0.8
        state = policy.observe(state, jnp.log(jnp.asarray(conf, jnp.float32)), jnp.asarray(verified_b),
                               jnp.asarray(accepted_b), jnp.asarray(live_b), decay=1.0)
        for i in range(b):
            for j in range(k):
                if live_b[i] and j < verified_b[i] and j <= accepted_b[i]:
                    c = min(int(np.float32(conf[i, j]) * bins), bins - 1)
                    want_tried[c] += 1
                    want_hit[c] += j < accepted_b[i]
    np.testing.assert_allclose(state.calib_tried_c, want_tried, atol=1e-3)
    np.testing.assert_allclose(state.calib_accepted_c, want_hit, atol=1e-3)


def test_acceptance_memory_pools_every_measurement_and_seeds_with_the_largest_weight():
    memory = policy.AcceptanceMemory()
    np.testing.assert_allclose(memory.seed(), [policy.PRIOR_ALPHA, 0.0, 0.0, 0.0])
    memory.remember([0.0, 0.0], [0.0, 0.0])                        # nothing seen: nothing kept
    np.testing.assert_allclose(memory.seed(), [policy.PRIOR_ALPHA, 0.0, 0.0, 0.0])
    rng = np.random.default_rng(5)
    accepted, trials = [], []
    for scale in (3, 8, 30, 0.5, 20):     # a call ending on plain decoding: aged, small counts
        t = rng.uniform(0, scale, 4)
        a = t * rng.uniform(0, 1, 4)
        memory.remember(a, t)
        accepted.append(a)
        trials.append(t)
        alpha, weight, evidence, spread = memory.seed()
        assert spread == 0.0       # no finished request remembered
        assert alpha == pytest.approx(np.sum(accepted) / np.sum(trials), rel=1e-5)
        assert weight == pytest.approx(min(max(np.mean(x) for x in trials), policy.SEED_WEIGHT), rel=1e-5)
        assert evidence == pytest.approx(min(np.sum(trials), policy.MEMORY_EVIDENCE), rel=1e-5)


def test_opening_follows_the_seeded_acceptance_not_the_bare_prior():
    """A k = 1 step costing 1.8 plain steps: under the bare prior (0.6, optimistic 0.8) the run
    opens with plain decoding; seeded with a measured acceptance of 0.95 it opens drafting. And
    where the bare prior drafts (a k = 1 step costing 1.5 plain steps), a measured 0.2 opens plain."""
    ks = (0, 1, 2, 3)
    live = jnp.ones((2,), bool)
    for ratio, seed, bare_drafts in ((0.8, (0.95, policy.SEED_WEIGHT), False), (0.5, (0.2, policy.SEED_WEIGHT), True)):
        seconds = jnp.asarray([1.0 + ratio * k for k in ks], jnp.float32)
        bare = int(policy.opening_choice(policy.PolicyState.init(2, 0), live, ks, seconds))
        seeded_state = policy.PolicyState.init(2, 0, seed=seed)
        seeded = int(policy.opening_choice(seeded_state, live, ks, seconds))
        assert (bare > 0) == bare_drafts and (seeded > 0) != bare_drafts, (ratio, bare, seeded)
        # The seeded choice is the brute-force argmax under the seeded estimate (it drafts) or
        # plain decoding (no k beats it even optimistically).
        alpha = float(seeded_state.alpha_b()[0])
        rates = [float(policy.expected_tokens_per_step(alpha, k)) / float(seconds[i]) for i, k in enumerate(ks)]
        assert seeded == (int(np.argmax(rates)) if seeded else 0)


def test_the_spread_of_requests_acceptance_is_measured_beyond_what_counting_explains():
    """Requests whose own rates are drawn with standard deviation 0.06 about 0.75, each counted
    over 40-200 trials: the memory's spread recovers 0.06; requests of one rate give about 0
    (their rates differ by counting alone). Requests with fewer than SPREAD_MIN_TRIALS trials
    are not counted, only the last SPREAD_REQUESTS are kept, and one request says nothing."""
    rng = np.random.default_rng(11)

    def requests(sd, n):
        trials = rng.integers(40, 200, n)
        rates = np.clip(rng.normal(0.75, sd, n), 0.0, 1.0)
        return rng.binomial(trials, rates), trials

    for sd, lo, hi in ((0.06, 0.045, 0.075), (0.0, 0.0, 0.02)):
        memory = policy.AcceptanceMemory()
        memory.remember_requests(*requests(sd, policy.SPREAD_REQUESTS))
        assert lo <= memory.spread() <= hi, (sd, memory.spread())
        assert memory.seed()[3] == pytest.approx(memory.spread())
    memory = policy.AcceptanceMemory()
    memory.remember_requests([10], [20])
    assert memory.spread() == 0.0                                       # one request
    memory.remember_requests([0, 3], [policy.SPREAD_MIN_TRIALS - 1, 3])   # too few trials: ignored
    assert len(memory.requests) == 1
    memory.remember_requests(*requests(0.06, 2 * policy.SPREAD_REQUESTS))
    assert len(memory.requests) == policy.SPREAD_REQUESTS


def test_drain_with_spread_rates_matches_rows_simulated_at_their_own_rates():
    """Rows whose own acceptance is drawn about the batch's mean with standard deviation 0.05 (the
    tiny-8L pair's requests differ by about that): the slowest row is mostly a slow one, so the
    batch takes more steps than rows sharing the mean rate would. With `spread`, the drain rule
    matches Monte Carlo of such rows within 4%, and it is closer than without it for long drafts,
    whose steps depend most on the rate."""
    rng = np.random.default_rng(21)
    ks, sd, runs = (0, 1, 2, 4, 6), 0.05, 2000
    for mean, remaining in ((0.84, [96] * 4), (0.75, [96] * 16), (0.84, rng.integers(40, 100, 8).tolist())):
        n = len(remaining)
        live, mean_b = np.ones(n, bool), np.full(n, mean)
        with_spread = np.asarray(policy.drain_tokens_per_step(mean_b, live, np.asarray(remaining), ks, spread=sd))
        without = np.asarray(policy.drain_tokens_per_step(mean_b, live, np.asarray(remaining), ks))
        np.testing.assert_allclose(policy.drain_tokens_per_step(mean_b, live, np.asarray(remaining), ks, xp=np,
                                                                spread=sd), with_spread, rtol=1e-5)
        for j, k in enumerate(ks):
            if k == 0:
                assert with_spread[j] == pytest.approx(sum(remaining) / max(remaining), rel=1e-6)
                continue
            steps = np.zeros(runs)
            for r in range(runs):
                rates = np.clip(rng.normal(mean, sd, n), 0.0, 0.999)
                left = np.asarray(remaining, np.int64)
                while (left > 0).any():
                    emitted = 1 + np.cumprod(rng.random((n, k)) < rates[:, None], axis=1).sum(axis=1)
                    steps[r] += 1
                    left = np.maximum(left - emitted, 0)
            want = sum(remaining) / steps.mean()
            assert with_spread[j] == pytest.approx(want, rel=0.04), (mean, remaining, k)
            if k >= 4:
                assert abs(with_spread[j] / want - 1) < abs(without[j] / want - 1), (mean, remaining, k)


def simulated_drain_steps(alpha, k, remaining, runs, rng):
    """Steps until every row has emitted its remaining tokens, each step emitting 1 + the accepted
    prefix of k drafts accepted with probability alpha (the policy's model, simulated)."""
    left = np.tile(np.asarray(remaining, np.int64), (runs, 1))
    steps = np.zeros(runs)
    while (left > 0).any():
        emitted = 1 + np.cumprod(rng.random(left.shape + (k,)) < alpha, axis=2).sum(axis=2)
        steps += (left > 0).any(axis=1)
        left = np.maximum(left - emitted, 0)
    return steps


@pytest.mark.parametrize("alpha", [0.5, 0.84, 0.95])
def test_drain_tokens_per_step_match_simulation(alpha):
    """Remaining tokens over the expected steps until the slowest row is done, against Monte Carlo
    (plain decoding exactly: the longest row's tokens); the host's numpy twin agrees."""
    rng = np.random.default_rng(int(alpha * 100))
    ks = (0, 1, 2, 4, 6)
    for remaining in ([96] * 64, [96] * 4, rng.integers(10, 100, 16).tolist(), [40, 12]):
        live = np.ones(len(remaining), bool)
        alpha_b = np.full(len(remaining), alpha)
        got = np.asarray(policy.drain_tokens_per_step(alpha_b, live, np.asarray(remaining), ks))
        want = [sum(remaining) / simulated_drain_steps(alpha, k, remaining, 2000, rng).mean() if k else
                sum(remaining) / max(remaining) for k in ks]
        np.testing.assert_allclose(got, want, rtol=0.04)
        assert got[0] == pytest.approx(sum(remaining) / max(remaining), rel=1e-6)
        host = policy.drain_tokens_per_step(alpha_b, live, np.asarray(remaining), ks, xp=np)
        np.testing.assert_allclose(host, got, rtol=1e-5)
    # Finished rows neither count nor hold the batch up.
    both = policy.drain_tokens_per_step(np.full(3, alpha), np.array([True, False, True]), np.array([50, 90, 20]), ks)
    np.testing.assert_allclose(both, policy.drain_tokens_per_step(np.full(2, alpha), np.ones(2, bool),
                                                                  np.array([50, 20]), ks), rtol=1e-5)


@pytest.mark.parametrize("alpha", [0.3, 0.84, 0.95])
def test_drain_steps_with_few_tokens_left_are_exact(alpha):
    """A drain's last steps (no row with more than DRAIN_EXACT tokens left) are counted exactly:
    against Monte Carlo within its own noise (the normal approximation is off by up to 18% on
    these cases), and against the closed form for one row with 2 tokens left and k = 1 (one step if the
    draft is accepted, else two: 2 - alpha steps). The host's numpy twin agrees."""
    rng = np.random.default_rng(int(alpha * 100) + 1)
    ks = (0, 1, 2, 4, 6)
    for remaining in ([1, 2, 3], [3] * 64, [16, 5, 1, 9], [policy.DRAIN_EXACT] * 8):
        live = np.ones(len(remaining), bool)
        alpha_b = np.full(len(remaining), alpha)
        got = np.asarray(policy.drain_tokens_per_step(alpha_b, live, np.asarray(remaining), ks))
        want = [sum(remaining) / simulated_drain_steps(alpha, k, remaining, 20000, rng).mean() for k in ks]
        np.testing.assert_allclose(got, want, rtol=0.015)
        host = policy.drain_tokens_per_step(alpha_b, live, np.asarray(remaining), ks, xp=np)
        np.testing.assert_allclose(host, got, rtol=1e-4)    # float32 products over 64 rows
    one = policy.drain_tokens_per_step(np.array([alpha, 0.1]), np.array([True, False]), np.array([2, 40]), (0, 1))
    np.testing.assert_allclose(one, [1.0, 2.0 / (2.0 - alpha)], rtol=1e-5)


def test_a_draining_batch_weighs_its_slowest_row():
    """64 rows of 96 tokens at acceptance 0.84, a k = 1 step costing 1.78 plain steps: one step's
    expected tokens favour k = 1 by 3%, but the slowest of 64 rows needs several steps more than
    the mean, and simulation agrees with the drain rule that plain decoding finishes first. Where
    k = 1 costs 1.5 plain steps, drafting wins either way."""
    rng = np.random.default_rng(7)
    b, alpha, new = 64, 0.84, 96
    ks = (0, 1)
    state = state_with_alpha([alpha] * b)
    live = jnp.ones((b,), bool)
    drain = (jnp.full((b,), new), True)
    k1_steps = simulated_drain_steps(alpha, 1, [new] * b, 2000, rng).mean()
    for ratio, drain_drafts in ((1.78, False), (1.5, True)):
        seconds = jnp.asarray([1.0, ratio], jnp.float32)
        assert int(policy.choose_k(state, live, ks, seconds, optimistic=False)) == 1
        assert int(policy.choose_k(state, live, ks, seconds, optimistic=False, drain=drain)) == int(drain_drafts)
        assert (k1_steps * ratio < new) == drain_drafts, (k1_steps, ratio)
        # Not draining (requests wait for slots): the per-step rule.
        assert int(policy.choose_k(state, live, ks, seconds, optimistic=False, drain=(drain[0], False))) == 1


def test_a_draining_batch_switches_plans_only_when_that_saves_more_than_the_round_trip():
    """Near the end of a static batch (a few tokens left per row) a switch saves little: the
    running plan is kept unless the simulated time to finish drops by more than what a switch
    costs. While requests wait for slots the run goes on, and the switch cost is not weighed."""
    rng = np.random.default_rng(11)
    ks = (0, 1)
    remaining = [3, 2, 1, 2]
    live = jnp.ones((4,), bool)
    state = state_with_alpha([0.84] * 4)
    k1_steps = simulated_drain_steps(0.84, 1, remaining, 20000, rng).mean()
    # k = 1 running, a k = 1 step costing 2.5 plain steps: plain decoding finishes sooner.
    seconds = jnp.asarray([1e-3, 2.5e-3], jnp.float32)
    saved = k1_steps * 2.5e-3 - max(remaining) * 1e-3
    assert saved > 0
    drain = (jnp.asarray(remaining), True)
    for switch_seconds, switches in ((0.2 * saved, True), (5.0 * saved, False)):
        got = int(policy.choose_k(state, live, ks, seconds, optimistic=False, current=1, drain=drain,
                                  switch_seconds=switch_seconds))
        assert got == (0 if switches else 1), (switch_seconds, saved)
        waiting = int(policy.choose_k(state, live, ks, seconds, optimistic=False, current=1,
                                      drain=(drain[0], False), switch_seconds=switch_seconds))
        assert waiting == 0
    # Plain decoding running, a k = 1 step costing 1.05 plain steps: a probe would finish sooner.
    seconds = jnp.asarray([1e-3, 1.05e-3], jnp.float32)
    saved = max(remaining) * 1e-3 - k1_steps * 1.05e-3
    assert saved > 0
    for switch_seconds, probes in ((0.2 * saved, True), (5.0 * saved, False)):
        got = int(policy.probe_choice(state, live, ks, seconds, drain=drain, switch_seconds=switch_seconds))
        assert got == (1 if probes else 0), (switch_seconds, saved)


def test_starting_to_draft_must_pay_for_the_drafters_catch_up():
    """Plain decoding running (or a run opening), a k = 1 step costing 1.05 plain steps at
    acceptance 0.84: drafting would finish the live rows' remaining tokens sooner, by `saved`
    (simulated for a draining batch, from expected tokens per step while requests wait). It
    starts only if that outweighs the drafter's catch-up, whose time is set by the live row with
    the longest backlog (a finished row's is ignored)."""
    rng = np.random.default_rng(12)
    ks = (0, 1)
    remaining = [30, 20, 25, 40]
    live = jnp.asarray([True, True, True, False])
    state = state_with_alpha([0.84] * 4)
    step = jnp.asarray([1e-3, 1.05e-3], jnp.float32)
    drain_saved = max(remaining[:3]) * 1e-3 - simulated_drain_steps(0.84, 1, remaining[:3], 20000, rng).mean() * 1.05e-3
    tokens, per_step = sum(remaining[:3]), 1.0 + 0.84
    waiting_saved = tokens / 3 * (1e-3 - 1.05e-3 / per_step)
    backlog = jnp.asarray([10, 40, 25, 1000])
    for draining, saved in ((True, drain_saved), (False, waiting_saved)):
        assert saved > 0
        drain = (jnp.asarray(remaining), draining)
        for fraction, drafts in ((0.2, True), (5.0, False)):
            position = fraction * saved / 40      # the longest live backlog: 40 positions
            entry = policy.draft_entry_seconds(position, backlog, live)
            np.testing.assert_allclose(float(entry), fraction * saved, rtol=1e-5)
            probe = int(policy.probe_choice(state, live, ks, step, drain=drain, entry_seconds=entry))
            opening = int(policy.opening_choice(state, live, ks, step, drain=drain, entry_seconds=entry))
            assert probe == opening == (1 if drafts else 0), (draining, fraction, saved)


def test_a_probe_must_pay_for_its_own_steps():
    """Plain decoding running, thin evidence: the optimistic estimate hopes k = 3 beats plain
    decoding by 20%, but the probe runs k = 1, which under the plain estimate falls short of plain
    decoding. It probes only where the hoped gain over the remaining tokens outweighs the probe's
    expected loss: PROBE_STEPS steps of k = 1 times k = 1's shortfall (computed here from the
    formula for expected tokens, apart from the policy's code)."""
    ks = (0, 1, 3)
    live = jnp.ones((1,), bool)
    state = state_with_alpha([0.75], weight=10.0)
    step = np.asarray([1e-3, 2e-3, 2.4e-3])
    alpha, hope = float(state.alpha_b()[0]), float(state.planning_alpha_b()[0])

    def rate(a, j):   # tokens per second of plan j at acceptance a
        return ((1 - a ** (ks[j] + 1)) / (1 - a)) / step[j]
    assert rate(hope, 2) > 1.15 * rate(hope, 0) and rate(alpha, 1) < rate(alpha, 0)
    loss = policy.PROBE_STEPS * step[1] * (1 - rate(alpha, 1) / rate(alpha, 0))
    saved_per_token = 1 / rate(hope, 0) - 1 / rate(hope, 2)
    threshold = loss / saved_per_token          # remaining tokens at which the probe breaks even
    assert 4 < threshold < 10
    for remaining, probes in ((int(threshold // 2), False), (int(2 * threshold) + 1, True)):
        drain = (jnp.asarray([remaining]), False)
        got = int(policy.probe_choice(state, live, ks, jnp.asarray(step, jnp.float32), drain=drain))
        assert got == (1 if probes else 0), (remaining, threshold)


def test_plain_horizon_is_the_first_grid_point_where_ageing_probes_speculation_again():
    ks = (0, 1, 2, 3)
    live = jnp.ones((4,), bool)
    for draft_fixed, alpha in ((8e-4, 0.5), (6e-4, 0.55), (1.2e-3, 0.45), (0.05, 0.5)):
        cost = CostModel.from_coefficients(draft_fixed=draft_fixed, draft_per_token=0.0, target_fixed=2e-3,
                                           target_per_token=0.0, speculation_fixed=1e-3)
        seconds = jnp.asarray([cost.step_seconds(4, k, 64) for k in ks], jnp.float32)
        state = state_with_alpha([alpha] * 4, weight=20.0)
        assert int(policy.choose_k(state, live, ks, seconds)) == 0   # speculation is off now
        probes = [n for n in range(1, policy.HORIZON_GRID[-1] + 1)
                  if int(policy.probe_choice(policy.age(state, n), live, ks, seconds)) > 0]
        got = int(policy.plain_horizon(state, live, ks, seconds))
        if probes:
            assert got == min(g for g in policy.HORIZON_GRID if g >= probes[0]), (draft_fixed, alpha)
            assert got < policy.HORIZON_GRID[-1]
        else:   # the draft never pays: plain decoding for the grid's longest stretch
            assert got == policy.HORIZON_GRID[-1]


def best_tetris_tokens(alpha_b, live_b, draft_len, capacity):
    """Brute force: the most drafts expected accepted when live rows verify windows of any lengths
    (each up to `draft_len`, a row's j-th draft surviving with probability alpha^j) that total at
    most `capacity`, plus each live row's correction/bonus token."""
    import itertools

    live = [a for a, on in zip(alpha_b, live_b) if on]
    best = 0.0
    for lens in itertools.product(range(draft_len + 1), repeat=len(live)):
        if sum(lens) <= capacity:
            best = max(best, sum(a ** j for a, n in zip(live, lens) for j in range(1, n + 1)))
    return len(live) + best


def test_a_tetris_plan_is_judged_by_its_best_budget_against_brute_force():
    """With a TETRIS plan among the candidates (drafting k + extra, standard lengths 0..k+extra-1
    beside it), its goodput is that of its best budget, each budget's tokens the best split of
    that many verified drafts over the rows, and the choice is the argmax over all plans."""
    rng = np.random.default_rng(3)
    k, extra, caps = 2, 2, (0, 1, 2, 4, 6)
    ks = (0, 1, 2, 3, k)                       # the TETRIS plan (last) stands for k
    for _ in range(60):
        b = int(rng.integers(1, 4))
        alpha_b = rng.uniform(0, 1, b).astype(np.float32)
        live_b = rng.random(b) < 0.8
        cost = CostModel.from_coefficients(draft_fixed=rng.uniform(0, 4e-3), draft_per_token=rng.uniform(0, 1e-4),
                                           target_fixed=rng.uniform(1e-3, 2e-2), target_per_token=rng.uniform(0, 2e-3),
                                           target_per_attention=rng.uniform(0, 1e-7))
        caps_b = tuple(c for c in caps if c <= b * (k + extra))
        cap_seconds = [cost.step_seconds(b, k + extra, 64, packed_tokens=b + c, window=k + extra + 1) for c in caps_b]
        seconds = [cost.step_seconds(b, j, 64) for j in ks[:-1]] + [cost.step_seconds(
            b, k + extra, 64, packed_tokens=b * (k + 1), window=k + extra + 1)]
        tetris = policy.TetrisPlan(len(ks) - 1, k + extra, caps_b, jnp.asarray(cap_seconds, jnp.float32))
        state = state_with_alpha(alpha_b)
        got = np.asarray(policy.tetris_goodput(state.alpha_b(), jnp.asarray(live_b), tetris))
        alpha = np.asarray(state.alpha_b())
        want = [best_tetris_tokens(alpha, live_b, k + extra, c) / sec for c, sec in zip(caps_b, cap_seconds)]
        np.testing.assert_allclose(got, want, rtol=1e-4)
        if not live_b.any():
            continue
        rates = [sum(float(policy.expected_tokens_per_step(a, j)) for a, on in zip(alpha, live_b) if on) / sec
                 for j, sec in zip(ks[:-1], seconds)] + [max(want)]
        choice = policy.choose_k(state, jnp.asarray(live_b), ks, jnp.asarray(seconds, jnp.float32), optimistic=False,
                                 tetris=tetris)
        top = sorted(rates)[-2:]
        if top[1] > top[0] * (1 + 1e-4):        # float32 on device: skip near-ties
            assert int(choice) == int(np.argmax(rates))


def test_expensive_draft_turns_speculation_off_and_free_perfect_draft_maxes_k():
    ks = tuple(range(7))
    expensive = CostModel.from_coefficients(draft_fixed=0.05, draft_per_token=0.0, target_fixed=0.01,
                                            target_per_token=1e-4)
    free = CostModel.from_coefficients(draft_fixed=0.0, draft_per_token=0.0, target_fixed=0.01,
                                       target_per_token=1e-4)
    live = jnp.ones((4,), bool)

    def seconds(cost):
        return jnp.asarray([cost.step_seconds(4, k, 64) for k in ks], jnp.float32)

    assert int(policy.choose_k(state_with_alpha([0.9] * 4), live, ks, seconds(expensive))) == 0
    assert int(policy.choose_k(state_with_alpha([1.0] * 4), live, ks, seconds(free))) == 6


def test_capacity_goodput_uses_the_sum_of_the_best_cumulative_probabilities():
    rng = np.random.default_rng(2)
    cum = np.cumsum(np.log(rng.uniform(0.1, 1, (4, 5))), axis=1).astype(np.float32)
    caps = (0, 4, 8, 12, 20)
    cost = CostModel.from_coefficients(draft_fixed=1e-3, draft_per_token=0, target_fixed=0.01, target_per_token=1e-3,
                                       target_per_attention=1e-7)
    seconds = [cost.step_seconds(4, 5, 32, packed_tokens=4 + c) for c in caps]
    got = np.asarray(policy.goodput_of_capacities(jnp.asarray(cum.reshape(-1)), 4, caps,
                                                  jnp.asarray(seconds, jnp.float32)))
    flat = np.sort(np.exp(cum.reshape(-1)))[::-1]
    for c, g, sec in zip(caps, got, seconds):
        assert g == pytest.approx((4 + flat[:c].sum()) / sec, rel=1e-5)


def test_calibration_converges_to_the_true_acceptance_curve():
    """A synthetic drafter whose slot is accepted with probability conf**2."""
    rng = np.random.default_rng(3)
    b, k, steps = 16, 4, 400
    state = policy.PolicyState.init(b, 0)
    observe = jax.jit(lambda s, lp, v, a: policy.observe(s, lp, v, a, jnp.ones((b,), bool), decay=1.0))
    for _ in range(steps):
        conf = rng.uniform(0.02, 1.0, (b, k))
        accepted = np.cumprod(rng.random((b, k)) < conf ** 2, axis=1).sum(axis=1)
        state = observe(state, jnp.log(jnp.asarray(conf, jnp.float32)), jnp.full((b,), k, jnp.int32),
                        jnp.asarray(accepted, jnp.int32))
    bins = policy.CALIBRATION_BINS
    centres = (np.arange(bins) + 0.5) / bins
    curve = np.asarray(state.calibration_curve())
    enough = np.asarray(state.calib_tried_c) > 200
    assert enough.sum() >= bins // 2
    np.testing.assert_allclose(curve[enough], centres[enough] ** 2, atol=0.06)
    # Calibrated estimates of a confidence are the curve at its bin.
    lp = jnp.log(jnp.asarray([[0.9, 0.5]], jnp.float32))
    np.testing.assert_allclose(np.exp(policy.calibrated_logprobs(state, lp)), [[curve[14], curve[8]]], rtol=1e-5)
