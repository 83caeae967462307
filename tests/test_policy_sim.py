"""The policy simulator (`jaxspec.tools.policy_sim`): its acceptance against the closed form, and the
policy's figures there on scenarios whose answer is known."""

import numpy as np
import pytest

from jaxspec.policy import goodput as policy
from jaxspec.tools import policy_sim

PLANS = tuple((k, None) for k in range(7))


@pytest.mark.parametrize("alpha,k", [(0.5, 2), (0.8, 4), (0.95, 6)])
def test_a_fixed_plan_emits_the_geometric_models_tokens_per_step(alpha, k):
    s = policy_sim.Scenario(name="t", batch=1, tokens=6000, alphas=(alpha,), cost=policy_sim.machine_cost("gpu", 0.1))
    run = policy_sim.simulate(s, PLANS, fixed=k)
    assert run["tokens"] / run["steps"] == pytest.approx(float(policy.expected_tokens_per_step(alpha, k)), rel=0.03)
    assert run["seconds"] == pytest.approx(run["steps"] * s.cost.step_seconds(1, k))


def test_the_policy_drafts_long_windows_where_they_pay_and_not_at_all_where_drafting_is_dear():
    cheap = policy_sim.Scenario(name="cheap", batch=1, alphas=(0.95,), cost=policy_sim.machine_cost("gpu", 0.02))
    (result,) = policy_sim.compare(cheap, PLANS, seeds=2)
    assert result["vs_best"] > 0.95 and result["most_run"] in ("k=5", "k=6")
    dear = policy_sim.Scenario(name="dear", batch=4, alphas=(0.8,), cost=policy_sim.machine_cost("gpu", 2.0))
    (result,) = policy_sim.compare(dear, PLANS, seeds=2)
    assert result["plain_is_best"] and result["most_run"] == "k=0" and result["vs_plain"] > 0.97


def test_probing_finds_acceptance_that_rose_while_decoding_plainly():
    """Acceptance 0.3 then 0.9: without ageing the evidence, plain decoding never ends."""
    s = policy_sim.Scenario(name="rise", batch=1, tokens=256, alphas=(0.3,), drift=(0.3, (0.9,)),
                            cost=policy_sim.machine_cost("gpu", 0.5), round_trip=0.1)
    with_probes, without = policy_sim.compare(s, PLANS, (policy_sim.Rules(), policy_sim.Rules(off_decay=1.0)), seeds=2)
    assert with_probes["vs_best"] > without["vs_best"] + 0.05


def test_a_draining_batch_is_judged_by_its_slow_rows():
    """Half the rows accept 0.9, half 0.3: the batch ends with the slow half, where drafting does
    not pay at batch 64; judged by the rows' sum, the policy drafts."""
    s = policy_sim.Scenario(name="mixed", batch=64, alphas=(0.9, 0.3), cost=policy_sim.machine_cost("gpu", 0.1),
                            round_trip=0.1)
    drain, total = policy_sim.compare(s, PLANS, (policy_sim.Rules(), policy_sim.Rules(drain=False)), seeds=2)
    assert drain["vs_best"] > total["vs_best"] + 0.05
    assert np.isclose(drain["best_vs_plain"], total["best_vs_plain"])


def test_per_slot_rates_keep_windows_short_when_acceptance_falls_along_them():
    """The j-th draft accepted with 0.95 * 0.85^j: the geometric model, fed the window's average
    rate, overrates the deep slots and drafts too far; per-slot rates find the best length."""
    s = policy_sim.Scenario(name="falling", batch=4, tokens=256, alphas=(0.95,), falloff=0.85,
                            cost=policy_sim.machine_cost("gpu", 0.05), round_trip=0.1)
    per_slot, geometric = policy_sim.compare(s, PLANS, (policy_sim.Rules(), policy_sim.Rules(per_slot=False)),
                                             seeds=2)
    assert per_slot["vs_best"] > 0.97 and per_slot["vs_best"] > geometric["vs_best"] + 0.03


# Runs of the simulator before it knew segments (commit ef53638), seed 1: scenario, draft_chunk, tokens, seconds,
# trace (the plan of each step).
BEFORE_SEGMENTS = [
    (dict(batch=4, tokens=48, alphas=(0.9, 0.3), cost=("gpu", 0.1)), 1, 192, 44.696875000000006,
     "533333333333322211111111111111111110"),
    (dict(batch=4, tokens=48, alphas=(0.9, 0.3), cost=("gpu", 0.1)), 4, 192, 44.2625,
     "555522222222222211111111111111111111"),
    (dict(batch=1, tokens=64, alphas=(0.3,), drift=(0.5, (0.9,)), cost=("cpu", 0.5)), 1, 64, 86.4333333333333,
     "1" + "0" * 63),
    (dict(batch=1, tokens=64, alphas=(0.3,), drift=(0.5, (0.9,)), cost=("cpu", 0.5)), 4, 64, 88.09999999999995,
     "1111" + "0" * 59),
    (dict(batch=16, tokens=32, alphas=(0.95,), falloff=0.85, cost=("gpu", 0.02)), 1, 512, 14.410000000000004,
     "6644444444"),
]


def _scenario(cost, **kwargs):
    return policy_sim.Scenario(name="t", cost=policy_sim.machine_cost(*cost), round_trip=0.1, **kwargs)


@pytest.mark.parametrize("scenario,chunk,tokens,seconds,trace", BEFORE_SEGMENTS)
def test_segment_0_decodes_as_before_segments_existed(scenario, chunk, tokens, seconds, trace):
    run = policy_sim.simulate(_scenario(**scenario), PLANS, rules=policy_sim.Rules(draft_chunk=chunk, segment=0),
                              seed=1)
    assert (run["tokens"], run["seconds"], "".join(map(str, run["trace"]))) == (tokens, seconds, trace)


@pytest.mark.parametrize("k", [0, 2, 5])
def test_a_fixed_plan_in_segments_pays_for_the_masked_tail(k):
    s = _scenario(("gpu", 0.1), batch=4, tokens=61, alphas=(0.9, 0.3))
    whole = policy_sim.simulate(s, PLANS, fixed=k)
    step = s.cost.step_seconds(4, k)
    assert whole["seconds"] == pytest.approx(whole["steps"] * step)
    for segment in (1, 2, 4, 8):
        run = policy_sim.simulate(s, PLANS, fixed=k, rules=policy_sim.Rules(segment=segment))
        assert run["tokens"] == whole["tokens"] == 4 * 61
        assert run["steps"] == -(-whole["steps"] // segment) * segment
        assert run["seconds"] == pytest.approx(-(-whole["steps"] // segment) * segment * step)


class _Scripted:
    """Stands in for the compiled choice: returns `plans` in turn and records the plan it was told runs."""

    def __init__(self, plans):
        self.plans, self.told = list(plans), []

    def __call__(self, state, inputs, static):
        self.told.append(int(inputs[2]) if static.has_current else None)
        return self.plans[len(self.told) - 1]


@pytest.mark.parametrize("segment", [1, 2, 4])
def test_the_policy_chooses_once_a_segment_and_switches_only_at_its_end(segment, monkeypatch):
    s = _scenario(("gpu", 0.1), batch=4, tokens=64, alphas=(0.9, 0.3))
    real = policy_sim._choose
    calls = []
    monkeypatch.setattr(policy_sim, "_choose", lambda *args: calls.append(1) or real(*args))
    run = policy_sim.simulate(s, PLANS, rules=policy_sim.Rules(segment=segment))
    assert run["steps"] % segment == 0
    assert len(calls) == run["steps"] // segment   # the opening choice and one at every segment's end but the last
    switches = [i for i in range(1, run["steps"]) if run["trace"][i] != run["trace"][i - 1]]
    assert switches and all(i % segment == 0 for i in switches)


@pytest.mark.parametrize("segment,lag", [(1, 0), (2, 1), (3, 2)])
def test_a_choice_runs_lag_segments_after_the_next(segment, lag, monkeypatch):
    """Segment i runs the choice made at the end of segment i - 1 - lag (the opening one before that);
    every change of plan costs the round trip once, when the new plan starts."""
    script = [1, 3, 5, 3, 1, 5, 5, 3] * 20
    scripted = _Scripted(script)
    monkeypatch.setattr(policy_sim, "_choose", scripted)
    s = _scenario(("gpu", 0.1), batch=2, tokens=64, alphas=(0.8,))
    run = policy_sim.simulate(s, PLANS, rules=policy_sim.Rules(segment=segment, lag=lag))
    ran = run["trace"][::segment]
    assert ran == [script[max(0, i - lag)] for i in range(len(ran))]
    assert run["trace"] == [plan for plan in ran for _ in range(segment)]
    # Each choice is made against the latest plan chosen (the one the host dispatched last).
    assert scripted.told == [None] + script[:len(scripted.told) - 1]
    true_j = policy_sim.plan_seconds(s.cost, s.batch, PLANS)
    changes = sum(a != b for a, b in zip(ran, ran[1:]))
    assert run["seconds"] == pytest.approx(sum(true_j[j] for j in run["trace"]) + changes * s.round_trip)
