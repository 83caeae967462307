"""Latency cost models: how long a draft step and a target verification take, fitted from timings.

The goodput policy divides expected tokens by predicted step time, so it needs step times for
shapes it has not run yet. Both models are linear in the work that scales:

    draft step (one position)  = draft_fixed + draft_per_token * batch
    target verification        = target_fixed + target_per_token * batched_tokens
                                 + target_per_context_token * context_tokens
                                 + target_per_attention * attention_pairs
    speculation (any k >= 1)   = speculation_fixed + speculation_per_row * batch

with batched_tokens the tokens the target runs (N * (k + 1) padded, N + C packed), context_tokens
the key/value slots attention reads (rows * cache length: the compiled attention reads every slot
of the static cache, masked), and attention_pairs the query x key products it computes (rows *
window * cache length: attention runs in the padded per-row layout even when the token-wise work
is packed). The first three terms are the contract's; the last is what makes a window of k + 1
tokens dearer than k + 1 separate decode steps at long contexts. The speculation terms are what a
step that drafts at all pays on top (the drafter's catch-up on the last emitted tokens, the draft
sampling, acceptance and bookkeeping over a window): measured steps jump from k = 0 to k = 1 by
much more than from k = 1 to k = 2, and a model linear in k alone put plain decoding at 1.75x its
real cost at batch 1, which is exactly the comparison the policy must get right. Seconds
throughout.

`CostModel.profile` times the real decode step (draft k positions, verify, accept, commit) over a
grid of batch sizes, draft lengths and cache sizes, inside one compiled loop as the decode loop runs
it (no per-call dispatch, caches updated in place), after warm-up, with `block_until_ready`,
medians over passes over the grid in shuffled orders (`time_points`), and fits all coefficients at
once by non-negative least squares on relative errors (step times span two orders of magnitude
over the grid, and the policy compares ratios: an absolute fit lets the large-batch points decide
and leaves small batches 50-80% off), reporting
R^2 and the worst relative error on held-out points. (Timing the draft and target forwards one jit
call at a time, as a first version did, measured host dispatch and a copy of the whole cache that
the loop never pays, and missed the step's sampling and bookkeeping: predictions were off by up to
50% and the policy drafted where plain decoding was faster.) A cost model is only valid where it
was measured: the JSON records model names, dtype, mesh shape and device kind, and loading one
measured elsewhere warns.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import scipy.optimize

REQUIRED = ("draft_fixed", "draft_per_token", "target_fixed", "target_per_token", "target_per_context_token")
COEFFICIENTS = REQUIRED + ("target_per_attention", "speculation_fixed", "speculation_per_row")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Fitted latency coefficients (seconds) and where they were measured.

    Attributes:
      draft_fixed, draft_per_token: one draft position = fixed + per_token * batch.
      target_fixed, target_per_token, target_per_context_token, target_per_attention: one
        verification = fixed + per_token * batched tokens + per_context_token * key/value slots
        read + per_attention * query x key products.
      speculation_fixed, speculation_per_row: added to a step that drafts (k >= 1): fixed +
        per_row * batch.
      target_name, draft_name, dtype, mesh_shape, device_kind: provenance (checked on load).
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
    fit: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")

    @classmethod
    def from_coefficients(cls, *, draft_fixed: float, draft_per_token: float, target_fixed: float,
                          target_per_token: float, target_per_context_token: float = 0.0,
                          target_per_attention: float = 0.0, speculation_fixed: float = 0.0,
                          speculation_per_row: float = 0.0, **provenance) -> CostModel:
        """A cost model from known coefficients (tests, what-if studies)."""
        return cls(draft_fixed=float(draft_fixed), draft_per_token=float(draft_per_token),
                   target_fixed=float(target_fixed), target_per_token=float(target_per_token),
                   target_per_context_token=float(target_per_context_token),
                   target_per_attention=float(target_per_attention), speculation_fixed=float(speculation_fixed),
                   speculation_per_row=float(speculation_per_row), **provenance)

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
        speculation = self.speculation_fixed + self.speculation_per_row * batch if k > 0 else 0.0
        return (self.draft_seconds(batch, k) + speculation
                + self.verify_seconds(tokens, batch * cache_len, batch * window * cache_len))

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
    def profile(cls, target, draft=None, *, batches=(1, 2, 4, 8, 16), ks=(0, 1, 2, 4), cache_lens=(128, 512),
                repeats: int = 1, passes: int = 3, seed: int = 0, mesh_shape: tuple = ()) -> CostModel:
        """Times speculative steps on this device and fits the model to them.

        Each point is the real decode step (draft k positions, verify, accept, commit) at a
        (batch, k, cache size), timed inside a compiled loop (`engine.time_steps`), so the fit sees
        what the policy's choices cost, bookkeeping and sampling included. One least-squares fit
        over all points separates the parts: draft = k * (draft_fixed + draft_per_token * batch),
        the rest is the verification's terms with batch * (k + 1) tokens.

        Args:
          target: the target jaxspec.Model.
          draft: the draft jaxspec.Model, or None: drafts then come from n-gram lookup (its cost,
            small but not zero, is what the draft terms measure).
          batches, ks, cache_lens: the grid of shapes timed (ks must include 0 and a k > 0).
          repeats, passes, seed: every shape is timed `repeats` times in each of `passes` passes
            over the grid, each pass in its own shuffled order (`seed`); a shape's time is the
            median over its passes (`time_points`).
        """
        from jaxspec.drafters import ModelDrafter, NgramDrafter
        from jaxspec.models.model import Model

        if not isinstance(target, Model):
            raise ValueError(f"target must be a jaxspec.Model, got {type(target).__name__}")
        if draft is not None and not isinstance(draft, Model):
            raise ValueError(f"draft must be a jaxspec.Model or None, got {type(draft).__name__}")
        if 0 not in ks or len({k for k in ks if k >= 1}) < 2:
            raise ValueError(f"ks must include 0 and at least two values >= 1 to separate drafting, speculation "
                             f"and verification costs, got {ks}")
        drafter = (ModelDrafter(draft) if draft is not None
                   else NgramDrafter().bind_vocab(target.config.vocab_size))
        points = time_points(target, drafter, [(b, k, s) for b in batches for k in ks for s in cache_lens],
                             repeats=repeats, passes=passes, seed=seed)
        cost = cls.fit_points(points, target_name=target.config.name,
                              draft_name=draft.config.name if draft is not None else "ngram", dtype=str(target.dtype),
                              mesh_shape=tuple(mesh_shape), device_kind=jax.devices()[0].device_kind)
        cost.fit["step"].update(passes=passes, repeats=repeats)
        return cost

    @classmethod
    def fit_points(cls, points, **provenance) -> CostModel:
        """Fits every coefficient to measured steps `(batch, k, cache_len, seconds)` (a profile's
        `fit["step"]["points_seconds"]` can be refitted this way)."""
        points = [tuple(p) for p in points]
        # Step = k * draft(b) + [k > 0] * speculation(b) + verify(b * (k + 1) tokens, b * s slots,
        # b * (k + 1) * s pairs), with s the compiled cache size the step ran at; columns in the
        # order of COEFFICIENTS.
        x = np.array([[k, k * b, 1.0, b * (k + 1), b * s, b * (k + 1) * s, float(k > 0), float(k > 0) * b]
                      for b, k, s, _ in points], np.float64)
        y = np.array([sec for *_, sec in points], np.float64)
        coef, fit = fit_linear(x, y)
        fit["points_seconds"] = [[int(b), int(k), int(s), float(sec)] for b, k, s, sec in points]
        return cls(**{name: float(c) for name, c in zip(COEFFICIENTS, coef, strict=True)}, **provenance,
                   fit={"step": fit})


def time_points(target, drafter, shapes, *, repeats: int = 1, passes: int = 3, seed: int = 0) -> list[tuple]:
    """Times the decode step at each `(batch, k, cache_len)` shape (`engine.time_steps`, after its
    warm-up) in `passes` passes over all the shapes, each pass in a fresh shuffled order, and
    returns `(batch, k, cache_len, seconds)` with the median over passes.

    A shared machine's speed drifts over minutes and now and then stalls the process for a few
    milliseconds. Timed one shape after another, a drift lands on whole stretches of the grid
    (on the tiny-8L pair, the two cache sizes of one batch and k came out 33% apart where they
    differ by 5%) and the fit bends to it. Shuffled passes spread it over the grid as noise, and
    the median drops a stalled pass. Two profiles of 30 shapes timed back to back disagreed by
    up to 24% on one shape in ten (3 repeats, one pass); with 3 passes of 1 repeat, 8%.
    """
    from jaxspec.engine.loop import side_by_side, time_steps, warm_steps

    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be an int >= 1, got {passes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    shapes = [tuple(int(v) for v in shape) for shape in shapes]
    # Every shape's programs are compiled (and run once) side by side first, one thread each up
    # to the host's cores: the default grid has 40 step programs and 20 prefills, each about 18 s
    # to compile at the qwen2.5 shapes on an H200's host, one after another.
    side_by_side([functools.partial(warm_steps, target, drafter, k, batch, cache_len)
                  for batch, k, cache_len in shapes])
    rng = np.random.default_rng(seed)
    seconds = [[] for _ in shapes]
    for _ in range(passes):
        for i in rng.permutation(len(shapes)):
            batch, k, cache_len = shapes[i]
            seconds[i].append(time_steps(target, drafter, k, batch, cache_len, repeats=repeats))
    return [(*shape, float(np.median(times))) for shape, times in zip(shapes, seconds, strict=True)]


OUTLIER_RATIO = 4.0   # a profile's timings that its absolute fit misses by more than this are noise


def fit_linear(x: np.ndarray, y: np.ndarray, holdout_every: int = 4, relative: bool = True) -> tuple[np.ndarray, dict]:
    """Non-negative least squares of y on the columns of x, with a held-out check.

    Every `holdout_every`-th point is held out of a first fit to measure the worst relative error
    of predictions on shapes the fit has not seen; the returned coefficients then use all points.
    Coefficients are constrained to be >= 0 (a negative cost is noise; `_nonnegative_lstsq`). `relative`:
    minimise squared relative errors (each point weighted by 1 / y), not absolute ones.

    A relative fit is at the mercy of a timing that noise made near zero: weighted 1 / y, that one
    point outweighs all others. (A profile on a loaded CI machine once had a plain step come out at
    the 1e-7 s floor; the fit set every verification coefficient to 0 and timed plain steps free.)
    So points that an absolute fit, which such a point cannot sway, predicts more than
    OUTLIER_RATIO times off are left out of a relative fit (`fit["outliers"]` counts them), unless
    that would leave fewer points than coefficients.
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    kept = np.ones(len(y), bool)
    if relative:
        ratio = (x @ _nonnegative_lstsq(x, y)) / np.maximum(np.abs(y), 1e-300)
        outlier = (ratio > OUTLIER_RATIO) | (ratio * OUTLIER_RATIO < 1)
        if (~outlier).sum() >= x.shape[1]:
            kept = ~outlier
    coef, fit = _fit_kept(x[kept], y[kept], holdout_every, relative)
    fit.update(points=int(len(y)), outliers=int((~kept).sum()))
    return coef, fit


def _fit_kept(x, y, holdout_every, relative):
    w = 1.0 / np.abs(y) if relative else np.ones_like(y)
    held = np.zeros(len(y), bool)
    if len(y) >= 2 * x.shape[1] and holdout_every > 1:
        held[holdout_every - 1::holdout_every] = True
    coef_train = _nonnegative_lstsq(x[~held] * w[~held, None], y[~held] * w[~held])
    worst = float(np.max(np.abs(x[held] @ coef_train - y[held]) / y[held])) if held.any() else None
    coef = _nonnegative_lstsq(x * w[:, None], y * w)
    residual = y - x @ coef
    r2 = 1.0 - float(residual @ residual) / float(((y - y.mean()) ** 2).sum()) if len(y) > 1 and y.std() > 0 else 1.0
    return coef, {"r2": r2, "worst_heldout_rel_error": worst, "points": int(len(y)), "heldout": int(held.sum())}


def _nonnegative_lstsq(x, y):
    """Least squares with every coefficient >= 0 (Lawson-Hanson's active set, scipy's `nnls`).
    Dropping the most negative coefficient and refitting (the rule before) could cascade on noisy
    sub-millisecond steps until only the draft's fixed cost was left: a fit that timed a plain
    decoding step at 0."""
    scale = np.maximum(np.linalg.norm(x, axis=0), 1e-300)   # columns span ten orders of magnitude
    coef, _ = scipy.optimize.nnls(x / scale, y)
    return coef / scale


def steps_seconds(seconds: float, round_trip: float) -> float:
    """The part of a timed segment's wall `seconds` spent in its steps: the round trip (the call
    and the fetch of its outputs) taken out. A segment faster than the round trip is timing noise
    (a busy machine); it keeps a tenth of its time, so no plan is ever timed free."""
    return max(seconds - round_trip, 0.1 * seconds)


class StepTimeTracker:
    """Corrects a cost model's step times during a run from the measured wall time of each segment.

    A profile is taken minutes or days before the run, on a machine whose speed drifts (shared
    hosts, thermal limits) and under a model that never fits every shape exactly. The decode loop
    runs one plan per segment and returns to the host between segments, so the host knows how many
    steps each plan ran and how long that took. For each plan j the tracker keeps decayed sums of
    measured seconds and of the model's predicted seconds for the same steps; the corrected time is
    prediction_j * ratio_j, where ratio_j shrinks the plan's own measured/predicted ratio toward the
    ratio of its kind's plans, and that toward the ratio over all plans (each by `prior_steps`
    steps' worth), so one noisy segment does not swing a plan or a kind (a kind may have one plan:
    plain decoding), and a plan not run yet still follows the machine's drift and its kind's error:
    a profile's errors are not uniform over plans, e.g. drafting steps mispredicted by 2x where
    plain steps were right.

    A decoder keeps its tracker across calls (`new_call`); each call halves what the calls before
    measured (`call_decay`), so a kind the policy has stopped running drifts back to the ratio over
    all plans within a few calls instead of keeping an old measurement for good. (A one-step
    segment at batch 1 once timed plain decoding 29% dear, which, kept, left a decoder drafting; a
    dear drafting segment, kept, left one decoding plainly.)

    It also proposes exploration: a plan the policy would not pick is run for a short segment
    when its predicted goodput is within `explore_margin` of the chosen plan's and its time is in
    doubt: nothing has been measured for it (the cost model may rank close plans wrongly), or it
    was measured before the run but its kind has not run since and the other kinds' error scales
    it, up or down, by more than the margin (a warm-up that timed the drafting plans far too cheap
    made every plan look that much dearer, plain decoding included, and kept the policy drafting;
    one that timed drafting dearer than plain decoding kept it decoding plainly), or its kind's
    last measurement is `retime_segments` segments old (a decoder keeps its tracker across calls,
    so the runner-up is re-timed now and then instead of being judged forever by a warm-up; plans
    of a kind share its correction, so a timing of one renews them all). A plan in
    the second or third case is judged by its own warm-up time (or the profile's) where that is
    the better one, not only as scaled by the others' error. Trials
    are held to `explore_budget` of the time observed so far, their own included, so a short run
    is not spent exploring a flat goodput curve.

    Wall-clock noise is one-sided and comes in lumps: on a loaded 2-core machine a segment of the
    tiny pair's 0.02 ms plain steps now and then took 6 ms more than its steps (the process
    descheduled). Folded in, one such segment judged plain decoding 15x dear for the rest of the
    call. So a segment more than `surprise` times slower per step than the plan was expected to
    take (its corrected time, or its own warm-up time where `explore` would judge it by that) is
    held back: the plan's next segment confirms it (both count) or, not surprising itself, drops
    it. A held-back plan is in doubt, so a trial that surprised is run again; a real change costs
    one segment's delay. What no segment of the same call confirmed counts at the next call.

    Args:
      predicted_j: the cost model's seconds per step of each plan, at the run's compiled shape.
      prior_steps: how many steps of the overall ratio a plan's own ratio is shrunk toward.
      decay: per-segment decay of the sums (older segments count less as the machine drifts).
      kinds: a label per plan (the engine: whether the plan drafts); default one kind for all.
      round_trip: seconds each segment spends besides its steps (the call and the fetch of its
        outputs). It is taken out of each measured segment before the per-step times are
        corrected, and added back in the segment predictions of `history`.
      measured: per plan, whether `predicted_j` was measured at the run's shape (the engine's
        warm-up) rather than taken from a profile: `explore` counts those as measured.
      retime_segments: segments after which a kind's last measurement is old enough to re-time
        its plans.
      call_decay: the factor `new_call` applies to the sums of the calls before.
      surprise: how many times its expected step time a segment must take to be held back until
        the plan's next segment confirms it.
    """

    def __init__(self, predicted_j, *, prior_steps: float = 4.0, decay: float = 0.9, explore_margin: float = 0.15,
                 explore_budget: float = 0.1, kinds=None, round_trip: float = 0.0,
                 measured=None, retime_segments: int = 16, call_decay: float = 0.5, surprise: float = 3.0):
        self.predicted_j = np.asarray(predicted_j, np.float64)
        if self.predicted_j.ndim != 1 or not np.all(self.predicted_j > 0):
            raise ValueError(f"predicted_j must be a 1-d array of positive seconds, got {predicted_j!r}")
        self.kind_j = np.zeros(self.predicted_j.shape, np.int64) if kinds is None else np.asarray(kinds)
        if self.kind_j.shape != self.predicted_j.shape:
            raise ValueError(f"kinds must give one label per plan ({self.predicted_j.size}), got {kinds!r}")
        # Per kind: its members, and the prior weight (steps' worth) its ratio is shrunk with.
        self._kinds = [(members, prior_steps * float(np.mean(self.predicted_j[members])))
                       for members in (self.kind_j == kind for kind in np.unique(self.kind_j))]
        # `_ratio` and `_doubts` until the sums change (each is read several times between segments).
        self._ratios = self._doubted = None
        if not np.isfinite(round_trip) or round_trip < 0:
            raise ValueError(f"round_trip must be seconds >= 0, got {round_trip!r}")
        self.prior_steps, self.decay, self.round_trip = prior_steps, decay, float(round_trip)
        self.explore_margin, self.explore_budget = explore_margin, explore_budget
        self.total_seconds = self.trial_seconds = 0.0
        self.measured_j = np.zeros_like(self.predicted_j)   # decayed measured seconds
        self.expected_j = np.zeros_like(self.predicted_j)   # decayed predicted seconds of the same steps
        self.tried_j = np.zeros(self.predicted_j.shape, bool) if measured is None else np.array(measured, bool)
        if self.tried_j.shape != self.predicted_j.shape:
            raise ValueError(f"measured must give one flag per plan ({self.predicted_j.size}), got {measured!r}")
        if retime_segments < 1:
            raise ValueError(f"retime_segments must be >= 1, got {retime_segments!r}")
        if not 0.0 < call_decay <= 1.0:
            raise ValueError(f"call_decay must be in (0, 1], got {call_decay!r}")
        if not surprise > 1.0:
            raise ValueError(f"surprise must be > 1, got {surprise!r}")
        self.retime_segments, self.call_decay, self.surprise = retime_segments, call_decay, surprise
        # A surprising segment held back per plan (`surprise`): its weighted measured and predicted seconds.
        self.held_j = np.zeros((self.predicted_j.size, 2))
        self.segments = 0
        self.last_j = np.zeros(self.predicted_j.shape, np.int64)   # the segment count at each plan's last measurement
        # (plan, steps, predicted and measured wall seconds per step, round trip included)
        self.history: list[tuple[int, int, float, float]] = []

    def repredict(self, predicted_j) -> None:
        """Replaces the step times the corrections multiply, where a model of them learns during
        the run (a pipelined lane step's overlap, `parallel.goodput.SliceTiming`); the segments
        folded in so far keep the times they were predicted at."""
        predicted_j = np.asarray(predicted_j, np.float64)
        if predicted_j.shape != self.predicted_j.shape or not np.all(predicted_j > 0):
            raise ValueError(f"predicted_j must be {self.predicted_j.size} positive seconds, got {predicted_j!r}")
        self.predicted_j = predicted_j
        self._ratios = self._doubted = None

    def observe(self, plan: int, steps: int, seconds: float, trial: bool = False) -> None:
        """Folds in one segment: `steps` steps of `plan` took `seconds` of wall time (`trial`: it
        was run because `explore` proposed it).

        A segment timed at no time at all (a run's opening segment, whose time is what the call
        took less the opening's estimated cost, when that estimate exceeded the call: 4000 rows of
        3 tokens) is logged but not folded in: folded in, it timed its plan free (a corrected time
        of zero, and a division by it when plans were next judged)."""
        if steps <= 0:
            return
        self.history.append((plan, steps, float(self.corrected()[plan]) + self.round_trip / steps, seconds / steps))
        if seconds <= 0:
            return
        self.total_seconds += seconds
        self.trial_seconds += seconds if trial else 0.0
        surprising = steps_seconds(seconds, self.round_trip) > self.surprise * steps * self._basis()[plan]
        self.measured_j *= self.decay
        self.expected_j *= self.decay
        self.held_j *= self.decay
        self._ratios = self._doubted = None
        self.segments += 1
        expected = steps * self.predicted_j[plan]
        weight = self.evidence(expected)
        sample = weight * np.array([steps_seconds(seconds, self.round_trip), expected])
        held = self.held_j[plan].copy()
        self.held_j[plan] = 0.0
        if surprising and not held.any():
            self.held_j[plan] = sample          # wait for the plan's next segment to confirm it
            return
        self._fold(plan, sample + (held if surprising else 0.0), timed=weight >= 0.5)

    def _fold(self, plan: int, sample, timed: bool) -> None:
        """Adds weighted (measured, predicted) seconds to a plan's sums; `timed`: they time the plan
        and renew its measurement (a glimpse, steps shorter than the round trip, does neither)."""
        self.measured_j[plan] += sample[0]
        self.expected_j[plan] += sample[1]
        self._ratios = self._doubted = None
        if timed:
            self.tried_j[plan] = True
            self.last_j[plan] = self.segments

    def evidence(self, expected_seconds: float) -> float:
        """How much a segment whose steps are expected to take `expected_seconds` counts, from 0
        to 1: expected / (expected + round trip). A segment's wall time is its steps plus a round
        trip that jitters by a sizeable part of itself (1-step plain segments at batch 1 on the
        tiny-8L pair: 1.5-2.1 ms, a 0.9 ms round trip and a 0.6 ms step), so a segment shorter than
        its round trip says little about its steps. Each call's last token, decoded plainly after a
        drain's switch, had moved plain decoding's time from its warm-up's 0.76 ms to 0.95-1.07 ms
        over ten calls (its long segments in another decoder of the same process: 0.61-0.66 ms a
        step), and had renewed its measurement's age each call, so it was never re-timed
        (`explore`): in one process the decoder drafted on where plain decoding was 9% faster. Long
        segments count fully; one weighed under 1/2 (a glimpse) does not count as timing its plan."""
        return expected_seconds / (expected_seconds + self.round_trip) if self.round_trip > 0 else 1.0

    def new_call(self) -> None:
        """Starts a call's segment log (`history`); what the calls before measured counts
        `call_decay` as much."""
        self.history = []
        for plan in np.flatnonzero(self.held_j[:, 1] > 0):   # unconfirmed, but not lost
            self._fold(plan, self.held_j[plan], timed=False)
        self.held_j[:] = 0.0
        self.measured_j *= self.call_decay
        self.expected_j *= self.call_decay
        self._ratios = self._doubted = None

    def overall_ratio(self) -> float:
        total = self.expected_j.sum()
        return float(self.measured_j.sum() / total) if total > 0 else 1.0

    def ratio(self) -> np.ndarray:
        """Measured over predicted time per plan, shrunk toward its kind's ratio (and that
        toward the ratio over all plans)."""
        return self._ratio()[0]

    def _ratio(self) -> tuple[np.ndarray, np.ndarray]:
        """`ratio`, and per plan whether its kind has run: whether the kind's own segments carry at
        least half the weight of its prior (else its ratio is mostly the other kinds'). A few short
        segments do not count as a run: a drain's 1-step plain segments, weighed lightly
        (`evidence`), would otherwise have spared a plain plan scaled up by the drafting plans'
        error from its trial (`_doubts`)."""
        if self._ratios is not None:
            return self._ratios
        overall = self.overall_ratio()
        prior_j = np.full(self.predicted_j.shape, overall)
        ran_j = np.zeros(self.predicted_j.shape, bool)
        for members, weight in self._kinds:
            expected = self.expected_j[members].sum()
            if expected > 0:
                measured = self.measured_j[members].sum()
                ran = expected >= 0.5 * weight
                ran_j[members] = ran
                # A kind that has run is pulled toward the overall ratio by at most the margin: the
                # overall ratio is mostly the other kind's where the two disagree by far (drafting
                # measured 20x its warm-up made a 7-step plain trial that ran as its warm-up said
                # 2.7x dear, and plain decoding was not trialled again).
                own = measured / expected
                pull = np.clip(overall, own / (1.0 + self.explore_margin), own * (1.0 + self.explore_margin))
                prior_j[members] = (measured + (pull if ran else overall) * weight) / (expected + weight)
        weight_j = self.prior_steps * self.predicted_j
        self._ratios = ((self.measured_j + prior_j * weight_j) / (self.expected_j + weight_j), ran_j)
        return self._ratios

    def corrected(self) -> np.ndarray:
        """Seconds per step of each plan: the prediction times its ratio."""
        return self.predicted_j * self.ratio()

    def _doubts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per plan: contradicted (measured before the run, but scaled by the error of kinds that
        did run, up or down, by more than the margin, and no plan of its kind timed in the last
        `retime_segments` segments), doubtful (untried or contradicted) and stale
        (its kind's last measurement `retime_segments` segments old: `_kind_last`): what makes a
        plan a candidate for a
        trial.

        Scaled down counts too: the kinds' warm-up times were then off by different amounts, and
        which is right is unknown. At batch 1 of the tiny-8L pair one benchmark's warm-up timed
        plain decoding 26% dear and drafting 45% dear; plain ran at 0.79 of its warm-up time, the
        drafting plans took that ratio and still looked 1% behind it, and, not in doubt, were
        re-timed only when stale, 16 calls later: those calls decoded plainly at 0.82 of fixed
        k = 6. (A plan scaled down and still not within the margin is not trialled: `explore`
        judges it by the lesser of its two times.)"""
        if self._doubted is not None:
            return self._doubted
        ratio_j, kind_ran_j = self._ratio()
        off_j = (ratio_j > 1.0 + self.explore_margin) | (ratio_j * (1.0 + self.explore_margin) < 1.0)
        # A kind timed during the run within `retime_segments` segments has answered the doubt: as
        # its own segments fade (`call_decay`) its ratio drifts toward the others' again, but
        # that is no news until its timing is as old as a re-timing would be. Contradicted anew
        # every few calls, plain decoding was trialled every 3-4 calls at batch 1 of the tiny-8L
        # pair (16 plain steps where k = 5 ran 1.48x as fast, about 5% of those calls), each
        # time on a machine running at half its warm-up's speed, each time measured as slow.
        timed_j = (self.last_j > 0) & (self.segments - self.last_j < self.retime_segments)
        answered_j = np.zeros_like(timed_j)
        for members, _ in self._kinds:
            answered_j[members] = timed_j[members].any()
        contradicted_j = self.tried_j & ~kind_ran_j & off_j & ~answered_j
        doubtful_j = ~self.tried_j | contradicted_j | (self.held_j[:, 1] > 0)
        self._doubted = (contradicted_j, doubtful_j, self.segments - self._kind_last() >= self.retime_segments)
        return self._doubted

    def _kind_last(self) -> np.ndarray:
        """Per plan, the segment count at the last measurement of any plan of its kind.

        Plans of a kind share its correction (`_ratio`), so a segment of one renews the others'
        times, and a plan is due for re-timing only when its whole kind is. Aged one by one, each
        of six drafting plans came due in turn: at batch 64 of the tiny-8L pair, where plain
        decoding is best, a decoder trialled a drafting plan in 8 of 30 calls, each 4 drafting
        steps at 1.9-4x a plain step's cost, judged by warm-up times that its kind's recent
        segments had already corrected upward by about a third (2 in 30 aged as a kind)."""
        last_j = self.last_j.copy()
        for members, _ in self._kinds:
            last_j[members] = self.last_j[members].max()
        return last_j

    def _basis(self) -> np.ndarray:
        """Seconds per step each plan may be expected to take: its corrected time, or its own
        warm-up (or profile) time where that is less and the plan is contradicted or due for
        re-timing (`explore`)."""
        contradicted_j, _, stale_j = self._doubts()
        corrected_j = self.corrected()
        return np.where(contradicted_j | stale_j, np.minimum(self.predicted_j, corrected_j), corrected_j)

    def in_doubt(self, chosen: int) -> bool:
        """Whether any plan besides `chosen` could be proposed for a trial (`explore`) on its
        doubt or age alone, before its goodput is weighed: the host skips predicting every plan's
        tokens (a drain count on the host, up to 0.6 ms at batch 1) when none could."""
        _, doubtful_j, stale_j = self._doubts()
        return bool(np.any(np.delete(doubtful_j | stale_j, chosen)))

    def retime_tie(self, chosen: int, tokens_j, margin: float, segments: int) -> int | None:
        """A plan to run for a whole segment instead of `chosen` because the two are tied, or None:
        the best plan of another kind (`kinds`: drafting or not) whose predicted goodput (by the
        times `explore` judges it by) is within `margin` of `chosen`'s and whose kind's last
        measurement is at least `segments` segments old.

        Plans within the policy's switch margin are ones the policy cannot tell apart, and a run
        that rests on one timing of each keeps whichever that timing favoured. Where a call is one
        segment (batch 1 of the tiny-8L pair) `retime_segments` is that many calls: one warm-up
        that timed drafting a few percent behind plain decoding kept a run decoding plainly for 15
        of 16 calls, at 0.78 of fixed k = 5. Running the tie for a whole segment adds no round
        trip, and costs at most the margin over that segment; it is not charged to the trial
        budget. Plans of one kind share their kind's correction (a segment of one corrects the
        others), so a tie within a kind is not offered (the device chooses among draft lengths
        every few steps on acceptance): offered across draft lengths at batch 4, ties that the
        device then left after 4 steps cost a round trip in most calls."""
        tokens_j = np.asarray(tokens_j, np.float64)
        hopeful_j = tokens_j / self._basis()
        tie_j = hopeful_j >= (1.0 - margin) * tokens_j[chosen] / self.corrected()[chosen]
        offered_j = tie_j & self._due_across(chosen, segments)
        return int(np.argmax(np.where(offered_j, hopeful_j, -np.inf))) if offered_j.any() else None

    def tie_due(self, chosen: int, segments: int) -> bool:
        """Whether a plan of the other kind than `chosen` has a timing `segments` old: the only
        plans `retime_tie` can offer (a cheap check before the tokens it needs are counted)."""
        return bool(self._due_across(chosen, segments).any())

    def _due_across(self, chosen: int, segments: int) -> np.ndarray:
        """Per plan: of another kind than `chosen`, and its kind last timed at least `segments` segments ago."""
        return (self.kind_j != self.kind_j[chosen]) & (self.segments - self._kind_last() >= segments)

    def explore(self, chosen: int, tokens_j, baseline: int | None = None, steps: int = 4) -> int | None:
        """A plan worth one short trial instead of `chosen`, or None.

        Args:
          chosen: the plan the policy picked.
          tokens_j: expected tokens per step of each plan under current acceptance estimates.
          baseline: plain decoding's plan. It is trialled first and outside the budget while its
            time is in doubt (not for its age alone) and it is within the margin: at the batch
            sizes where speculation stops paying the two are within a few percent, closer than any
            profile ranks them, and a trial of the baseline can cost no more than the speculation
            it forgoes.
          steps: the length of a trial segment; a trial is proposed only if its predicted time
            keeps all trials within `explore_budget` of the run's time (a drafting trial at
            batch 64 costs 2.5 plain steps per step, too dear early in a short run).
        """
        corrected_j = self.corrected()
        _, doubtful_j, stale_j = self._doubts()
        tokens_j = np.asarray(tokens_j, np.float64)
        # A plan in doubt or due for re-timing may be as fast as its warm-up (or profile) said: its
        # corrected time scales it by the other plans' error, which is the machine's drift only if
        # the error is not theirs alone (at batch 1 a decoder's drafting ran 15% behind its
        # warm-up, where plain decoding, by the autoregressive loop beside it, ran 15% ahead of its
        # own; plain, scaled up by drafting's error, never came within the margin again, and the
        # decoder drafted on, 9% behind the autoregressive loop).
        hopeful_j = tokens_j / self._basis()
        close_j = hopeful_j >= (1.0 - self.explore_margin) * tokens_j[chosen] / corrected_j[chosen]
        if baseline is not None and baseline != chosen and doubtful_j[baseline] and close_j[baseline]:
            return int(baseline)
        for j in np.argsort(-hopeful_j):
            if j != chosen and (doubtful_j[j] or stale_j[j]) and close_j[j]:
                cost = steps * corrected_j[j] + self.round_trip
                affordable = self.trial_seconds + cost <= self.explore_budget * (self.total_seconds + cost)
                return int(j) if affordable else None
        return None
