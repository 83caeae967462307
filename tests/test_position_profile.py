"""Acceptance per draft position (`policy.PolicyState.profile_p`): the per-position model against
simulation, the tracked counts against a known profile and against a naive loop's counts, and
the choice against brute force."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import policy
from jaxspec.cost import CostModel

RISING = np.array([0.9, 0.97, 1.02, 1.05, 1.08, 1.1], np.float32)
FALLING = RISING[::-1].copy()


def simulate_steps(alpha, profile, k, runs, rng):
    """Tokens one verification emits with k drafts, the p-th accepted (given the ones before it
    were) with probability alpha * profile[p], at most 1."""
    if k == 0:
        return np.ones(runs)
    rates = np.minimum(alpha * profile[np.minimum(np.arange(k), len(profile) - 1)], 1.0)
    return 1 + np.cumprod(rng.random((runs, k)) < rates, axis=1).sum(axis=1)


@pytest.mark.parametrize("profile", [RISING, FALLING], ids=["rising", "falling"])
def test_expected_tokens_and_moments_with_a_profile_match_simulation(profile):
    rng = np.random.default_rng(3)
    ks = (0, 1, 2, 4, 6, 8)                  # 8: past the profile, whose last entry then holds
    alpha_b = np.array([0.3, 0.7, 0.85, 0.97])
    got = np.asarray(policy.expected_tokens(jnp.asarray(alpha_b), ks, jnp.asarray(profile)))
    np.testing.assert_allclose(policy.expected_tokens(alpha_b, ks, profile, xp=np), got, rtol=1e-5)
    for b, alpha in enumerate(alpha_b):
        mean, var = policy.token_moments(alpha, ks, xp=np, profile=profile)
        for j, k in enumerate(ks):
            emitted = simulate_steps(alpha, profile, k, 200_000, rng)
            assert got[j, b] == pytest.approx(emitted.mean(), rel=0.01), (alpha, k)
            assert mean[j] == pytest.approx(emitted.mean(), rel=0.01)
            assert var[j] == pytest.approx(emitted.var(), rel=0.05, abs=1e-3)
    # A flat profile is the geometric model, exactly as without one.
    flat = np.asarray(policy.expected_tokens(jnp.asarray(alpha_b), ks, jnp.ones(6)))
    geometric = np.asarray(policy.expected_tokens_per_step(alpha_b[None, :], np.asarray(ks, np.float32)[:, None]))
    np.testing.assert_allclose(flat, geometric, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(policy.expected_tokens(jnp.asarray(alpha_b), ks)), geometric, rtol=1e-6)


@pytest.mark.parametrize("remaining", [[96] * 4, [40, 12], [12, 5, 3]], ids=["normal", "mixed", "exact"])
def test_drain_with_a_profile_matches_simulation(remaining):
    """Remaining tokens over the expected steps until the slowest row is done (the normal
    approximation, and the exact count once no row has more than DRAIN_EXACT tokens left), each
    row's drafts accepted along the rising profile; the host's twin agrees."""
    rng = np.random.default_rng(len(remaining))
    ks, alpha = (0, 1, 3, 6), 0.8
    live = np.ones(len(remaining), bool)
    got = np.asarray(policy.drain_tokens_per_step(np.full(len(remaining), alpha), live, np.asarray(remaining), ks,
                                                  profile=jnp.asarray(RISING)))
    host = policy.drain_tokens_per_step(np.full(len(remaining), alpha), live, np.asarray(remaining), ks, xp=np,
                                        profile=RISING)
    np.testing.assert_allclose(host, got, rtol=1e-4)
    for j, k in enumerate(ks):
        left = np.tile(np.asarray(remaining), (4000, 1))
        steps = np.zeros(4000)
        while (left > 0).any():
            emitted = simulate_steps(alpha, RISING, k, left.size, rng).reshape(left.shape)
            steps += (left > 0).any(axis=1)
            left = np.maximum(left - emitted, 0)
        assert got[j] == pytest.approx(sum(remaining) / steps.mean(), rel=0.04), k


def test_tetris_goodput_ranks_slots_by_the_profiles_cumulative_rates():
    """A TETRIS budget's expected tokens are the sum of its C best cumulative acceptances, which
    with a profile are products of alpha * profile[p] along each row."""
    alpha_b, live_b = jnp.asarray([0.9, 0.6]), jnp.asarray([True, True])
    plan = policy.TetrisPlan(index=0, draft_len=4, capacities=(0, 2, 5, 8), seconds_c=jnp.ones(4))
    got = np.asarray(policy.tetris_goodput(alpha_b, live_b, plan, jnp.asarray(RISING)))
    cumulative = sorted((np.prod([min(a * RISING[p], 1.0) for p in range(i + 1)])
                         for a in (0.9, 0.6) for i in range(4)), reverse=True)
    want = [2 + sum(cumulative[:c]) for c in (0, 2, 5, 8)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def observe_rows(state, rates, steps, rng, b=8, k=6):
    """`steps` verifications of b rows with k drafts, the p-th accepted (given the ones before it
    were) with probability rates[p]; returns the state and each position's (tried, accepted)."""
    tried, accepted = np.zeros(k), np.zeros(k)
    for _ in range(steps):
        accepted_b = np.cumprod(rng.random((b, k)) < rates, axis=1).sum(axis=1)
        for n in accepted_b:
            tried[:min(n + 1, k)] += 1
            accepted[:n] += 1
        state = policy.observe(state, jnp.zeros((b, k)), jnp.full((b,), k), jnp.asarray(accepted_b),
                               jnp.ones((b,), bool))
    return state, tried, accepted


def test_position_counts_learn_a_known_profile():
    """Drafts accepted along a known rising profile: the tracked rates (profile times the pooled
    rate) come within sampling noise of the true ones, and the run's totals are exactly the
    counts of a plain loop over the same outcomes."""
    rng = np.random.default_rng(0)
    rates = np.array([0.72, 0.8, 0.86, 0.9, 0.93, 0.95])
    state, tried, accepted = observe_rows(policy.PolicyState.init(8, 0, positions=6), rates, 400, rng)
    np.testing.assert_array_equal(np.asarray(state.pos_total_tried_p), tried)
    np.testing.assert_array_equal(np.asarray(state.pos_total_accepted_p), accepted)
    pooled = float(np.sum(state.pos_accepted_p) / np.sum(state.pos_tried_p))
    np.testing.assert_allclose(np.asarray(state.profile_p()) * pooled, rates, atol=0.04)
    # Without positions nothing is tracked and the policy keeps the geometric model.
    assert policy.PolicyState.init(8, 0).profile_p() is None


def test_the_remembered_profile_carries_the_deepest_measured_level_to_positions_never_reached():
    memory = policy.AcceptanceMemory()
    np.testing.assert_array_equal(memory.profile(4), np.ones(4))
    tried = np.array([4000.0, 3000.0, 2000.0])
    memory.remember_positions(np.array([0.7, 0.85, 0.95]) * tried, tried)
    profile = memory.profile(6)
    pooled = (0.7 * 4000 + 0.85 * 3000 + 0.95 * 2000) / 9000
    np.testing.assert_allclose(profile[:3] * pooled, [0.7, 0.85, 0.95], atol=0.01)
    np.testing.assert_allclose(profile[3:], profile[2], rtol=1e-6)
    # A run's seed carries it after (alpha, weight, evidence, spread).
    memory.remember([0.8 * 9000], [9000.0])
    np.testing.assert_allclose(memory.seed(6)[4:], profile, rtol=1e-6)
    state = policy.PolicyState.init(2, 0, seed=memory.seed(6), positions=6)
    np.testing.assert_allclose(np.asarray(state.profile_p()), profile, rtol=1e-5)


def test_choice_with_a_profile_is_the_brute_force_argmax_and_departs_from_the_flat_one():
    """Rows' alphas and a rising profile: the policy's choice is the argmax of goodput computed
    by explicit products along each row; with the same counts but no profile (the geometric
    model) the choice is a shorter draft, so the profile is not vacuous here."""
    ks = (0, 1, 2, 3, 4, 5, 6)
    seconds = np.array([1.0] + [1.3 + 0.4 * k for k in ks[1:]], np.float32)   # a draft position costs 0.4 steps
    rng = np.random.default_rng(1)
    state, _, _ = observe_rows(policy.PolicyState.init(4, 0, positions=6),
                               np.array([0.62, 0.78, 0.88, 0.94, 0.97, 0.98]), 300, rng, b=4)
    live = jnp.ones(4, bool)
    got = int(policy.choose_k(state, live, ks, jnp.asarray(seconds), optimistic=False))
    alpha_b, profile = np.asarray(state.alpha_b()), np.asarray(state.profile_p())
    tokens = [sum(1 + sum(np.prod([min(a * profile[p], 1.0) for p in range(i)]) for i in range(1, k + 1))
                  for a in alpha_b) for k in ks]
    assert got == int(np.argmax(np.asarray(tokens) / seconds))
    flat = state.replace(pos_counts_4p=jnp.zeros((4, 0)), profile_seed_p=jnp.zeros(0))
    assert 0 < int(policy.choose_k(flat, live, ks, jnp.asarray(seconds), optimistic=False)) < got


def draft_continuation(draft, sequence, t: int, k: int) -> list[int]:
    """The draft model's greedy k-token continuation of sequence[:t], uncached: one padded forward
    per drafted token (causal: padding after the prefix does not change its logits)."""
    tokens = list(sequence[:t])
    for _ in range(k):
        padded = np.zeros((1, len(sequence) + 8), np.int32)   # one width: one compiled forward (k <= 8)
        padded[0, :len(tokens)] = tokens
        tokens.append(int(np.argmax(np.asarray(draft.logits(jnp.asarray(padded)))[0, len(tokens) - 1])))
    return tokens[t:]


def test_acceptance_by_position_is_what_a_naive_loop_counts():
    """Goodput decoding of one prompt with a draft that accepts about 0.6: the reported acceptance
    per draft position equals what a naive loop counts from the call's own trace of draft lengths,
    the draft's uncached greedy continuations and the target's greedy tokens; the totals agree
    with the call's accepted tokens; the output is the target's."""
    from jaxspec.benchmarking import layer_skip_pair
    cfg = jaxspec.ModelConfig.preset("tiny").replace(vocab_size=16, name="tiny-v16")
    target, draft = layer_skip_pair(cfg, draft_layers=1, damping=0.3, sharpness=2.0)
    prompt, new = [3, 7, 1, 12, 5, 9, 2], 40
    cost = CostModel.from_coefficients(draft_fixed=1.2e-3, draft_per_token=0.0, target_fixed=5e-3,
                                       target_per_token=0.0)
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(
        k=3, policy="goodput", cost_model=cost, measure_plans=False))
    got = decoder.generate([prompt], max_new_tokens=new)
    assert got.tokens == jaxspec.generate(target, [prompt], max_new_tokens=new).tokens
    # The target's greedy tokens past the budget: what the last steps' drafts were checked against.
    sequence = prompt + jaxspec.generate(target, [prompt], max_new_tokens=new + 4).tokens[0]
    trace = got.stats.extra["k_trace"]
    assert any(k > 0 for k in trace)
    tried, accepted = np.zeros(3), np.zeros(3)
    t = len(prompt) + 1        # the prefill emits the first token
    for k in trace:
        if k == 0:
            t += 1
            continue
        proposal = draft_continuation(draft, sequence, t, k)
        n = 0
        while n < k and proposal[n] == sequence[t + n]:
            n += 1
        tried[:min(n + 1, k)] += 1
        accepted[:n] += 1
        t += n + 1
    reported = got.stats.extra["acceptance_by_position"]
    assert [r is None for r in reported] == [b == 0 for b in tried]
    np.testing.assert_allclose([r for r in reported if r is not None], accepted[tried > 0] / tried[tried > 0],
                               rtol=1e-6)
    assert accepted.sum() == got.stats.accepted_tokens


def test_position_profile_must_be_a_bool():
    with pytest.raises(ValueError, match="position_profile must be a bool"):
        jaxspec.SpecConfig(k=2, policy="goodput", cost_model=CostModel.from_coefficients(
            draft_fixed=1e-3, draft_per_token=0.0, target_fixed=5e-3, target_per_token=0.0), position_profile=1)
