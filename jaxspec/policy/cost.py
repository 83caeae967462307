"""Latency cost models: how long a draft step and a target verification take, fitted from timings.

The goodput policy divides expected tokens by predicted step time, so it needs step times for
shapes it has not run. The model is linear in the work that scales:

    draft step (one position)  = draft_fixed + draft_per_token * batch
    target verification        = target_fixed + target_per_token * batched_tokens
                                 + target_per_context_token * context_tokens
                                 + target_per_attention * attention_pairs
    speculation (any k >= 1)   = speculation_fixed + speculation_per_row * batch

batched_tokens: the tokens the target runs (N * (k + 1) padded, N + C packed); context_tokens: rows
* cache length; attention_pairs: rows * window * cache length (attention stays padded per row). The
speculation terms are what a drafting step pays on top (steps jump from k = 0 to 1 by more than
from 1 to 2). Seconds.

`CostModel.profile` times the real decode step with the engine's step timer (`jaxspec.engine.timing`
registers itself here) and fits the coefficients by non-negative least squares on relative errors.
The JSON records where it was measured (models, dtype, mesh, device kind); loading one measured
elsewhere warns.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import scipy.optimize

from jaxspec.prompts import check_int

REQUIRED = ("draft_fixed", "draft_per_token", "target_fixed", "target_per_token", "target_per_context_token")
COEFFICIENTS = REQUIRED + ("target_per_attention", "speculation_fixed", "speculation_per_row")

# profile(target, draft, shapes, passes, seed) -> [(batch, k, cache_len, seconds)], set on `import jaxspec`.
_step_timer = None


def register_step_timer(timer) -> None:
    """Sets the function `CostModel.profile` times steps with (`jaxspec.engine.timing.time_points`)."""
    global _step_timer
    _step_timer = timer


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Fitted latency coefficients (seconds) and where they were measured.

    Attributes:
      draft_fixed ... speculation_per_row: the coefficients of the module docstring's model.
      target_name, draft_name, dtype, mesh_shape, device_kind: provenance (checked on load).
      free: the target profiled with no draft model (`jaxspec profile --free`), which prices a free
        drafter's plans (n-gram, suffix, a hybrid's free member alone); without it a hybrid's free plans
        cost this model's step less its draft positions.
      fit: quality of the fit (R^2, worst held-out relative error, number of points).
    """

    draft_fixed: float
    draft_per_token: float
    target_fixed: float
    target_per_token: float
    target_per_context_token: float
    target_per_attention: float = 0.0
    speculation_fixed: float = 0.0
    speculation_per_row: float = 0.0
    target_name: str = ""
    draft_name: str = ""
    dtype: str = ""
    mesh_shape: tuple = ()
    device_kind: str = ""
    free: CostModel | None = None
    fit: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.free is not None and not isinstance(self.free, CostModel):
            raise ValueError(f"free must be a CostModel (the target profiled alone) or None, got {self.free!r}")

    @classmethod
    def from_coefficients(cls, *, draft_fixed: float, draft_per_token: float, target_fixed: float,
                          target_per_token: float, target_per_context_token: float = 0.0,
                          target_per_attention: float = 0.0, speculation_fixed: float = 0.0,
                          speculation_per_row: float = 0.0, **provenance) -> CostModel:
        """A cost model from known coefficients (tests, what-if studies)."""
        given = dict(locals())
        return cls(**{name: float(given[name]) for name in COEFFICIENTS}, **provenance)

    def draft_seconds(self, batch, positions=1, tree=None):
        """`positions` sequential draft positions over `batch` rows; for a tree (`TreeShape`), one
        position, then depth - 1 of `width` tokens per row."""
        if tree is not None:
            return self.draft_seconds(batch) + self.draft_seconds(batch * tree.width, tree.depth - 1)
        return positions * (self.draft_fixed + self.draft_per_token * batch)

    def verify_seconds(self, batched_tokens, context_tokens=0, attention_pairs=0):
        return (self.target_fixed + self.target_per_token * batched_tokens
                + self.target_per_context_token * context_tokens + self.target_per_attention * attention_pairs)

    def step_seconds(self, batch, k, cache_len=0, packed_tokens=None, tree=None):
        """One speculative step at a compiled shape: k draft positions over `batch` rows (or a
        `tree`, of which k nodes per row are verified), then a verification of batch * (k + 1)
        tokens (or `packed_tokens`, packed, whose attention still runs over a padded window per
        row: k + 1, or the tree's columns). k = 0 is a plain step; `cache_len` the cache size."""
        window = k + 1 if tree is None else tree.columns
        tokens = batch * (k + 1) if packed_tokens is None else packed_tokens
        speculation = self.speculation_fixed + self.speculation_per_row * batch if k > 0 else 0.0
        return (self.draft_seconds(batch, k, tree) + speculation
                + self.verify_seconds(tokens, batch * cache_len, batch * window * cache_len))

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mesh_shape": list(self.mesh_shape)}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path, *, expect_device_kind: str | None = None) -> CostModel:
        """Reads a saved cost model; warns when it was measured on another kind of device."""
        return cls._from_dict(json.loads(Path(path).read_text()), path, expect_device_kind)

    @classmethod
    def _from_dict(cls, data: dict, path, expect_device_kind: str | None) -> CostModel:
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{path}: unknown cost-model fields {unknown}")
        missing = [name for name in REQUIRED if name not in data]
        if missing:
            raise ValueError(f"{path}: missing cost-model coefficients {missing}")
        data["mesh_shape"] = tuple(data.get("mesh_shape", ()))
        if data.get("free") is not None:
            data["free"] = cls._from_dict(data["free"], path, expect_device_kind)
        model = cls(**data)
        here = expect_device_kind if expect_device_kind is not None else jax.devices()[0].device_kind
        if model.device_kind and model.device_kind != here:
            warnings.warn(f"cost model {path} was measured on {model.device_kind!r}, this device is {here!r}: "
                          "its step-time predictions may be far off; re-run `jaxspec profile`", stacklevel=2)
        return model

    @classmethod
    def profile(cls, target, draft=None, *, batches=(1, 2, 4, 8, 16), ks=(0, 1, 2, 4), cache_lens=(128, 512),
                passes: int = 3, seed: int = 0, mesh_shape: tuple = ()) -> CostModel:
        """Times the real decode step of `target` with `draft` (a Model, an `EagleDrafter`, or None:
        n-gram drafts) on this device over the grid `batches` x `ks` x `cache_lens` (ks must include
        0 and two values >= 1), the median of `passes` shuffled passes
        (`jaxspec.engine.timing.time_points`), and fits the model to it."""
        if 0 not in ks or len({k for k in ks if k >= 1}) < 2:
            raise ValueError(f"ks must include 0 and at least two values >= 1 to separate drafting, speculation "
                             f"and verification costs, got {ks}")
        check_int("passes", passes, 1)
        shapes = [(b, k, s) for b in batches for k in ks for s in cache_lens]
        points = _step_timer(target, draft, shapes, passes=passes, seed=seed)
        dtype = "/".join(filter(None, (str(target.dtype), target.quantization)))
        cost = cls.fit_points(points, target_name=target.config.name,
                              draft_name="ngram" if draft is None else draft.config.name if hasattr(
                                  draft, "config") else draft.head.config.layer.name, dtype=dtype,
                              mesh_shape=tuple(mesh_shape), device_kind=jax.devices()[0].device_kind)
        cost.fit["step"].update(passes=passes)
        return cost

    @classmethod
    def fit_points(cls, points, **provenance) -> CostModel:
        """Fits every coefficient to measured steps `(batch, k, cache_len, seconds)` (a profile's
        `fit["step"]["points_seconds"]` can be refitted this way)."""
        points = [tuple(p) for p in points]
        # Step = k * draft(b) + [k > 0] * speculation(b) + verify(b * (k + 1) tokens, b * s slots,
        # b * (k + 1) * s pairs), with s the compiled cache size; columns in the order of COEFFICIENTS.
        x = np.array([[k, k * b, 1.0, b * (k + 1), b * s, b * (k + 1) * s, float(k > 0), float(k > 0) * b]
                      for b, k, s, _ in points], np.float64)
        y = np.array([sec for *_, sec in points], np.float64)
        coef, fit = fit_linear(x, y)
        fit["points_seconds"] = [[int(b), int(k), int(s), float(sec)] for b, k, s, sec in points]
        return cls(**{name: float(c) for name, c in zip(COEFFICIENTS, coef, strict=True)}, **provenance,
                   fit={"step": fit})


OUTLIER_RATIO = 4.0   # a profile's timings that its absolute fit misses by more than this are noise


def fit_linear(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict]:
    """Non-negative least squares of y on the columns of x, minimising squared relative errors
    (each point weighted by 1 / y); every fourth point is held out of a first fit to measure the
    worst relative error on shapes the fit has not seen, then all points fit the coefficients.

    Weighted 1 / y, one timing that noise made near zero would outweigh all others; so points that
    an absolute fit (which such a point cannot sway) predicts more than OUTLIER_RATIO times off are
    left out (`fit["outliers"]` counts them), unless too few points would remain.
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    ratio = (x @ _nonnegative_lstsq(x, y)) / np.maximum(np.abs(y), 1e-300)
    outlier = (ratio > OUTLIER_RATIO) | (ratio * OUTLIER_RATIO < 1)
    kept = ~outlier if (~outlier).sum() >= x.shape[1] else np.ones(len(y), bool)
    x, y = x[kept], y[kept]
    w = 1.0 / np.abs(y)
    held = np.zeros(len(y), bool)
    if len(y) >= 2 * x.shape[1]:
        held[3::4] = True
    coef_train = _nonnegative_lstsq(x[~held] * w[~held, None], y[~held] * w[~held])
    worst = float(np.max(np.abs(x[held] @ coef_train - y[held]) / y[held])) if held.any() else None
    coef = _nonnegative_lstsq(x * w[:, None], y * w)
    residual = y - x @ coef
    r2 = 1.0 - float(residual @ residual) / float(((y - y.mean()) ** 2).sum()) if len(y) > 1 and y.std() > 0 else 1.0
    return coef, {"r2": r2, "worst_heldout_rel_error": worst, "points": int(len(kept)), "heldout": int(held.sum()),
                  "outliers": int((~kept).sum())}


def _nonnegative_lstsq(x, y):
    """Least squares with every coefficient >= 0 (Lawson-Hanson's active set, scipy's `nnls`; not
    dropping negative coefficients and refitting, which on noisy steps can cascade)."""
    scale = np.maximum(np.linalg.norm(x, axis=0), 1e-300)   # columns span ten orders of magnitude
    coef, _ = scipy.optimize.nnls(x / scale, y)
    return coef / scale
