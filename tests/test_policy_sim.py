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
