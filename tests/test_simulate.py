"""The pipeline simulation against closed forms and the geometric acceptance model."""

import pytest

from jaxspec.policy import goodput as policy
from jaxspec.tools.mesh_sim import simulate


@pytest.mark.parametrize("d, v", [(1.0, 3.0), (3.0, 1.0), (2.0, 2.0)])
def test_constant_times_match_the_closed_forms(d, v):
    n, rows = 20, 4
    common = dict(k=3, alpha=0.0, draft_seconds=lambda b: d, verify_seconds=lambda b: v)
    seq = simulate([n] * 2 * rows, slots=2 * rows, pipeline=False, **common)
    pipe = simulate([n] * 2 * rows, slots=2 * rows, pipeline=True, **common)
    # alpha = 0: one token per row per step. Sequential: n steps of draft + verify, one after the other.
    assert seq.tokens == pipe.tokens == 2 * rows * n
    assert seq.steps == n and seq.seconds == pytest.approx(n * (d + v))
    # Pipelined: 2n half-steps; after the first draft the slower slice never idles.
    assert pipe.steps == 2 * n and pipe.seconds == pytest.approx(d + v + (2 * n - 1) * max(d, v))
    assert pipe.busy_draft == pytest.approx(2 * n * d) and pipe.busy_target == pytest.approx(2 * n * v)


@pytest.mark.parametrize("alpha, k", [(0.5, 2), (0.8, 4), (0.95, 6)])
def test_tokens_per_step_follow_the_geometric_model(alpha, k):
    result = simulate([20000] * 8, slots=8, k=k, alpha=alpha, draft_seconds=lambda b: 0.0,
                      verify_seconds=lambda b: 1.0, pipeline=False, seed=1)
    # Long budgets: almost no step is cut by a budget, so tokens per row-step is the model's mean.
    per_row_step = result.tokens / (result.steps * 8)
    assert per_row_step == pytest.approx(float(policy.expected_tokens_per_step(alpha, k)), rel=0.02)


def test_tail_runs_sequentially_and_queue_refills():
    # One very long request: after the others drain, its lane runs alone (draft + verify per step).
    budgets = [1] * 7 + [50]
    pipe = simulate(budgets, slots=4, k=2, alpha=0.0, draft_seconds=lambda b: 1.0, verify_seconds=lambda b: 1.0,
                    pipeline=True)
    assert pipe.tokens == sum(budgets)
    # The long request needs 50 steps; at least ~45 of them run in the tail at 2 s per step.
    assert pipe.seconds >= 2 * 45
    with pytest.raises(ValueError, match="slots must be >= 2"):
        simulate([1], slots=1, k=1, alpha=0.5, draft_seconds=len, verify_seconds=len, pipeline=True)
