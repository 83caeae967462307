"""Latency cost models: how long a draft step and a target verification take, fitted from timings.

The goodput policy divides expected tokens by predicted step time, so it needs step times for
shapes it has not run yet. Both models are linear in the work that scales:

    draft step (one position)  = draft_fixed + draft_per_token * batch
    target verification        = target_fixed + target_per_token * batched_tokens
                                 + target_per_context_token * context_tokens
                                 + target_per_attention * attention_pairs

with batched_tokens the tokens the target runs (N * (k + 1) padded, N + C packed), context_tokens
the key/value slots attention reads (rows * cache length: the compiled attention reads every slot
of the static cache, masked), and attention_pairs the query x key products it computes (rows *
window * cache length: attention runs in the padded per-row layout even when the token-wise work
is packed). The first three terms are the contract's; the last is what makes a window of k + 1
tokens dearer than k + 1 separate decode steps at long contexts. Seconds throughout.

`CostModel.profile` times both on the current device the way the decode loop runs them: inside one
compiled loop (no per-call dispatch, the cache updated in place), after warm-up, with
`block_until_ready`, medians over repeats. It fits the coefficients by non-negative least squares
and reports R^2 and the worst relative error on held-out points. A cost model is only valid where
it was measured: the JSON records model names, dtype, mesh shape and device kind, and loading one
measured elsewhere warns.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

REQUIRED = ("draft_fixed", "draft_per_token", "target_fixed", "target_per_token", "target_per_context_token")
COEFFICIENTS = REQUIRED + ("target_per_attention",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Fitted latency coefficients (seconds) and where they were measured.

    Attributes:
      draft_fixed, draft_per_token: one draft position = fixed + per_token * batch.
      target_fixed, target_per_token, target_per_context_token, target_per_attention: one
        verification = fixed + per_token * batched tokens + per_context_token * key/value slots
        read + per_attention * query x key products.
      target_name, draft_name, dtype, mesh_shape, device_kind: provenance (checked on load).
      fit: quality of the fit (R^2, worst held-out relative error, number of points).
    """

    draft_fixed: float
    draft_per_token: float
    target_fixed: float
    target_per_token: float
    target_per_context_token: float
    target_per_attention: float = 0.0
    target_name: str = ""
    draft_name: str = ""
    dtype: str = ""
    mesh_shape: tuple = ()
    device_kind: str = ""
    fit: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")

    @classmethod
    def from_coefficients(cls, *, draft_fixed: float, draft_per_token: float, target_fixed: float,
                          target_per_token: float, target_per_context_token: float = 0.0,
                          target_per_attention: float = 0.0, **provenance) -> CostModel:
        """A cost model from known coefficients (tests, what-if studies)."""
        return cls(draft_fixed=float(draft_fixed), draft_per_token=float(draft_per_token),
                   target_fixed=float(target_fixed), target_per_token=float(target_per_token),
                   target_per_context_token=float(target_per_context_token),
                   target_per_attention=float(target_per_attention), **provenance)

    # --- predictions ---

    def draft_seconds(self, batch, positions=1):
        """`positions` sequential draft positions over `batch` rows."""
        return positions * (self.draft_fixed + self.draft_per_token * batch)

    def verify_seconds(self, batched_tokens, context_tokens=0, attention_pairs=0):
        return (self.target_fixed + self.target_per_token * batched_tokens
                + self.target_per_context_token * context_tokens + self.target_per_attention * attention_pairs)

    def step_seconds(self, batch, k, cache_len=0, packed_tokens=None, window=None):
        """One speculative step at a compiled shape: k draft positions over `batch` rows, then a
        verification of batch * (k + 1) tokens (or `packed_tokens` for a packed TETRIS pass, whose
        attention still runs over the padded window of `window` tokens per row, default k + 1).
        k = 0 is a plain decoding step. `cache_len` is the compiled cache size."""
        window = k + 1 if window is None else window
        tokens = batch * (k + 1) if packed_tokens is None else packed_tokens
        return self.draft_seconds(batch, k) + self.verify_seconds(tokens, batch * cache_len,
                                                                  batch * window * cache_len)

    # --- persistence ---

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mesh_shape"] = list(self.mesh_shape)
        return d

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path, *, expect_device_kind: str | None = None) -> CostModel:
        """Reads a saved cost model; warns when it was measured on another kind of device."""
        data = json.loads(Path(path).read_text())
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{path}: unknown cost-model fields {unknown}")
        missing = [name for name in REQUIRED if name not in data]
        if missing:
            raise ValueError(f"{path}: missing cost-model coefficients {missing}")
        data["mesh_shape"] = tuple(data.get("mesh_shape", ()))
        model = cls(**data)
        here = expect_device_kind if expect_device_kind is not None else jax.devices()[0].device_kind
        if model.device_kind and model.device_kind != here:
            warnings.warn(f"cost model {path} was measured on {model.device_kind!r}, this device is {here!r}: "
                          "its step-time predictions may be far off; re-run `jaxspec profile`", stacklevel=2)
        return model

    # --- measurement ---

    @classmethod
    def profile(cls, target, draft=None, *, batches=(1, 2, 4, 8, 16), tokens_per_row=(1, 2, 4, 8),
                cache_lens=(128, 512), repeats: int = 5, mesh_shape: tuple = ()) -> CostModel:
        """Times the draft step and the target verification on this device and fits the model.

        Args:
          target: the target jaxspec.Model.
          draft: the draft jaxspec.Model, or None for a drafter without a model (n-gram lookup:
            its draft cost is taken as zero).
          batches, tokens_per_row, cache_lens: the grid of shapes timed.
          repeats: timed runs per shape (median taken) after one warm-up.
        """
        from jaxspec.models.model import Model

        if not isinstance(target, Model):
            raise ValueError(f"target must be a jaxspec.Model, got {type(target).__name__}")
        if draft is not None and not isinstance(draft, Model):
            raise ValueError(f"draft must be a jaxspec.Model or None, got {type(draft).__name__}")
        mid_cache = max(cache_lens)
        target_rows = [(b, t, s, _time_forward(target, b, t, s, repeats))
                       for b in batches for t in tokens_per_row for s in cache_lens]
        x_target = np.array([[1.0, b * t, b * s, b * t * s] for b, t, s, _ in target_rows])
        y_target = np.array([sec for *_, sec in target_rows])
        target_coef, target_fit = fit_linear(x_target, y_target)
        if draft is not None:
            draft_rows = [(b, _time_forward(draft, b, 1, mid_cache, repeats)) for b in batches]
            x_draft = np.array([[1.0, b] for b, _ in draft_rows])
            y_draft = np.array([sec for _, sec in draft_rows])
            draft_coef, draft_fit = fit_linear(x_draft, y_draft)
        else:
            draft_coef, draft_fit = np.zeros(2), {}
        return cls(draft_fixed=float(draft_coef[0]), draft_per_token=float(draft_coef[1]),
                   target_fixed=float(target_coef[0]), target_per_token=float(target_coef[1]),
                   target_per_context_token=float(target_coef[2]), target_per_attention=float(target_coef[3]),
                   target_name=target.config.name, draft_name=draft.config.name if draft is not None else "none",
                   dtype=str(target.dtype), mesh_shape=tuple(mesh_shape), device_kind=jax.devices()[0].device_kind,
                   fit={"target": target_fit, "draft": draft_fit})


def fit_linear(x: np.ndarray, y: np.ndarray, holdout_every: int = 4) -> tuple[np.ndarray, dict]:
    """Non-negative least squares of y on the columns of x, with a held-out check.

    Every `holdout_every`-th point is held out of a first fit to measure the worst relative error
    of predictions on shapes the fit has not seen; the returned coefficients then use all points.
    Coefficients are clipped at zero (a negative cost is noise) and the rest refitted.
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    held = np.zeros(len(y), bool)
    if len(y) >= 2 * x.shape[1] and holdout_every > 1:
        held[holdout_every - 1::holdout_every] = True
    coef_train = _nonnegative_lstsq(x[~held], y[~held])
    worst = float(np.max(np.abs(x[held] @ coef_train - y[held]) / y[held])) if held.any() else None
    coef = _nonnegative_lstsq(x, y)
    residual = y - x @ coef
    r2 = 1.0 - float(residual @ residual) / float(((y - y.mean()) ** 2).sum()) if len(y) > 1 and y.std() > 0 else 1.0
    return coef, {"r2": r2, "worst_heldout_rel_error": worst, "points": int(len(y)), "heldout": int(held.sum())}


def _nonnegative_lstsq(x, y):
    active = np.ones(x.shape[1], bool)
    coef = np.zeros(x.shape[1])
    while active.any():
        solution = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if (solution >= 0).all():
            coef[active] = solution
            return coef
        # Drop the most negative coefficient and refit without it.
        idx = np.flatnonzero(active)[np.argmin(solution)]
        active[idx] = False
    return coef


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(3,))
def _forward_loop(graphdef, params, tokens_bt, cache, iterations: int):
    """`iterations` forwards in one program, as the decode loop runs them: the cache is a loop
    carry (written in place) rolled back after each pass so every pass sees the same context, and
    each pass's tokens come from the previous logits so the compiler cannot hoist the work."""
    from jaxspec.models.model import forward

    lengths = cache.lengths

    def body(_, carry):
        tokens, cache = carry
        logits, cache = forward(graphdef, params, tokens, cache)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache.commit(lengths)

    return jax.lax.fori_loop(0, iterations, body, (tokens_bt, cache))


def _time_forward(model, batch: int, tokens: int, cache_len: int, repeats: int, iterations: int = 8) -> float:
    """Median seconds of one forward of `tokens` new tokens per row over a cache of `cache_len`
    slots, half of them filled."""
    def run():
        cache = model.init_cache(batch, cache_len + tokens)
        cache = cache.commit(jnp.full((batch,), cache_len // 2, jnp.int32))
        tokens_bt = jnp.zeros((batch, tokens), jnp.int32)
        jax.block_until_ready((cache, tokens_bt))
        start = time.perf_counter()
        jax.block_until_ready(_forward_loop(model.graphdef, model.params, tokens_bt, cache, iterations))
        return (time.perf_counter() - start) / iterations

    run()
    return statistics.median(run() for _ in range(repeats))
