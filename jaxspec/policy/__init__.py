"""Goodput control: the policy's formulas (`goodput.py`) and the latency model they price plans
with (`cost.py`). Pure functions of arrays and numbers: no engine, drafter or model."""

from jaxspec.policy.cost import CostModel
from jaxspec.policy.goodput import expected_tokens_per_step

__all__ = ["CostModel", "expected_tokens_per_step"]
