"""`MeshConfig`: which devices hold the target (a data x tensor mesh) and which the draft. Devices
come from `jax.devices()`, which under `jax.distributed` lists every process's, so a config spans hosts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxspec.prompts import check_int

DATA, TENSOR = "data", "tensor"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The target's slice is the first target_dp * target_tp devices (tensor-parallel: heads, MLP width
    and vocabulary split; data-parallel: batch rows split); the draft's the next draft_tp devices
    (tensor-parallel), or with draft_tp = 0 the target's mesh. `devices`: default `jax.devices()`."""

    target_tp: int = 1
    target_dp: int = 1
    draft_tp: int = 1
    devices: Any = None

    def __post_init__(self):
        for name, low in (("target_tp", 1), ("target_dp", 1), ("draft_tp", 0)):
            check_int(f"MeshConfig.{name}", getattr(self, name), low)
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def num_devices(self) -> int:
        return self.target_dp * self.target_tp + self.draft_tp

    @property
    def separate_draft(self) -> bool:
        return self.draft_tp > 0

    def _devices(self) -> tuple:
        devices = self.devices if self.devices is not None else tuple(jax.devices())
        if len(devices) < self.num_devices:
            raise ValueError(f"MeshConfig(target_dp={self.target_dp}, target_tp={self.target_tp}, "
                             f"draft_tp={self.draft_tp}) needs target_dp * target_tp + draft_tp = "
                             f"{self.num_devices} devices, but only {len(devices)} are available")
        return devices

    def target_mesh(self) -> Mesh:
        """The target's (data, tensor) mesh over the first target_dp * target_tp devices."""
        return self._mesh(0, self.target_dp, self.target_tp)

    def draft_mesh(self) -> Mesh:
        """The draft's (data=1, tensor=draft_tp) mesh over the next draft_tp devices (or the target's)."""
        if not self.separate_draft:
            return self.target_mesh()
        return self._mesh(self.target_dp * self.target_tp, 1, self.draft_tp)

    def _mesh(self, start: int, dp: int, tp: int) -> Mesh:
        return Mesh(np.asarray(self._devices()[start:start + dp * tp], dtype=object).reshape(dp, tp), (DATA, TENSOR))

    def check(self, target_config, draft_config=None) -> None:
        """Raises ValueError when the devices or the models' widths do not fit this mesh."""
        self._devices()
        check_divisible(target_config, self.target_tp, "target_tp")
        if draft_config is not None:
            check_divisible(draft_config, self.draft_tp if self.separate_draft else self.target_tp,
                            "draft_tp" if self.separate_draft else "target_tp (the draft shares the target mesh)")


def check_divisible(config, tp: int, name: str) -> None:
    """Every tensor-sharded width of the model must divide evenly over the tensor axis."""
    for field, value in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                         ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if value % tp:
            raise ValueError(f"{name}={tp} does not divide {field}={value} of model {config.name!r}: "
                             f"each tensor-parallel device must hold an equal share")
