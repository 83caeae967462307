"""Goodput control: the policy's formulas (`goodput.py`) and the latency model they price plans
with (`cost.py`). Pure functions of arrays and numbers: no engine, drafter or model."""

from jaxspec.policy.cost import CostModel
from jaxspec.policy.goodput import (
    CATCH_UP_CHUNK,
    CHOOSE_EVERY,
    DECAY,
    DRAIN_QUANTILE,
    HORIZON,
    MARGIN,
    OFF_DECAY,
    PRIOR_ALPHA,
    PRIOR_WEIGHT,
    PolicyState,
    age,
    choose,
    expected_tokens_per_step,
    goodput,
    observe,
    tokens_and_steps,
    windows,
)

__all__ = ["CATCH_UP_CHUNK", "CHOOSE_EVERY", "DECAY", "DRAIN_QUANTILE", "HORIZON", "MARGIN", "OFF_DECAY",
           "PRIOR_ALPHA", "PRIOR_WEIGHT", "CostModel", "PolicyState", "age", "choose", "expected_tokens_per_step",
           "goodput", "observe", "tokens_and_steps", "windows"]
