"""Goodput control: track acceptance on device and pick how much to speculate each step.

Shape key: b rows, k draft slots, c calibration bins, j candidates.

TurboSpec / SmartSpec's rule: for each candidate (a draft length k, or a TETRIS budget C), predict
goodput = expected tokens kept / predicted step time, and take the best, k = 0 (plain decoding)
included. Expected tokens come from acceptance observed so far; step times from a `CostModel`.

Everything here is a pure function over a small `PolicyState` carried in the decode loop, so the
choice for step s + 1 is made on device at the end of step s from statistics that include step s:
no host round trip, and the next step's shapes come from a few precompiled branches.

Acceptance is tracked two ways:
- per row, decayed counts of accepted drafts and of trials (accepts plus the first rejection),
  giving a per-token acceptance rate alpha for the geometric model of `expected_tokens_per_step`;
- per draft position, pooled over rows: how often the j-th draft was accepted when it was tried.
  Acceptance is rarely flat along a window (a draft that got this far is usually on easy text: on
  the tiny-8L pair 0.85 at the first position, 0.91 at the eighth), so the policy scales each
  row's alpha by the position's rate over the pooled rate (`PolicyState.profile_p`);
- a calibration of draft confidence to acceptance: confidences (the drafter's per-token estimate,
  `Proposal.logprob_bk`) are binned, and each bin counts how often a verified slot in it was
  accepted. `calibrated_logprobs` maps confidences through it, so TETRIS and the capacity search
  rank slots by observed acceptance rather than by raw draft probabilities.

A run's rows start from the acceptance measured before it (`AcceptanceMemory`, `seed_acceptance`)
rather than from a bare prior. While no request waits for a slot, the batch ends with its slowest
row, and plans are judged by that row's expected steps (`drain_tokens_per_step`) rather than by
one step's expected tokens summed over rows.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.special
import numpy as np
import scipy.special
from flax import struct

CALIBRATION_BINS = 16
PRIOR_ALPHA = 0.6      # acceptance assumed before anything is observed
PRIOR_WEIGHT = 2.0     # how many observations the prior is worth
DECAY = 0.9            # per-step decay of the counts (a moving average over ~10 steps)
OFF_DECAY = 0.97       # per-step decay while speculation is off (nothing observed; see `age`)
EXPLORE = 0.2          # optimism bonus while the batch has little recent evidence (see `planning_alpha_b`)
THIN_EVIDENCE = 0.3    # extra switch margin while the batch has little recent evidence (see `choose_k`)
SWITCH_MARGIN = 0.04   # predicted gain that makes the running plan switch (see `choose_k`)
SEED_WEIGHT = 1.0 / (1.0 - DECAY)   # most trials per row a seed is worth (see `seed_acceptance`)
PROBE_STEPS = 4        # steps a drafting plan runs before it may hand back (engine.MIN_SEGMENT; `probe_choice`)
DRAIN_GRID = 64        # points of the integral over steps in `drain_tokens_per_step`
DRAIN_EXACT = 16       # remaining tokens up to which `drain_tokens_per_step` counts steps exactly
FORECAST_TOKENS = 16.0  # how far ahead a row's recent acceptance departs from its seed (see `forecast_alpha_b`)
MEMORY_EVIDENCE = 100.0  # most trials the decoder's memory counts as evidence for the bonus (see `planning_alpha_b`)
SPREAD_MIN_TRIALS = 16  # trials a finished request needs to count toward the rows' spread (`AcceptanceMemory.spread`)
SPREAD_REQUESTS = 256   # the most recent finished requests the spread is measured over
SPREAD_PRIOR_REQUESTS = 8  # requests' worth of "no spread" the measured spread is shrunk toward
POSITION_DECAY = 0.99   # per-step decay of the per-position counts (a moving average over ~100 steps)
POSITION_PRIOR = 32.0   # trials' worth of the remembered profile each position's rate is shrunk toward


def expected_tokens_per_step(alpha, k):
    """Tokens a row emits per verification with k drafts, each accepted with probability alpha:
    (1 - alpha^(k+1)) / (1 - alpha), the bonus/correction token included (k + 1 at alpha = 1)."""
    alpha = jnp.clip(jnp.asarray(alpha, jnp.float32), 0.0, 1.0)
    k = jnp.asarray(k, jnp.float32)
    safe = jnp.where(alpha < 1.0, alpha, 0.5)
    return jnp.where(alpha < 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe), k + 1.0)


def _row(field: str, row: int, doc: str) -> property:
    """A read-only view of row `row` of a packed `PolicyState` array."""
    return property(lambda state: getattr(state, field)[row], doc=doc)


@struct.dataclass
class PolicyState:
    # The counts a drafting step updates are packed, one array per shape (`accepted_b`, `trials_b`,
    # `total_*`, `pos_*` are views): on XLA:CPU each updated array was a kernel of its own in every
    # drafting step: 8 more than fixed k's 378 at batch 1, 3 once packed (scripts/step_kernels.py).
    counts_2b: jax.Array        # per row: decayed accepted drafts [0] and acceptance trials [1]
    seed_accepted_b: jax.Array  # the seed's accepted drafts per row (see `init`)
    seed_trials_b: jax.Array    # the seed's trials per row
    totals_2: jax.Array         # accepted drafts [0], trials [1]: the run's, every row, undecayed (`AcceptanceMemory`)
    calib_tried_c: jax.Array    # decayed verified slots per confidence bin
    calib_accepted_c: jax.Array  # decayed accepted slots per confidence bin
    choice: jax.Array           # candidate index for the next step
    hold: jax.Array             # when choice is plain decoding: its steps before a re-probe (see `plain_horizon`)
    memory_trials: jax.Array    # trials the decoder's memory rests on (`AcceptanceMemory`), aged with the counts
    spread: jax.Array           # how far rows' acceptance rates differ, a standard deviation (`drain_tokens_per_step`)
    # Per draft position p, pooled over rows (`observe`; none when the state has no positions):
    # decayed accepted drafts [0] and trials [1] (POSITION_DECAY), and the same undecayed over the
    # run [2], [3] (stats; `AcceptanceMemory.remember_positions`).
    pos_counts_4p: jax.Array
    profile_seed_p: jax.Array   # the remembered profile the counts are shrunk toward (`profile_p`)

    accepted_b = _row("counts_2b", 0, "decayed accepted drafts per row")
    trials_b = _row("counts_2b", 1, "decayed acceptance trials per row")
    total_accepted = _row("totals_2", 0, "accepted drafts over the run, every row, undecayed")
    total_trials = _row("totals_2", 1, "acceptance trials over the run, every row, undecayed")
    pos_accepted_p = _row("pos_counts_4p", 0, "decayed accepted drafts per draft position")
    pos_tried_p = _row("pos_counts_4p", 1, "decayed trials per draft position")
    pos_total_accepted_p = _row("pos_counts_4p", 2, "accepted drafts per draft position over the run")
    pos_total_tried_p = _row("pos_counts_4p", 3, "trials per draft position over the run")

    def with_row_counts(self, accepted_b, trials_b) -> PolicyState:
        """This state with the rows' decayed counts replaced."""
        return self.replace(counts_2b=jnp.stack([jnp.asarray(accepted_b, jnp.float32),
                                                 jnp.asarray(trials_b, jnp.float32)]))

    @classmethod
    def init(cls, b: int, first_choice: int, bins: int = CALIBRATION_BINS, seed=None, live_b=None,
             positions: int = 0) -> PolicyState:
        """Counts before the first step: none, or with `seed` = (alpha, weight) (from
        `seed_acceptance`; traced) every row (every `live_b` row, if given) starts as if it had
        seen `weight` trials at acceptance alpha. A third entry (`AcceptanceMemory.seed`) is the
        trials the memory pooled, `memory_trials` (see `planning_alpha_b`); a fourth, the spread of
        acceptance between requests (`spread`, for the drain rule: `drain_tokens_per_step`); the
        next `positions` entries, if given, the remembered per-position profile (`profile_p`).
        `positions` (static): how many draft positions are tracked (the longest draft of any
        plan); with none, every prediction is the plain geometric model's.

        The seed is kept apart from the row's own counts: what a drafter usually achieves, the
        level a row's acceptance comes back to after a hard stretch of text. It does not decay
        while the row drafts (`observe`), so a dip weighs against it rather than alone: decaying
        with the row's counts, the seed had mostly gone after a row's first few steps, and a dip
        there (at batch 1 of the tiny-8L pair, 4 of a prompt's first 12 tokens rejected, then 85%
        accepted) turned speculation off for the rest of the call, 1-2 calls in 4. While
        speculation is off the seed ages with everything else (`age`), so the optimism that
        re-probes speculation grows back as before, whatever the seed said.
        """
        zeros_b = jnp.zeros((b,), jnp.float32)
        seed_accepted_b, seed_trials_b, memory, spread = zeros_b, zeros_b, jnp.float32(0.0), jnp.float32(0.0)
        profile_p = jnp.ones((positions,), jnp.float32)
        if seed is not None:
            seed = jnp.asarray(seed, jnp.float32)
            alpha, weight = seed[0], seed[1]
            memory = seed[2] if seed.shape[0] > 2 else memory
            spread = seed[3] if seed.shape[0] > 3 else spread
            if positions and seed.shape[0] >= 4 + positions:
                profile_p = seed[4:4 + positions]
            weight_b = zeros_b + weight if live_b is None else jnp.where(live_b, weight, 0.0)
            seed_accepted_b, seed_trials_b = alpha * weight_b, weight_b
        return cls(counts_2b=jnp.zeros((2, b), jnp.float32), seed_accepted_b=seed_accepted_b,
                   seed_trials_b=seed_trials_b, totals_2=jnp.zeros((2,), jnp.float32),
                   calib_tried_c=jnp.zeros((bins,), jnp.float32), calib_accepted_c=jnp.zeros((bins,), jnp.float32),
                   choice=jnp.int32(first_choice), hold=jnp.int32(0), memory_trials=memory, spread=spread,
                   pos_counts_4p=jnp.zeros((4, positions), jnp.float32), profile_seed_p=profile_p)

    def profile_p(self, xp=jnp):
        """Per draft position p, its acceptance rate over the pooled rate (None when no position is
        tracked): a row's p-th draft is accepted, given the ones before it were, with probability
        alpha_b * profile_p[p] (at most 1; `expected_tokens`). Each position's rate is shrunk
        toward the remembered profile by POSITION_PRIOR trials, so a position seldom reached
        (the sixth draft at a low acceptance) keeps what earlier calls measured there.

        The pooled rate is trial-weighted like a row's alpha (most trials are at the first
        positions), so the profile averages 1 over the trials: a row's alpha still measures its
        acceptance, and the profile only says how it is spread along the window. `xp`: numpy for
        a state read to the host."""
        if self.pos_tried_p.shape[0] == 0:
            return None
        accepted_p, tried_p = xp.asarray(self.pos_accepted_p), xp.asarray(self.pos_tried_p)
        pooled = xp.maximum(xp.sum(accepted_p), 1e-6) / xp.maximum(xp.sum(tried_p), 1e-6)
        rate_p = (accepted_p + POSITION_PRIOR * pooled * xp.asarray(self.profile_seed_p)) / (tried_p + POSITION_PRIOR)
        return rate_p / pooled

    def alpha_b(self) -> jax.Array:
        """Per-row acceptance estimate: the row's counts and its seed, shrunk toward the prior
        when little has been seen."""
        return ((self.accepted_b + self.seed_accepted_b + PRIOR_ALPHA * PRIOR_WEIGHT)
                / (self.evidence_b() + PRIOR_WEIGHT))

    def evidence_b(self) -> jax.Array:
        """Trials per row the estimate rests on: the row's own and its seed's."""
        return self.trials_b + self.seed_trials_b

    def forecast_alpha_b(self, remaining_b, xp=jnp) -> jax.Array:
        """Per-row acceptance expected over the row's `remaining_b` tokens: the recent estimate
        `alpha_b` for the next few tokens, the seed's rate (what the drafter achieves over whole
        calls, `AcceptanceMemory`) beyond them.

        `alpha_b` is a moving average over the row's last ~10 trials, the right estimate for the
        next step, but a plan chosen now mostly runs on (a switch costs a round trip, and plain
        decoding observes nothing, so a switch to it stands until a re-probe pays for the
        drafter's catch-up). A row's departure from its usual rate is taken to fade over
        FORECAST_TOKENS tokens, so its weight over r remaining tokens is the mean of exp(-t / L)
        over them: (L / r)(1 - exp(-r / L)). Near a row's end the recent estimate decides; at its
        start the seed does. Before this, a hard start (on the tiny-8L pair at batch 1, one
        benchmark prompt rejects 4 of its first 12 drafts and accepts 85% after) turned
        speculation off for the rest of 3 calls in 15, each then 5-10% slower than drafting
        throughout. Rows without a seed keep `alpha_b`. `xp`: numpy for a state read to the host.
        """
        r_b = xp.maximum(xp.asarray(remaining_b, xp.float32), 1.0)
        recent_b = xp.where(self.seed_trials_b > 0,
                            FORECAST_TOKENS / r_b * (1.0 - xp.exp(-r_b / FORECAST_TOKENS)), 1.0)
        seed_b = self.seed_accepted_b / xp.maximum(self.seed_trials_b, 1e-6)
        return recent_b * self.alpha_b() + (1.0 - recent_b) * seed_b

    def planning_alpha_b(self) -> jax.Array:
        """The estimate used to decide whether to (re)start speculating: optimistic in proportion
        to how little was seen lately.

        The bonus shrinks with the trials of the whole batch, not of each row: the decision is
        one draft length for every row, so what matters is how well the batch's acceptance is
        known (a per-row bonus summed over 64 rows kept re-probing speculation that had just been
        measured not to pay). While speculation is off nothing is observed and the counts decay,
        so the bonus grows back and a batch whose acceptance might now pay for drafting is probed
        again; a cost model under which even alpha = 1 does not pay keeps speculation off for good.

        The seed's evidence is what the decoder's memory pooled (`memory_trials`, at most
        MEMORY_EVIDENCE) where that exceeds the rows' seed weights (at most 10 trials a row): at
        batch 1 the seed alone left a bonus of 0.06, which had calls open on a probe of k = 1 where
        the remembered acceptance said plain decoding was best; the probe then ran into a hard start
        and each such call cost 4-6% more than plain decoding.
        """
        seen = jnp.sum(self.trials_b) + jnp.maximum(jnp.sum(self.seed_trials_b), self.memory_trials)
        return jnp.minimum(1.0, self.alpha_b() + EXPLORE / jnp.sqrt(1.0 + seen))

    def calibration_curve(self) -> jax.Array:
        """Observed acceptance per confidence bin (the bin centre where nothing was observed)."""
        bins = self.calib_tried_c.shape[0]
        centre_c = (jnp.arange(bins, dtype=jnp.float32) + 0.5) / bins
        return (self.calib_accepted_c + PRIOR_WEIGHT * centre_c) / (self.calib_tried_c + PRIOR_WEIGHT)


def seed_acceptance(accepted_b, trials_b, cap: float = SEED_WEIGHT, xp=jnp) -> jax.Array:
    """(alpha, weight): the acceptance pooled over rows that saw trials (accepted / trials, summed),
    and how much it is worth to a fresh row: their mean trials per row, at most `cap` (one
    moving-average window of `DECAY`). (PRIOR_ALPHA, 0) when no row saw a trial.

    Fresh rows start from it (`PolicyState.init`) instead of the bare prior: a run's first rows
    from the acceptance its decoder's warm-up and previous runs measured (`AcceptanceMemory`),
    a refilled row from the batch it joins. The opening choice is otherwise made on PRIOR_ALPHA
    alone, and where speculation gains a few percent (batch 1 of a pair whose k = 1 step costs
    1.75 plain steps) that guess decided whether the run drafted at all.
    `xp`: jax.numpy on device, numpy on the host.
    """
    accepted_b, trials_b = xp.asarray(accepted_b, xp.float32), xp.asarray(trials_b, xp.float32)
    total = xp.sum(trials_b)
    rows = xp.maximum(xp.sum(trials_b > 0), 1)
    seen = total > 0
    alpha = xp.where(seen, xp.sum(accepted_b) / xp.where(seen, total, 1.0), PRIOR_ALPHA)
    return xp.stack([alpha, xp.minimum(total / rows, cap)]).astype(xp.float32)


@dataclasses.dataclass
class AcceptanceMemory:
    """Acceptance measured over a decoder's calls (on the host), to seed each new run's rows.

    The rate is pooled over everything remembered: the warm-up's drafting plans, then every
    call's whole count (`PolicyState.total_accepted` / `total_trials`, undecayed). A call's end
    state holds only its last ~10 steps per row (the decay), a noisy and biased sample: at batch 1
    one call ended at 0.66 where the run's acceptance was 0.85, and seeding the next call with it
    alone turned speculation off; pooled over calls, end states said 0.86 where the calls accepted
    0.78 (text gets easier toward the end of these benchmark prompts), which favoured long drafts.
    The weight a fresh row starts with is the largest any measurement had (`seed_acceptance`):
    the pooled evidence only grows, and a call that ended on plain decoding ends with aged counts,
    which as the weight had every later call open on the bare prior (and at batch 1, where that
    prior's probe just fails, run plain decoding from then on).
    """
    accepted: float = 0.0
    trials: float = 0.0
    weight: float = 0.0
    requests: list = dataclasses.field(default_factory=list)   # (accepted, trials) of finished requests
    position_accepted: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))   # per draft position
    position_tried: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

    def remember(self, accepted_b, trials_b) -> None:
        accepted_b, trials_b = np.asarray(accepted_b, np.float64), np.asarray(trials_b, np.float64)
        if trials_b.sum() <= 0:
            return
        self.accepted += float(accepted_b.sum())
        self.trials += float(trials_b.sum())
        self.weight = max(self.weight, float(seed_acceptance(accepted_b, trials_b, xp=np)[1]))

    def remember_requests_of_call(self, accepted_r, tried_r) -> bool:
        """A call whose only counts are its requests' own (`Counters.accepted` / `Counters.tried`:
        a lean call, a two-slice call): their sum seeds the next calls' rows (`remember`) and each
        measures the spread (`remember_requests`). Returns whether any draft was tried."""
        accepted_r, tried_r = np.asarray(accepted_r), np.asarray(tried_r)
        if not np.sum(tried_r):
            return False
        self.remember(np.sum(accepted_r, keepdims=True), np.sum(tried_r, keepdims=True))
        self.remember_requests(accepted_r, tried_r)
        return True

    def remember_positions(self, accepted_p, tried_p) -> None:
        """A call's per-position counts (`PolicyState.pos_total_accepted_p` / `pos_total_tried_p`,
        undecayed), pooled over calls for the profile a run starts from (`seed`)."""
        accepted_p, tried_p = np.asarray(accepted_p, np.float64), np.asarray(tried_p, np.float64)
        n = max(accepted_p.shape[0], self.position_tried.shape[0])
        self.position_accepted = np.pad(self.position_accepted, (0, n - self.position_accepted.shape[0]))
        self.position_tried = np.pad(self.position_tried, (0, n - self.position_tried.shape[0]))
        self.position_accepted[:accepted_p.shape[0]] += accepted_p
        self.position_tried[:tried_p.shape[0]] += tried_p

    def profile(self, positions: int) -> np.ndarray:
        """The remembered acceptance profile along the draft window (`PolicyState.profile_p`) for
        `positions` positions: each position's rate over the pooled one. A position's rate is
        shrunk by POSITION_PRIOR trials toward the rate of the position before it (the first
        toward the pooled rate), so positions the runs seldom reached take the deepest measured
        level rather than the pooled one: where acceptance rises along the window, the pooled
        rate would price the drafts a decoder has not yet tried at its shorter drafts' rate, a
        bias against trying them. 1 everywhere before anything was remembered."""
        accepted_p = np.zeros(positions)
        tried_p = np.zeros(positions)
        n = min(positions, self.position_tried.shape[0])
        accepted_p[:n], tried_p[:n] = self.position_accepted[:n], self.position_tried[:n]
        if tried_p.sum() <= 0 or accepted_p.sum() <= 0:
            return np.ones(positions, np.float32)
        pooled = accepted_p.sum() / tried_p.sum()
        rate_p, before = np.zeros(positions), pooled
        for p in range(positions):
            rate_p[p] = before = (accepted_p[p] + POSITION_PRIOR * before) / (tried_p[p] + POSITION_PRIOR)
        return (rate_p / pooled).astype(np.float32)

    def remember_requests(self, accepted_r, trials_r) -> None:
        """Each finished request's own count, undecayed (`Counters.accepted` / `Counters.tried`),
        for `spread`; the most recent SPREAD_REQUESTS are kept."""
        for a, t in zip(np.asarray(accepted_r, np.float64), np.asarray(trials_r, np.float64)):
            if t >= SPREAD_MIN_TRIALS:
                self.requests.append((float(a), float(t)))
        del self.requests[:-SPREAD_REQUESTS]

    def spread(self) -> float:
        """How far requests' acceptance rates differ: the standard deviation of their measured
        rates less what counting alone explains (each rate is a / t over t trials; binomial
        variance a/t (1 - a/t) / t, averaged), 0 with fewer than two requests of
        SPREAD_MIN_TRIALS trials. Acceptance that comes in runs (hard and easy stretches of text)
        spreads the rates further than counting does; that is counted too, as it should be: it
        spreads the requests' step counts alike (`drain_tokens_per_step`). A variance from n
        requests is itself noisy (the tiny-8L pair's 16 batch-4 prompt sets, 4 requests each, gave
        0 to 0.10 where all 64 requests gave 0.05), so the excess is shrunk by n / (n + SPREAD_PRIOR_REQUESTS): a spread
        measured too high keeps a draining batch from drafting where it pays."""
        n = len(self.requests)
        if n < 2:
            return 0.0
        a_r, t_r = np.asarray(self.requests).T
        rate_r = a_r / t_r
        excess = np.var(rate_r, ddof=1) - np.mean(rate_r * (1.0 - rate_r) / t_r)
        return float(np.sqrt(max(excess, 0.0) * n / (n + SPREAD_PRIOR_REQUESTS)))

    def seed(self, positions: int = 0) -> np.ndarray:
        """(alpha, weight, evidence, spread, profile...) for `PolicyState.init`: the pooled rate, a
        fresh row's weight, the trials pooled (at most MEMORY_EVIDENCE; `PolicyState.memory_trials`),
        the spread between requests (`spread`) and, for `positions` > 0, the profile over that
        many draft positions (`profile`). The bare prior with no weight before anything."""
        if self.trials <= 0:
            head = [PRIOR_ALPHA, 0.0, 0.0, self.spread()]
        else:
            head = [self.accepted / self.trials, self.weight, min(self.trials, MEMORY_EVIDENCE), self.spread()]
        return np.concatenate([np.asarray(head, np.float32), self.profile(positions)]).astype(np.float32)


def _bin_of(logprob_bk, bins: int):
    conf = jnp.exp(jnp.minimum(logprob_bk, 0.0))
    return jnp.clip((conf * bins).astype(jnp.int32), 0, bins - 1)


def calibrated_logprobs(state: PolicyState, logprob_bk) -> jax.Array:
    """Per-token log acceptance estimates through the calibration curve (-inf stays -inf)."""
    curve_c = state.calibration_curve()
    calibrated = jnp.log(jnp.maximum(curve_c[_bin_of(logprob_bk, curve_c.shape[0])], 1e-6))
    return jnp.where(jnp.isneginf(logprob_bk), -jnp.inf, calibrated)


def observe(state: PolicyState, logprob_bk, verified_b, accepted_b, live_b, decay: float = DECAY,
            calibrate: bool = True) -> PolicyState:
    """Folds one verification's outcome into the counts.

    Slot j of a row was tried if it was verified and every earlier slot was accepted
    (j <= accepted, j < verified); it was accepted if j < accepted. `calibrate` (static): also
    count the slots per confidence bin (`calibration_curve`); off, `logprob_bk` is not read.
    """
    k = logprob_bk.shape[1]
    j = jnp.arange(k)[None, :]
    tried_bk = (j < verified_b[:, None]) & (j <= accepted_b[:, None]) & live_b[:, None]
    hit_bk = tried_bk & (j < accepted_b[:, None])
    # A row tried min(verified, accepted + 1) slots and had `accepted` of them accepted (in closed
    # form: sums over the slots are kernels of their own in every drafting step on XLA:CPU).
    live = live_b.astype(jnp.float32)
    accepted = jnp.minimum(accepted_b, verified_b).astype(jnp.float32)
    hits_b = live * accepted
    tries_b = live * jnp.minimum(verified_b.astype(jnp.float32), accepted + 1.0)
    # The run's totals from the rows' counts, not from the per-position sums below (equal where
    # every slot is at a tracked position): shared, those sums' masks became a kernel of their own
    # at batch 1, where the rows' sums fuse into the update (at batch 64 it is the other way round).
    state = state.replace(counts_2b=state.counts_2b * decay + jnp.stack([hits_b, tries_b]),
                          totals_2=state.totals_2 + jnp.stack([jnp.sum(hits_b), jnp.sum(tries_b)]))
    if calibrate:
        bins = state.calib_tried_c.shape[0]
        # Per-bin counts as sums over a one-hot [b, k, c] mask, not as scatter-adds: in the decode
        # loop on XLA:CPU the two scatters cost a goodput step about 30 us more at batch 1 (k = 5, a
        # 2.2 ms step; 52 against 28 us over fixed k = 5, the means of six paired diagnostics each).
        in_bin_bkc = _bin_of(logprob_bk, bins)[:, :, None] == jnp.arange(bins)[None, None, :]
        tried_c = jnp.sum(in_bin_bkc & tried_bk[:, :, None], axis=(0, 1), dtype=jnp.float32)
        hit_c = jnp.sum(in_bin_bkc & hit_bk[:, :, None], axis=(0, 1), dtype=jnp.float32)
        state = state.replace(calib_tried_c=state.calib_tried_c * decay + tried_c,
                              calib_accepted_c=state.calib_accepted_c * decay + hit_c)
    positions = state.pos_counts_4p.shape[1]
    if positions == 0:
        return state
    # Slots past the tracked positions (none: the engine tracks the longest draft) are not counted.
    used = min(k, positions)
    hit_tried_2p = jnp.zeros((2, positions), jnp.float32).at[:, :used].set(
        jnp.sum(jnp.stack([hit_bk[:, :used], tried_bk[:, :used]]), axis=1, dtype=jnp.float32))
    decay_4 = jnp.asarray([POSITION_DECAY, POSITION_DECAY, 1.0, 1.0], jnp.float32)
    return state.replace(pos_counts_4p=state.pos_counts_4p * decay_4[:, None] + jnp.tile(hit_tried_2p, (2, 1)))


def age(state: PolicyState, steps, decay: float = OFF_DECAY) -> PolicyState:
    """The counts after `steps` steps without drafting (traced count, applied once).

    Plain decoding steps observe nothing, so the decode loop skips the policy in them and ages the
    evidence once when it returns. The rate is slower than `DECAY`: it sets how often a batch that
    switched speculation off probes it again (the planning estimate's optimism grows back as the
    counts shrink), and every probe of a draft length that does not pay costs steps.
    """
    factor = jnp.asarray(decay, jnp.float32) ** jnp.asarray(steps, jnp.float32)
    return state.replace(counts_2b=state.counts_2b * factor,
                         seed_accepted_b=state.seed_accepted_b * factor, seed_trials_b=state.seed_trials_b * factor,
                         memory_trials=state.memory_trials * factor,
                         calib_tried_c=state.calib_tried_c * factor, calib_accepted_c=state.calib_accepted_c * factor)


def token_moments(alpha, ks, xp=jnp, profile=None):
    """Mean and variance of the tokens one verification emits with k drafts (for each k in the
    static tuple `ks`), each accepted with probability alpha: X = i with probability
    alpha^(i-1) (1 - alpha) for i <= k, and X = k + 1 with probability alpha^k. With a `profile`
    (`PolicyState.profile_p`) the p-th draft is accepted with probability alpha * profile[p]."""
    p_ji = _emitted_probs(alpha, ks, xp, profile)
    i_i = xp.arange(1, max(ks) + 2, dtype=xp.float32)[None, :]
    mean_j = xp.sum(p_ji * i_i, axis=1)
    return mean_j, xp.maximum(xp.sum(p_ji * i_i * i_i, axis=1) - mean_j * mean_j, 0.0)


def _emitted_probs(alpha, ks, xp, profile=None):
    """P(X = i) for i = 1 .. max(ks) + 1 (columns), for each k in `ks` (rows)."""
    alpha = xp.clip(xp.asarray(alpha, xp.float32), 0.0, 1.0)
    i_i = xp.arange(1, max(ks) + 2, dtype=xp.float32)[None, :]
    k_j = xp.asarray(ks, xp.float32)[:, None]
    if profile is None:
        return xp.where(i_i <= k_j, alpha ** (i_i - 1.0) * (1.0 - alpha),
                        xp.where(i_i == k_j + 1.0, alpha ** k_j, 0.0))
    accept_i = _position_rates(alpha, max(ks) + 1, profile, xp)          # P(accept the i-th draft)
    reached_i = xp.concatenate([xp.ones((1,), xp.float32), xp.cumprod(accept_i)[:-1]])   # P(X >= i)
    return xp.where(i_i <= k_j, reached_i * (1.0 - accept_i), xp.where(i_i == k_j + 1.0, reached_i, 0.0))


def _position_rates(alpha, n: int, profile, xp):
    """alpha * profile[p] for the first `n` draft positions (in a new last axis), at most 1;
    positions past the profile take its last entry."""
    profile = xp.asarray(profile, xp.float32)
    idx = np.minimum(np.arange(n), profile.shape[0] - 1)
    return xp.clip(xp.asarray(alpha, xp.float32)[..., None] * profile[idx], 0.0, 1.0)


def expected_tokens(alpha_b, ks, profile=None, xp=jnp):
    """Expected tokens one verification emits, per candidate k in `ks` (rows) and per row's
    acceptance `alpha_b` (columns): `expected_tokens_per_step` when `profile` is None, else with
    the p-th draft accepted with probability alpha * profile[p] (`PolicyState.profile_p`):
    1 + the sum over i <= k of the chance the first i drafts are all accepted."""
    alpha_b = xp.asarray(alpha_b, xp.float32)
    k_j = xp.asarray(ks, xp.float32)[:, None]
    if profile is None:
        alpha = xp.clip(alpha_b, 0.0, 1.0)[None, :]
        safe = xp.where(alpha < 1.0, alpha, 0.5)
        return xp.where(alpha < 1.0, (1.0 - safe ** (k_j + 1.0)) / (1.0 - safe), k_j + 1.0)
    reached_bi = xp.cumprod(_position_rates(alpha_b, max(max(ks), 1), profile, xp), axis=-1)
    total_bi = xp.concatenate([xp.ones(alpha_b.shape + (1,), xp.float32), 1.0 + xp.cumsum(reached_bi, axis=-1)],
                              axis=-1)
    return xp.take(total_bi, xp.asarray(ks, xp.int32), axis=-1).T


def _normal_drain_steps(alpha, ks, r_b, live_b, xp, spread=0.0, profile=None):
    """E[max_i S_i] over the live rows by the renewal normal approximation, each row's rate
    spread by `spread` about alpha (`drain_tokens_per_step`)."""
    ndtr = jax.scipy.special.ndtr if xp is jnp else scipy.special.ndtr
    mean_j, var_j = token_moments(alpha, ks, xp, profile)
    mean_j1, var_j1 = mean_j[:, None], var_j[:, None]
    overshoot_j1 = ((var_j1 + mean_j1 * mean_j1) / mean_j1 - 1.0) / 2.0
    m_jb = xp.where(live_b[None, :], (r_b[None, :] + overshoot_j1) / mean_j1, 0.0)
    # A row's own rate is alpha + e, e of standard deviation `spread`: its steps r / mu(alpha + e)
    # vary by about r mu'(alpha) / mu^2 * e more (mu = sum of alpha^i, i <= k; mu' = sum of
    # i alpha^(i - 1)).
    # (With a profile, mu = sum of the chances the first i drafts are accepted, each alpha^i times
    # a product of the profile: mu' = sum of i times that chance over alpha.)
    i_i = xp.arange(1, max(ks) + 1, dtype=xp.float32)[None, :]
    clipped = xp.clip(xp.asarray(alpha, xp.float32), 0.0, 1.0)
    if profile is None:
        term_i = i_i * clipped ** (i_i - 1.0)
    else:
        term_i = i_i * xp.cumprod(_position_rates(clipped, max(ks), profile, xp))[None, :] / xp.maximum(clipped, 1e-6)
    slope_j = xp.sum(xp.where(i_i <= xp.asarray(ks, xp.float32)[:, None], term_i, 0.0), axis=1)
    rate_jb = r_b[None, :] * (slope_j / mean_j ** 2)[:, None] * spread
    s_jb = xp.sqrt(r_b[None, :] * var_j1 / mean_j1 ** 3 + rate_jb * rate_jb)
    lo_j = xp.max(xp.where(live_b[None, :], m_jb - 6.0 * s_jb, 0.0), axis=1)
    hi_j = xp.max(m_jb + 6.0 * s_jb, axis=1)
    t_g = xp.linspace(0.0, 1.0, DRAIN_GRID, dtype=xp.float32)
    s_jg = lo_j[:, None] + (hi_j - lo_j)[:, None] * t_g[None, :]
    spread_jb = xp.maximum(s_jb, 1e-6)[:, None, :]
    cdf_jgb = xp.where(s_jb[:, None, :] > 0, ndtr((s_jg[:, :, None] - m_jb[:, None, :]) / spread_jb),
                       (s_jg[:, :, None] >= m_jb[:, None, :]).astype(xp.float32))
    cdf_jgb = xp.where(live_b[None, None, :], cdf_jgb, 1.0)
    tail_jg = 1.0 - xp.prod(cdf_jgb, axis=2)
    area_j = xp.sum((tail_jg[:, 1:] + tail_jg[:, :-1]) / 2.0, axis=1) * (hi_j - lo_j) / (DRAIN_GRID - 1)
    return lo_j + area_j


def _exact_drain_steps(alpha, ks, r_b, live_b, xp, profile=None):
    """E[max_i S_i] over the live rows, exactly, where every r_i <= DRAIN_EXACT: the normal
    approximation is off by 15-42% with 2-4 tokens left and 8-14% with 8-16 (batch 1 and 16,
    alpha 0.5-0.95, against simulation), where steps are few and discrete. The distribution of
    the tokens a row has emitted after n steps is the n-fold convolution of one step's (the same
    for every row: they share alpha); below DRAIN_EXACT tokens nothing that went past it is
    needed, so each step is a short convolution of a DRAIN_EXACT-long vector.
    P(S_i <= n) = P(emitted after n steps >= r_i); rows are independent and S_i <= r_i, so
    E[max_i S_i] = sum over n < DRAIN_EXACT of 1 - prod_i P(S_i <= n)."""
    top = DRAIN_EXACT
    p_ji = _emitted_probs(alpha, ks, xp, profile)
    rows, sizes = p_ji.shape
    # Shifts and adds only: matrix products of this size cost 1.4x as much on XLA:CPU.
    dist_jc = xp.asarray(np.tile(np.eye(1, top, dtype=np.float32), (rows, 1)))
    dists = []                          # [n][j, c]: P(c tokens emitted after n steps), c < top
    for _ in range(top):
        dists.append(dist_jc)
        dist_jc = sum(p_ji[:, i - 1:i] * xp.concatenate([xp.zeros((rows, i), xp.float32), dist_jc[:, :top - i]],
                                                          axis=1)
                      for i in range(1, min(sizes, top) + 1))
    dist_jnc = xp.stack(dists, axis=1)
    below_jnr = xp.concatenate([xp.zeros((rows, top, 1), xp.float32), xp.cumsum(dist_jnc, axis=2)], axis=2)
    r_idx = xp.clip(r_b, 0, top).astype(xp.int32)
    done_jnb = xp.where(live_b[None, None, :], 1.0 - below_jnr[:, :, r_idx], 1.0)
    return xp.sum(1.0 - xp.prod(done_jnb, axis=2), axis=1)


def drain_tokens_per_step(alpha_b, live_b, remaining_b, ks, xp=jnp, exact: bool = True, spread=0.0,
                          profile=None):
    """For a batch that runs until its slowest row is done (no request waits to take a finished
    row's slot): for each draft length, the live rows' remaining tokens divided by the expected
    steps until the last of them is done, i.e. the tokens per step that draft length is worth
    over the rest of the run.

    `expected_tokens_per_step` summed over rows counts a step's tokens wherever they land, but a
    static batch's wall time is its slowest row's: speculation's steps per row vary, and the
    expected maximum over many rows is well above the mean (at batch 64 with k = 1, 59 steps
    where the mean was 52), while plain decoding's steps are exactly the remaining tokens.

    Model: rows share the batch's mean acceptance alpha (per-row estimates over a few trials are
    too noisy for their minimum to mean anything); row i needs S_i steps for its r_i remaining
    tokens, by the renewal central limit theorem about normal with mean (r_i + o) / mu and
    variance r_i var / mu^3 (mu, var: `token_moments`; o = (E[X^2] / mu - 1) / 2, the mean
    overshoot of the last step); rows are independent, so E[max_i S_i] =
    lo + integral from lo to hi of (1 - prod_i P(S_i <= s)) ds, on DRAIN_GRID points between
    lo and hi, 6 standard deviations either side of the largest mean. When no live row has more
    than DRAIN_EXACT tokens left (a drain's last steps), the steps are counted exactly
    (`_exact_drain_steps`) unless `exact` is False. Plain decoding is exact: max_i r_i steps.
    Checked against simulation in tests/test_policy.py.

    `profile`: the per-position profile of acceptance (`PolicyState.profile_p`), or None (flat).

    `spread`: how far rows' own rates differ (a standard deviation, `AcceptanceMemory.spread`).
    The rows share alpha, but the slowest row is mostly one with a lower rate: on the tiny-8L
    pair at batch 4 (16 sets of prompts, 96 tokens), the largest row's steps were 2% above this
    model's estimate at k = 1 and 10% above it at k = 4-6, and that favoured long drafts. A row's
    steps then vary by r mu'(alpha) / mu^2 * spread more (a first-order expansion of r / mu);
    the exact count near the end ignores it (its rows have at most DRAIN_EXACT tokens left).

    `xp`: jax.numpy on device, numpy for the host's twin (the same arithmetic).
    """
    live_b = xp.asarray(live_b, bool)
    r_b = xp.where(live_b, xp.asarray(remaining_b, xp.float32), 0.0)
    n_live = xp.maximum(xp.sum(live_b), 1)
    alpha = xp.sum(xp.where(live_b, xp.asarray(alpha_b, xp.float32), 0.0)) / n_live
    exact = (xp.max(r_b) <= DRAIN_EXACT) & exact
    args = (alpha, ks, r_b, live_b, xp)
    if xp is jnp:
        # A branch, not both computed: the exact count costs about 0.1 ms on XLA:CPU, and the
        # policy evaluates this every few drafting steps.
        steps_j = jax.lax.cond(exact, lambda: _exact_drain_steps(*args, profile=profile),
                               lambda: _normal_drain_steps(*args, spread=spread, profile=profile))
    else:
        steps_j = (_exact_drain_steps(*args, profile=profile) if exact
                   else _normal_drain_steps(*args, spread=spread, profile=profile))
    return xp.sum(r_b) / xp.maximum(steps_j, 1e-6)


class TetrisPlan(NamedTuple):
    """The goodput policy's view of a TETRIS plan among its candidates: plan `index` drafts
    `draft_len` positions per row, then verifies the best C of them across the batch, C chosen
    among `capacities` (static), each with its predicted step time `seconds_c` (traced)."""

    index: int
    draft_len: int
    capacities: tuple[int, ...]
    seconds_c: jax.Array


def goodput_of_ks(alpha_b, live_b, ks, seconds_j, drain=None, exact_drain: bool = True,
                  tetris: TetrisPlan | None = None, spread=0.0, profile=None):
    """Predicted goodput (tokens per second) of each candidate draft length.

    Args:
      alpha_b: per-row acceptance estimates.
      live_b: rows still generating (finished rows emit nothing but still cost compute).
      ks: static tuple of candidate draft lengths.
      seconds_j: float [len(ks)] predicted step time of each candidate at the compiled shape
        (`CostModel.step_seconds`, computed on the host once per decode call).
      drain: None, or (remaining_b, draining): each row's tokens still to come, and a traced flag
        set while no request waits for a slot. While it is set, a step's tokens are what each
        draft length is worth until the slowest row is done (`drain_tokens_per_step`) instead of
        the expected tokens of one step summed over rows.
      exact_drain: static; False keeps `drain_tokens_per_step` to its normal approximation.
      spread: the rows' spread of acceptance, for the drain rule (`PolicyState.spread`).
      profile: acceptance along the draft window (`PolicyState.profile_p`; None: flat, the
        geometric model).
      tetris: the TETRIS plan among the candidates, if any. Its goodput is that of its best budget
        (`tetris_goodput`), not that of the standard draft length it stands for in `ks`: at batch 1
        the TETRIS plan of a k = 4, extra = 2 decoder verifies up to 6 drafts, and judged as k = 4
        at the cost of drafting 6 it lost to standard k = 3, 9% behind the best fixed k (5) at
        SmolLM2 shapes. While the batch drains, that goodput is discounted by the drain rule's
        factor for the length it stands for.
    """
    step_tokens_j = jnp.sum(jnp.where(live_b[None, :], expected_tokens(alpha_b, ks, profile), 0.0), axis=1)
    tokens_j = step_tokens_j
    if drain is not None:
        remaining_b, draining = drain
        tokens_j = jnp.where(draining, drain_tokens_per_step(alpha_b, live_b, remaining_b, ks, exact=exact_drain,
                                                             spread=spread, profile=profile), tokens_j)
    goodput_j = tokens_j / seconds_j
    if tetris is not None:
        # While the batch drains, the best budget's goodput is discounted as the drain rule
        # discounts the length the plan stands for (what the slowest row's last steps waste).
        j = tetris.index
        discount = tokens_j[j] / jnp.maximum(step_tokens_j[j], 1e-30)
        goodput_j = goodput_j.at[j].set(jnp.max(tetris_goodput(alpha_b, live_b, tetris, profile)) * discount)
    return goodput_j


def tetris_goodput(alpha_b, live_b, tetris: TetrisPlan, profile=None):
    """Predicted goodput of each budget of a TETRIS plan, before drafting: the j-th draft of a row
    survives with probability alpha^j (its cumulative acceptance), so the C slots TETRIS verifies
    are the C largest of those over the live rows' `draft_len` positions
    (`goodput_of_capacities`, with the geometric model's probabilities for the drafts' calibrated
    ones)."""
    if profile is None:
        j_k = jnp.arange(1, tetris.draft_len + 1, dtype=jnp.float32)
        cum_bk = j_k[None, :] * jnp.log(jnp.clip(jnp.asarray(alpha_b, jnp.float32), 0.0, 1.0))[:, None]
    else:   # (`profile`: as in `goodput_of_ks`)
        cum_bk = jnp.cumsum(jnp.log(_position_rates(alpha_b, tetris.draft_len, profile, jnp)), axis=1)
    cum_bk = jnp.where(live_b[:, None], cum_bk, -jnp.inf)
    # The budgets are the whole batch's; a refill plans for its new rows only, fewer slots.
    slots = max(cum_bk.size, max(tetris.capacities))
    cum_flat = jnp.full((slots,), -jnp.inf, jnp.float32).at[:cum_bk.size].set(cum_bk.reshape(-1))
    return goodput_of_capacities(cum_flat, jnp.sum(live_b), tetris.capacities, tetris.seconds_c)


def choose_k(state: PolicyState, live_b, ks, seconds_j, optimistic: bool = True, current=None,
             margin: float = SWITCH_MARGIN, drain=None, switch_seconds=0.0,
             tetris: TetrisPlan | None = None) -> jax.Array:
    """Index into `ks` of the candidate with the highest predicted goodput (first on ties).

    Args:
      optimistic: plan with `planning_alpha_b` (the decode loop does when speculation is off or
        nothing has been seen yet, to decide whether to probe it); else with the plain estimate
        `alpha_b` (while drafting, evidence flows every step: a bonus would only keep speculation
        on where it does not pay, e.g. at large batches where plain decoding wins by a few
        percent). With `drain` (the rows' remaining tokens), a stop, the switch to plain decoding,
        is judged on what drafting is worth over those tokens (`_stopping_judged_ahead`).
      current: the index of the plan running now, if any: it is kept unless the best candidate's
        predicted goodput beats it by more than `margin` plus `THIN_EVIDENCE / sqrt(1 + trials)` (the
        batch's evidence: its decayed trials and its rows' seeds, `evidence_b`). A switch costs a
        host round trip, and where goodput is flat over k (a few percent apart, closer than step
        times are predicted) switching back and forth costs more than it can gain. The second
        term asks more of a switch while evidence is thin: at batch 1 a row's first few
        verifications are a handful of coin flips, and turning speculation off on them (for a
        plain stretch of up to 64 steps before the next probe) cost 10% of a run where k = 1 was
        10% better than plain decoding.
      drain: as in `goodput_of_ks`.
      switch_seconds: what a switch costs (the host round trip). While the batch drains, a switch
        must also save more than that over the rest of the run (`_saves_a_switch`).
      tetris: as in `goodput_of_ks`.
    """
    alpha_b = state.planning_alpha_b() if optimistic else state.alpha_b()
    goodput_j = goodput_of_ks(alpha_b, live_b, ks, seconds_j, drain, tetris=tetris, spread=state.spread,
                              profile=state.profile_p())
    if not optimistic and drain is not None:
        goodput_j = _stopping_judged_ahead(state, live_b, ks, seconds_j, goodput_j, drain[0], tetris)
    best = jnp.argmax(goodput_j).astype(jnp.int32)
    if current is None:
        return best
    margin = switch_margin(state, margin)
    switch = ((goodput_j[best] > (1.0 + margin) * goodput_j[current])
              & _saves_a_switch(goodput_j[current], goodput_j[best], live_b, drain, switch_seconds))
    return jnp.where(switch, best, jnp.int32(current))


def switch_margin(state: PolicyState, margin: float = SWITCH_MARGIN, xp=jnp):
    """The predicted gain a switch of plans must beat (`choose_k`, and the host after a timing
    trial, with `xp` = numpy): `margin` plus THIN_EVIDENCE / sqrt(1 + the batch's trials, seeds
    included)."""
    return margin + THIN_EVIDENCE / xp.sqrt(1.0 + xp.sum(state.evidence_b()))


def _stopping_judged_ahead(state: PolicyState, live_b, ks, seconds_j, goodput_j, remaining_b, tetris=None):
    """`goodput_j` with plain decoding's scaled down by how much more the best drafting plan is
    worth over the rows' remaining tokens (`forecast_alpha_b`) than over their next few (`alpha_b`).

    Draft lengths are chosen on recent acceptance: drafting keeps observing, and a choice that
    stops fitting is revised within a few steps. A stop is not: plain decoding observes nothing
    and stands until the aged, optimistic estimate pays for a probe and the drafter's catch-up,
    in a 96-token call mostly never. So a dip in recent acceptance (a hard start: on the tiny-8L
    pair at batch 1, one benchmark prompt rejects 4 of its first 12 drafts and accepts 85% after)
    stops drafting only if drafting is also worth less than plain decoding over the tokens still
    to come; the factor is at most 1, so a row running above its seed stops no sooner than
    before. Measured over 15 calls of that prompt, 3 drafted a few steps and then decoded plainly
    to the end, each 5-10% slower than drafting throughout; the ratio uses one step's expected
    tokens (not the drain rule's count, which costs 7-40 us a step on XLA:CPU)."""
    drafting_j = jnp.asarray(ks) > 0
    profile = state.profile_p()
    recent_j = goodput_of_ks(state.alpha_b(), live_b, ks, seconds_j, tetris=tetris, profile=profile)
    ahead_j = goodput_of_ks(state.forecast_alpha_b(remaining_b), live_b, ks, seconds_j, tetris=tetris, profile=profile)
    best_recent = jnp.max(jnp.where(drafting_j, recent_j, 0.0))
    best_ahead = jnp.max(jnp.where(drafting_j, ahead_j, 0.0))
    factor = jnp.minimum(1.0, best_recent / jnp.maximum(best_ahead, 1e-30))
    return jnp.where(drafting_j, goodput_j, goodput_j * factor)


def _saves_a_switch(goodput_from, goodput_to, live_b, drain, switch_seconds, entry_seconds=0.0):
    """Whether a switch from a plan of predicted goodput `goodput_from` to one of `goodput_to`
    pays for itself over the live rows' remaining tokens: their time at each goodput, differenced.
    Under the drain rule a plan's goodput is those tokens over its predicted time to finish, so the
    difference is the time the switch saves the run.

    - `switch_seconds` (the host round trip) is weighed only while the batch drains. Without it
      the policy switched to plain decoding for a static batch's last one or two tokens, which
      saved about the round trip the switch cost. While requests wait the run goes on, and a
      better plan's gain grows with it.
    - `entry_seconds` (what starting to draft costs: the drafter's catch-up on the context it has
      not seen, `draft_entry_seconds`) is weighed in both cases: it is spent on the rows running
      now, and only their remaining tokens can pay it back (rows refilled later bring their own
      prefill).
    """
    if drain is None:
        return jnp.bool_(True)
    remaining_b, draining = drain
    tokens = jnp.sum(jnp.where(live_b, jnp.asarray(remaining_b, jnp.float32), 0.0))
    saved = tokens / jnp.maximum(goodput_from, 1e-30) - tokens / jnp.maximum(goodput_to, 1e-30)
    return saved > entry_seconds + jnp.where(draining, switch_seconds, 0.0)


def draft_entry_seconds(position_seconds, backlog_b, live_b):
    """What starting to draft costs now: the drafter feeds the positions it has not seen (`backlog_b`,
    `Drafter.backlog`; at a run's opening, the prompts) before its first proposal, the batch's
    rows side by side, so the longest live backlog sets the time, at `position_seconds` each (the
    drafter's prefill time over its padded prompt width, measured at warm-up).

    Measured on the tiny-8L pair (CPU): a k = 1 call costs 1.9-3.4 plain steps more than an
    autoregressive one before its first step, and at batch 16 that turned a step-time tie into a
    6% loss. Catch-up in chunks of 8 positions cost 0.72 ms a position at batch 16 where the
    prefill cost 0.58: the prefill's rate is the estimate, about a fifth low for a long catch-up.
    """
    return position_seconds * jnp.max(jnp.where(live_b, jnp.asarray(backlog_b, jnp.float32), 0.0), initial=0.0)


def probe_choice(state: PolicyState, live_b, ks, seconds_j, margin: float = SWITCH_MARGIN, drain=None,
                 switch_seconds=0.0, entry_seconds=0.0, exact_drain: bool = True,
                 tetris: TetrisPlan | None = None) -> jax.Array:
    """The next plan while speculation is off: a probe with the cheapest drafting plan (the
    smallest k > 0) if, under the optimistic estimate, some k > 0 beats plain decoding's
    predicted goodput by more than `margin`, and its gain over the live rows' remaining tokens
    outweighs `entry_seconds` (the drafter's catch-up), the probe's own expected loss and, while
    the batch drains, `switch_seconds` (`_saves_a_switch`); else plain decoding.

    The probe's loss: its PROBE_STEPS steps of the cheapest plan, times the share of plain
    decoding's goodput that plan falls short by under the plain estimate `alpha_b` (none where it
    is expected to beat plain decoding). Without it, a decoder at batch 1 whose best draft length
    was within a few percent of plain decoding (the optimism of the planning estimate, which the
    evidence carried between calls keeps at about 0.06, made the hope clear the margin) probed
    k = 1 at the opening of most calls, and each probe cost about 4% of a 96-token call.

    A few steps of k = 1 measure acceptance for about what plain steps would have cost; probing
    with the optimistic argmax instead (k = 4-6 at small batches) cost 5-15% of a short run each
    time speculation then did not pay. Where it does pay, the per-step choice moves on to the best
    k after `MIN_SEGMENT` steps of evidence. The margin is the switch margin of `choose_k` (the
    running plan is plain decoding): where the best hope is a tie (batch 64, a k = 1 step costing
    1.9 plain steps), a probe cannot gain and costs the draft's prefill, 6% of such a run.
    `exact_drain` and `tetris` as in `goodput_of_ks`.
    """
    ks_j = jnp.asarray(ks)
    profile = state.profile_p()
    goodput_j = goodput_of_ks(state.planning_alpha_b(), live_b, ks, seconds_j, drain, exact_drain, tetris,
                              spread=state.spread, profile=profile)
    plain = ks.index(0)
    cheapest = min((j for j, k in enumerate(ks) if k > 0), key=lambda j: ks[j])
    hope = jnp.max(jnp.where(ks_j > 0, goodput_j, -jnp.inf))
    expected_j = goodput_of_ks(state.alpha_b(), live_b, ks, seconds_j, tetris=tetris, profile=profile)
    shortfall = jnp.clip(1.0 - expected_j[cheapest] / jnp.maximum(expected_j[plain], 1e-30), 0.0, 1.0)
    probe_loss = PROBE_STEPS * seconds_j[cheapest] * shortfall
    probe = ((hope > (1.0 + margin) * goodput_j[plain])
             & _saves_a_switch(goodput_j[plain], hope, live_b, drain, switch_seconds, entry_seconds + probe_loss))
    return jnp.where(probe, cheapest, plain).astype(jnp.int32)


def opening_choice(state: PolicyState, live_b, ks, seconds_j, drain=None, entry_seconds=0.0,
                   switch_seconds=0.0, tetris: TetrisPlan | None = None) -> jax.Array:
    """The first plan of a run, before it has observed anything: the plan the estimate (the seeded
    counts, or the bare prior) expects to be best, if it drafts and its gain over plain decoding
    pays for `entry_seconds` (the drafter's prefill, which plain decoding skips: `_saves_a_switch`);
    else `probe_choice` (speculation is probed if, under the optimistic estimate, it beats plain
    decoding by the switch margin and pays for its entry, its own steps and, while the batch
    drains, `switch_seconds`: the round trip back to plain decoding if it fails). `tetris` as in
    `goodput_of_ks`."""
    goodput_j = goodput_of_ks(state.alpha_b(), live_b, ks, seconds_j, drain, tetris=tetris, spread=state.spread,
                              profile=state.profile_p())
    best = jnp.argmax(goodput_j).astype(jnp.int32)
    plain = ks.index(0)
    drafts = ((jnp.asarray(ks)[best] > 0)
              & _saves_a_switch(goodput_j[plain], goodput_j[best], live_b, drain, 0.0, entry_seconds))
    return jnp.where(drafts, best, probe_choice(state, live_b, ks, seconds_j, drain=drain,
                                                switch_seconds=switch_seconds, entry_seconds=entry_seconds,
                                                tetris=tetris))


# Step counts at which `plain_horizon` looks ahead: 4 * 2^(g/4), 4 to 1024 steps.
HORIZON_GRID = tuple(sorted({int(round(4 * 2 ** (g / 4))) for g in range(33)}))


def plain_horizon(state: PolicyState, live_b, ks, seconds_j, grid=HORIZON_GRID, drain=None,
                  switch_seconds=0.0, entry=None, tetris: TetrisPlan | None = None) -> jax.Array:
    """Plain decoding steps until the aged optimistic estimate would probe speculation again
    (`probe_choice`).

    While speculation is off nothing is observed, so the next choice depends only on how many
    plain steps have aged the counts (`age`). Looking ahead over a grid of step counts once, at
    the end of a segment, lets the next plain segment run that long without returning to the
    host to re-ask (each return is a round trip). Returns the first grid count at which the choice
    drafts, or the grid's largest count when it never does (e.g. a cost model under which even
    alpha = 1 loses). With `drain` (as in `goodput_of_ks`), each row's remaining tokens shrink by
    one per plain step looked ahead, and rows they run out on drop out; `switch_seconds` as in
    `probe_choice`. `entry`: None, or (position_seconds, backlog_b) as in `draft_entry_seconds`;
    each plain step looked ahead adds a position to every row's backlog. The look-ahead keeps the
    drain rule to its normal approximation: under `vmap` the exact count's branch is not skipped,
    and it made one look-ahead 3 ms dearer at batch 1 on XLA:CPU (the probe on return counts
    exactly, so a look-ahead misjudging the last tokens costs at most a round trip). `tetris` as
    in `goodput_of_ks`.
    """
    def probes(steps):
        live, ahead = live_b, None
        if drain is not None:
            remaining_b, draining = drain
            ahead = (remaining_b - steps, draining)
            live = jnp.where(draining, live_b & (remaining_b > steps), live_b)
        entry_seconds = 0.0 if entry is None else draft_entry_seconds(entry[0], entry[1] + steps, live)
        choice = probe_choice(age(state, steps), live, ks, seconds_j, drain=ahead, switch_seconds=switch_seconds,
                              entry_seconds=entry_seconds, exact_drain=False, tetris=tetris)
        return jnp.asarray(ks)[choice] > 0

    grid_g = jnp.asarray(grid, jnp.int32)
    probe_g = jax.vmap(probes)(grid_g)
    return jnp.where(jnp.any(probe_g), grid_g[jnp.argmax(probe_g)], grid_g[-1]).astype(jnp.int32)


def goodput_of_capacities(cum_logprob_flat, num_live, capacities, seconds_j):
    """Predicted goodput of each TETRIS budget C on the drafts at hand.

    The expected number of accepted drafts with budget C is the sum of the C largest cumulative
    acceptance probabilities of the batch (what `tetris.select` picks); each live row also emits
    its correction/bonus token. `seconds_j` is each budget's predicted step time (its packed
    verification size; the drafting cost is the same for every C).
    """
    top = max(capacities)
    values = jax.lax.top_k(cum_logprob_flat, top)[0] if top else jnp.zeros((0,), jnp.float32)
    prefix = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(jnp.exp(values))])
    tokens_j = num_live + prefix[jnp.asarray(capacities, jnp.int32)]
    return tokens_j / seconds_j
