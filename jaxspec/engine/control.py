"""The host's side of the goodput policy: what a decoder measures and decides between segments.

The device chooses each segment's plan (`policy.choose_k`, inside `loop.run_on_device`); the host
gives it step times to choose by and corrects them. Per decoder and compiled shape,
`GoodputControl` keeps what the warm-up measured (each plan's step time at the shape, a
segment's round trip, the acceptance on the call's own rows), the step times corrected by every
segment since (`cost.StepTimeTracker`), the plan the last call opened on, and the streak of lean
calls (whole calls of one plan in one program: plain decoding, `loop.plain_call_on_device`, or a
standard draft length, `loop.drafting_call_on_device`, compiled in the background). Between
segments it proposes timing trials of plans whose times are in doubt and decides after them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import cost as cost_lib
from jaxspec import policy as policy_lib
from jaxspec.engine import loop
from jaxspec.engine.loop import Schedule

# A goodput segment runs at least `loop.MIN_SEGMENT` steps (see there) and at most a cap: each
# return lets the host correct the step times from the segment's measured time
# (`cost.StepTimeTracker`), and costs a round trip (1-2 ms on XLA:CPU, a third of a step at batch
# 1). A first segment planned by the profile alone (`measure_plans=False`) is kept short so its
# correction comes early; plans timed at warm-up need none that soon (the device still switches
# plans within the segment when the acceptance it sees asks for it); later segments run up to
# MAX_SEGMENT_CAP steps.
FIRST_SEGMENT_CAP = loop.MIN_SEGMENT
# A timing trial (`StepTimeTracker.explore`) runs at most this many steps: enough to time its plan
# (at batch 1 of the tiny-8L pair, 16 plain steps take 10 ms against a 1 ms round trip), then the
# policy takes over again. A trial of MAX_SEGMENT_CAP steps (the rule before) is two thirds of a
# 96-token call at batch 1 or more: in a batch-1 diagnostic the trials of k = 4 and 5 each ran a
# whole call.
TRIAL_STEPS = 16
# A call may instead open on a plan tied with the one it would run (within the switch margin) whose
# last timing is TIE_RETIME segments old, for a whole segment (`StepTimeTracker.retime_tie`).
TIE_RETIME = 4
# Lean calls (`GoodputControl.lean_call`) after a call that decoded plainly throughout before
# a call lets the device choose its plan again.
LEAN_CALLS = 3
# A drafting plan's lean program (`loop.drafting_call_on_device`) is compiled, in the background,
# once LEAN_DRAFTING_RUNS full calls in a row at the shape ran that plan throughout: a decoder
# that makes a call or two (most tests, a what-if study) never pays for it.
LEAN_DRAFTING_RUNS = 2
# How far the corrected step times may have moved in drafting's favour since the call that
# qualified lean calls (a drafting plan's time relative to plain decoding's) before the next call
# lets the device choose instead: half the policy's switch margin.
LEAN_DRIFT = 0.02
# Distinct openings whose counts a decoder keeps (`GoodputControl.opening_tokens`).
OPENING_MEMO_SIZE = 64
# A drafting segment re-chooses its plan every `SpecConfig.choose_every` steps (from MIN_SEGMENT
# on; 4 by default), not every step: the choice is a few hundred small operations (the drain rule's
# expected maximum over rows, the judgement of a stop over the rows' remaining tokens), which
# XLA:CPU runs one by one. Every step it cost 1.8-3.5% of a batch-1 call of the tiny-8L pair at
# k = 4 (a 2 ms step); a switch the acceptance asks for comes at most choose_every - 1 steps later.
MAX_SEGMENT_CAP = 64
# Goodput warm-up with `SpecConfig.measure_plans` (`GoodputControl.warm_up`): after one
# untimed step, each plan is timed in passes of up to MEASURE_STEPS steps, as many as make about
# MEASURE_PASS_SECONDS by the cost model for the first pass and by that pass's time after it (at
# batch 64 a k = 6 step takes 0.2 s: one step a pass is enough there, and more would add seconds
# to the first call; a sub-millisecond step timed one at a time is lost in the round trip's
# jitter, and a cost model far off sized it so). Passes of at most 3 steps timed the cheap plans
# slow, the cheapest most: at batch 16 the plain step by 14-17% (13.3-13.5 ms against 11.3-12.3
# in the run's long segments) and k = 1 by 7%, which tilted near-ties toward drafting; with up
# to 8 steps the plain step was timed at 11.4-11.6 ms, and the first call took no longer (the
# passes' length is bounded by MEASURE_PASS_SECONDS). At batch 1, where the cap and not the
# seconds bounds a pass, passes of up to 8 steps timed the drafting plans' line too steep: over 5
# warm-ups of the tiny-8L pair (96 tokens) the slope per drafted token came out 0.129 of a k = 1
# step on average (sd 0.042), and a steep line tilts the pick toward shorter drafts (k = 4 where
# fixed k = 5-6 ran faster). Passes of up to 32 steps: 0.086 (sd 0.018) in the same process; in
# another 0.084, against 0.098 with 16 and 0.075 with 64 (the longer the pass, the less the
# slope). The call's jitter (about a millisecond) is spread over 31 steps instead of 7, for
# about a second more of the first call there; a batch-1 benchmark then ran the best fixed k in
# all of its 32 calls. MEASURE_PASSES passes go round
# the plans, more (up to MEASURE_MAX_PASSES) while the timing has taken under MEASURE_SECONDS:
# small shapes, whose few-millisecond steps are the noisiest, are timed more often at little cost.
# Each pass makes every plan's 1-step call, then every plan's longer call, and a plan's step time
# is the difference of its two calls over the steps the longer one added: on XLA:CPU a drafting
# program's call costs about 1.3 ms besides its steps and the round trip (tiny-8L pair, batch 1:
# k = 2 timed at 2.1 / 1.56 / 1.32 ms a step in loops of 2 / 6 / 24 steps), which over 8 steps
# had timed drafting 15-25% dear at batch 1 and kept a run in plain decoding where k = 2-3 was
# faster. That cost goes into the round trip instead (the median, over the passes, of a 1-step
# call less its step). A plan whose rows have too few tokens left for its next pass restarts from
# a copy of the prefilled rows (after an untimed step): a pass that ran the rows out was timed
# with the call's own cost in it, and at batch 1 the drafting plans' fourth and fifth passes did
# (k = 3 at 2.56-2.71 ms a step where its other passes took 1.74-2.34 and a fixed k = 3 run's
# steps 1.8), which tilted a near-tie toward plain decoding.
MEASURE_STEPS = 32
MEASURE_PASS_SECONDS = 0.1
MEASURE_PASSES = 3
MEASURE_MAX_PASSES = 8
MEASURE_SECONDS = 0.5
# A segment's round trip (a call that runs no step, and the fetch of its outputs) is the median of
# ROUND_TRIPS such calls, going round the plans as the run's segments do. The fastest of three
# calls of one plan (the rule before) was 1.4 ms where the tiny-8L pair's 1-step segments at batch
# 1 took 2.0-2.2 ms besides their step: the drain rule then switched to plain decoding for a row's
# last token, a switch that saved 1.6 ms of drafting and cost a 2 ms round trip.
ROUND_TRIPS = 9


class Warm(NamedTuple):
    plan_seconds: np.ndarray | None   # each plan's seconds per step at the shape (None: not measured)
    round_trip: float                 # seconds of a segment's call and fetch, besides its steps
    acceptance: tuple | None          # (accepted_b, trials_b) the drafting plans counted (None: none)
    position_seconds: float           # the drafter's seconds per position it feeds (its prefill's rate)
    opening_seconds: float            # a run's opening (`start_on_device`) and the fetch of its choice
    predicted: dict | None = None     # step times the policy starts each call from (the warm-up's in them)
    lean_opening_seconds: float = 0.0  # a lean call's prefill and fetch (`plain_call_on_device`, no step)


class LeanStreak(NamedTuple):
    calls: int            # lean calls since the call that qualified them
    longest: int          # that call's longest request: a lean call's may be no longer
    ratio_j: np.ndarray   # the step-time corrections that call's opening judged by (`StepTimeTracker.ratio`)
    plan: int = 0         # the plan that call ran from its opening to its end
    runs: int = 1         # full calls in a row that ran that plan throughout


class GoodputControl:
    """A goodput decoder's measurements and decisions on the host, kept between its calls.

    Per compiled shape (`(slots, cache_len, out_len, schedule)`): `warm`, what the warm-up
    measured (`Warm`); `trackers`, the step times corrected by the segments so far, each call
    starting from where the calls before left them; `openings`, the plan the last call opened on
    (the next call's first segment is dispatched on it before the device's choice is read: see
    `loop.run_on_device`'s `follow`); `lean`, the streak of lean calls since the last call that
    decoded plainly in one segment (`lean_call`). Across shapes: `acceptance`, the acceptance
    measured by warm-ups and at the end of calls, which seeds a call's rows; `opening_memo`, the
    openings' counts of tokens per step (`opening_tokens`).
    """

    def __init__(self, target, drafter, sampling, spec, mesh=None):
        self.target, self.drafter, self.sampling, self.spec, self.mesh = target, drafter, sampling, spec, mesh
        self.warm: dict = {}
        self.trackers: dict = {}
        self.acceptance = policy_lib.AcceptanceMemory()
        self.openings: dict = {}
        self.lean: dict[tuple, LeanStreak] = {}
        self.opening_memo: dict = {}
        self.lean_programs: dict[tuple, concurrent.futures.Future] = {}   # drafting plans' lean programs
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None

    def prepare(self, shape_key, schedule: Schedule, rows_in, eos_t, budget_t, predicted, static,
                put) -> tuple[Warm, cost_lib.StepTimeTracker]:
        """A call's start at `shape_key`: the warm-up (`warm_up`, the first call at the shape only)
        and the step-time tracker, opened for the call. `predicted`: the cost model's step times
        (`predicted_seconds`); the returned Warm's `predicted` holds the ones the call starts from."""
        if shape_key not in self.warm:
            warm = self.warm_up(schedule, rows_in, eos_t, budget_t, predicted, static, put)
            if warm.acceptance is not None:
                self.acceptance.remember(*warm.acceptance)
            if warm.plan_seconds is not None:
                predicted = with_measured(predicted, warm.plan_seconds, schedule)
            # What a switch of plans costs, and what starting to draft costs a position: the
            # device weighs them against the time a switch saves.
            predicted["round_trip"] = np.float32(warm.round_trip)
            predicted["position"] = np.float32(warm.position_seconds)
            # Kept with the warm-up: rebuilding it every call (the line fit included) cost
            # 0.3 ms of host time a call, 0.5% of a 96-token call at batch 1 on XLA:CPU.
            self.warm[shape_key] = warm._replace(predicted=predicted)
        warm = self.warm[shape_key]
        # Step times corrected as segments are measured (passed traced: no recompile), from
        # where the calls before at this shape left them: a call of one segment (plain
        # decoding at large batches) would otherwise be judged by the warm-up's times alone.
        if shape_key not in self.trackers:
            self.trackers[shape_key] = cost_lib.StepTimeTracker(
                warm.predicted["plans"], kinds=[p.k > 0 for p in schedule.plans], round_trip=warm.round_trip,
                measured=None if warm.plan_seconds is None else np.isfinite(warm.plan_seconds))
        tracker = self.trackers[shape_key]
        tracker.new_call()
        return warm, tracker

    def finish_call(self, shape_key, schedule: Schedule, tracker: cost_lib.StepTimeTracker, opening_trial,
                    longest: int, opening_ratio_j: np.ndarray, policy, request_counters) -> None:
        """What a call (not lean) leaves for the next ones: the lean streak and the acceptance.

        Args:
          opening_trial: the timing trial the call opened on, or None.
          longest, opening_ratio_j: the call's longest request and the step-time corrections its
            opening judged by (`lean_call`).
          policy: the policy state the device left, read on the host.
          request_counters: the call's per-request counters (`batching.RequestQueue.counters`).
        """
        # A call that ran one segment of plain decoding, or of a standard drafting plan, from its
        # opening to its end makes the next calls at the shape lean (`lean_call`); any other call
        # ends a streak of them.
        plan = tracker.history[0][0] if len(tracker.history) == 1 and opening_trial is None else None
        if plan is not None and (schedule.plans[plan].k == 0 or leanable(schedule.plans[plan])):
            before = self.lean.get(shape_key)
            runs = before.runs + 1 if before is not None and before.plan == plan else 1
            self.lean[shape_key] = LeanStreak(calls=0, longest=longest, ratio_j=opening_ratio_j, plan=plan, runs=runs)
        else:
            self.lean.pop(shape_key, None)
        # The call's whole count seeds the next calls' rows; its requests' own counts measure how
        # far rows differ (`AcceptanceMemory.spread`).
        self.acceptance.remember(np.atleast_1d(policy.total_accepted), np.atleast_1d(policy.total_trials))
        self.acceptance.remember_requests(request_counters["accepted"], request_counters["tried"])
        self.acceptance.remember_positions(policy.pos_total_accepted_p, policy.pos_total_tried_p)

    def lean_called(self, shape_key) -> None:
        """Counts a lean call in its shape's streak."""
        streak = self.lean[shape_key]
        self.lean[shape_key] = streak._replace(calls=streak.calls + 1)

    def lean_program_due(self, shape_key, schedule: Schedule) -> int | None:
        """The drafting plan whose lean program should be compiled now (`compile_lean`): the one
        the last LEAN_DRAFTING_RUNS full calls at the shape ran throughout, if any."""
        streak = self.lean.get(shape_key)
        if streak is None or schedule.plans[streak.plan].k == 0 or streak.runs < LEAN_DRAFTING_RUNS:
            return None
        return streak.plan

    def compile_lean(self, key, args, static) -> None:
        """Compiles a drafting plan's lean program (`loop.drafting_call_on_device` with `args`) in
        a background thread, once per `key` (shape, plan, prompt width); `lean_call` waits for it.
        Compiled in the foreground, a plan's switch mid-run would stall a call for the compile
        (about 18 s at the qwen2.5 shapes on an H200's host)."""
        if key in self.lean_programs:
            return
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxspec-lean")
        def compile_it() -> None:   # the executable stays in jit's cache, where the call finds it
            loop.drafting_call_on_device.lower(*args, **static).compile()

        self.lean_programs[key] = self._compiler.submit(compile_it)

    def lean_call(self, shape_key, schedule: Schedule, plan_index: int, longest: int, ratio_j: np.ndarray,
                  tokens_j=None, seconds_j=None, program_key=None) -> bool:
        """Whether a goodput call that opens on `plan_index` with no timing trial, no request
        waiting and no per-request callback runs as one program: of plain decoding
        (`plain_call_on_device`) or of one standard drafting plan (`drafting_call_on_device`), its
        longest request asking for `longest` tokens, its step times corrected by `ratio_j`
        (`StepTimeTracker.ratio`). `tokens_j` and `seconds_j` (for a drafting plan): callables that
        return each plan's tokens per step and corrected step time, asked only when needed.

        A drafting plan: when one of the last calls at the shape ran it from its opening to its
        end, for requests no shorter, with fewer than LEAN_CALLS lean calls since, its program is
        compiled (`compile_lean`, under `program_key`), and by each plan's tokens per step at the
        remembered acceptance (`tokens_j`) over the corrected step times (`seconds_j`) it is within
        the policy's switch margin of the best: the device, opening on it, would keep it. What a
        goodput call costs around its steps (the opening's choice, a choice every few steps, the
        policy's counts, conditionals whose predicates the host reads, the caches crossing from the
        prefill's program into the segment's, the reads and the host's planning) is then not paid:
        on this CPU that was 4-7 ms of a 96-token call at batch 1 against fixed k = 6 running the
        same steps (`docs/results/policy_overhead_b1_k6.md`), on an H100 13 ms of a batch-4 call
        against fixed k = 1. A lean drafting call counts the acceptance its requests saw, not per
        draft position (the remembered profile stays as the full calls left it).

        Plain decoding:

        It does when the call would open on plain decoding and one of the last calls at the shape
        decoded plainly in one segment from its opening to its end, for requests no shorter, with
        fewer than LEAN_CALLS lean calls since. Such a call's device choices are that one's but for
        the step times: plain decoding observes no acceptance (the remembered acceptance the
        opening judges by is unchanged), and its plain segment's look-ahead (`policy.hold`) covered
        the whole call. The step times are corrected after every segment, a lean call's included,
        so a call is lean only while no drafting plan's corrected time has fallen against plain
        decoding's by more than LEAN_DRIFT since the qualifying call's opening: where they have,
        the device, judging by them, may now draft. (In a batch-1 benchmark run a goodput + TETRIS
        decoder decoded plainly for three whole calls after a plain trial, the last two of them
        lean, each taking 1.5-2.0x its round's fixed k = 4 call; its drafting calls took 0.9-1.2x.)
        A uniform drift of every plan moves only the switch's fixed costs against the steps'
        (the drafter's prefill, a round trip: a few percent of a call), so it is let pass. Every
        LEAN_CALLS + 1-th call lets the device choose again. Timing trials and ties come due as
        before (the call's opening checks them on the host first, `opening_trial`)."""
        streak = self.lean.get(shape_key)
        if streak is None or streak.plan != plan_index or streak.calls >= LEAN_CALLS or longest > streak.longest:
            return False
        if schedule.predict_ks[plan_index] != 0:
            program = self.lean_programs.get(program_key)
            if tokens_j is None or program is None or not program.done() or program.exception() is not None:
                return False
            goodput_j = np.asarray(tokens_j(), np.float64) / np.asarray(seconds_j(), np.float64)
            return bool(goodput_j[plan_index] * (1.0 + policy_lib.SWITCH_MARGIN) >= goodput_j.max())
        moved_j = np.asarray(ratio_j, np.float64) / streak.ratio_j
        drafting = np.asarray(schedule.predict_ks) > 0
        return bool(np.all(moved_j[drafting] * (1.0 + LEAN_DRIFT) >= moved_j[plan_index]))

    def opening_trial(self, schedule: Schedule, tracker: cost_lib.StepTimeTracker, guess: int, seed: np.ndarray,
                      remaining_r: np.ndarray, drains: bool) -> tuple[int | None, bool]:
        """A timing trial to open the call with (`StepTimeTracker.explore`), or None; and whether
        it runs a whole segment: a plan tied with the guess (`StepTimeTracker.retime_tie`), not
        a trial of TRIAL_STEPS steps charged to the trial budget.

        Trials are otherwise proposed between segments, and a call that runs one segment (plain
        decoding, or one draft length, all the way) has none: a ranking of near-tied plans that
        the warm-up's timing got wrong then stood for every later call at the shape (in one batch-4
        diagnostic, 15 calls in a row decoded plainly where fixed k = 1 ran 7% faster). Judged on the
        acceptance the decoder remembers (`seed`, `AcceptanceMemory.seed`), against the plan the
        call is expected to open on.

        Most calls have no plan in doubt, none due for re-timing and no tie due; they return before
        any expected tokens are counted (0.5 ms of host time a call at batch 1 on XLA:CPU, while
        the device waits for the call's first dispatch)."""
        if not tracker.segments or not (tracker.in_doubt(guess) or tracker.tie_due(guess, TIE_RETIME)):
            return None, False
        tokens_j = self.opening_tokens(schedule, seed, remaining_r, drain=False)
        trial = tracker.explore(guess, tokens_j, baseline=schedule.predict_ks.index(0), steps=TRIAL_STEPS)
        if trial is not None:
            return trial, False
        if not tracker.tie_due(guess, TIE_RETIME):   # spares most calls the drain count below
            return None, False
        if drains:
            # A tie needs the drain count unless even bounds rule it out: drafting plans at most
            # (a plain guess) or at least (a drafting guess) what the count could give them.
            bound = _drain_bound if schedule.predict_ks[guess] == 0 else _drain_floor
            if tracker.retime_tie(guess, bound(tokens_j, remaining_r, schedule.predict_ks),
                                  margin=policy_lib.SWITCH_MARGIN, segments=TIE_RETIME) is None:
                return None, False   # no tie even at the bounds: the count is spared
            # A tie is judged as the device will judge it (by when the slowest row is done): judged
            # by one step's tokens, at batch 16 drafting plans came within the margin of plain
            # decoding, and the device left them after 4 steps in most calls (a round trip each).
            tokens_j = self.opening_tokens(schedule, seed, remaining_r, drain=True)
        tie = tracker.retime_tie(guess, tokens_j, margin=policy_lib.SWITCH_MARGIN, segments=TIE_RETIME)
        return tie, tie is not None

    def opening_tokens(self, schedule: Schedule, seed: np.ndarray, remaining_r: np.ndarray,
                       drain: bool) -> np.ndarray:
        """Each plan's tokens per step at a call's opening, every row at the remembered acceptance
        (`seed`, `AcceptanceMemory.seed`): one step's expected tokens, or with `drain`, what the
        plan is worth until the slowest of rows with `remaining_r` tokens to go is done
        (`policy.drain_tokens_per_step`). A pure function of its inputs, and they repeat: a call
        that decodes plainly leaves the remembered acceptance as it was, and a batch job's calls
        ask for the same lengths. So each is counted once: the drain count cost 0.8 ms of host
        time a call at batch 16 of the tiny-8L pair (16 tokens), while the device waited for the
        call's first dispatch, and 33 of 40 such calls needed it."""
        key = (drain, schedule.predict_ks, seed.tobytes(), remaining_r.astype(np.int64).tobytes())
        tokens_j = self.opening_memo.get(key)
        if tokens_j is None:
            if len(self.opening_memo) >= OPENING_MEMO_SIZE:
                self.opening_memo.clear()
            alpha_r = np.full(remaining_r.shape, seed[0])
            profile = seed[4:] if schedule.positions else None
            if drain:
                tokens_j = policy_lib.drain_tokens_per_step(alpha_r, np.ones(alpha_r.shape, bool), remaining_r,
                                                            schedule.predict_ks, xp=np, spread=float(seed[3]),
                                                            profile=profile)
            else:
                tokens_j = _expected_tokens(alpha_r, schedule.predict_ks, profile)
            tokens_j.setflags(write=False)   # shared by the calls that ask again
            self.opening_memo[key] = tokens_j
        return tokens_j

    def plan_segment(self, schedule: Schedule, tracker: cost_lib.StepTimeTracker, policy, done_b, remaining_b,
                     drains: bool, trial, plan_index: int, incumbent: int) -> tuple[int, int, int | None, int]:
        """The next segment's plan, its hold (`policy.hold`), whether it is a timing trial
        (`StepTimeTracker.explore`) and the plan it stands in for if so (else the plan itself),
        from the policy state the device left (read on the host)."""
        choice, hold = int(policy.choice), int(policy.hold)
        decide_here = trial is not None
        if not decide_here and not tracker.in_doubt(choice):
            return choice, hold, None, choice
        alpha_b, profile = np.asarray(policy.alpha_b()), policy.profile_p(xp=np)
        if drains:
            tokens_j = policy_lib.drain_tokens_per_step(alpha_b, ~done_b, remaining_b, schedule.predict_ks, xp=np,
                                                        spread=float(policy.spread), profile=profile)
        else:
            tokens_j = _expected_tokens(alpha_b[~done_b], schedule.predict_ks, profile)
        if decide_here and tokens_j.size:
            # A trial was just measured: decide on the measurement now. The device chose with the
            # step times from before it: after a trial of k = 1 at batch 16 (where plain decoding
            # was best), running its choice went k = 3, 2, 4, 5, 4 steps each, then k = 1 again.
            # (Deciding here did not stop that: in the next run the host chose k = 2 after such
            # a trial and the device went on to k = 3 and 4.)
            choice = _after_trial(schedule, policy, tokens_j, tracker.corrected(), ~done_b, remaining_b, incumbent)
        trial = tracker.explore(choice, tokens_j, baseline=schedule.predict_ks.index(0), steps=TRIAL_STEPS)
        return (choice if trial is None else trial), hold, trial, choice

    def warm_up(self, schedule: Schedule, rows_in, eos_t, budget_t, predicted, static, put) -> Warm:
        """Goodput: compiles every plan's program and runs it on a scratch state prefilled with
        this call's first rows; times a segment's round trip there and, with
        `spec.measure_plans`, each plan's steps; compiles and times a lean call's program
        (`plain_call_on_device`) on rows of one token. Once per decoder and shape.

        Running, not only compiling: a compiled program's first steps ran slowly (on XLA:CPU,
        150 ms over 4 steps of 10 ms), which stalled a run where a plan was first chosen mid-run.
        Timing the plans: a cost model fitted across shapes misses single shapes by up to 15-25%
        (its worst held-out error), more than the goodput gap between neighbouring draft lengths
        at small batches, where the profile alone made the policy run k = 2-3 where k = 1 was
        best. A few steps at the run's own shape rank the plans. The passes go round the plans in
        turn, so a slow moment of a shared machine does not fall on one plan only, and each plan
        keeps the median of its passes: the fastest of two passes (the rule before) under-predicted
        the run's steps by up to 10%, and a drafting plan's first pass ran up to 1.5x slower than
        its later ones, which the median of three or more passes ignores. The round trip (a call
        that runs no step, and the fetch of its outputs; about 2 ms on XLA:CPU, `ROUND_TRIPS`) is
        taken out of every timed segment: it would otherwise add a third of a step to each step of
        a 4-step segment at batch 1, and make short segments' plans look slower than long ones'.
        """
        graphdef, params, dparams = self.target.graphdef, self.target.params, self.drafter.params
        max_new_b, keys_b = rows_in[2], rows_in[3]
        no_stop, seconds = put(np.int32(0)), put(as_arrays(predicted))
        # Arguments of the run's own kinds, so the run reuses these compiled programs.
        acceptance, draining, follow, next_choice = put((self.acceptance.seed(schedule.positions), np.bool_(True),
                                                         np.bool_(False), np.int32(-1)))

        max_new_host = np.asarray(max_new_b)
        # A lean call's program (`lean_call`) is timed on rows of 1 token (no step): what a lean
        # call costs besides its steps, its prefill and fetch.
        one_b = put(np.minimum(max_new_host, 1))
        start_args = (graphdef, self.drafter, schedule, self.sampling, params, dparams, *rows_in, eos_t, seconds,
                      next_choice, acceptance, draining)
        lean_args = (graphdef, self.sampling, params, rows_in[0], rows_in[1], one_b, keys_b, eos_t)

        def run_args(state, steps: int) -> tuple:
            return (graphdef, self.drafter, schedule, self.sampling, params, dparams, state, keys_b, max_new_b, eos_t,
                    budget_t, seconds, no_stop, put(np.int32(steps)), draining, follow)

        def timed(state, plan_index: int, steps: int):
            """The state after `steps` more steps of a plan, the steps run so far, the call's
            seconds (fetch included) and the tokens the longest-running row has left."""
            start = time.perf_counter()
            state = loop.run_on_device(*run_args(state, steps), **static, plan_index=plan_index)
            done_b, _, n_out_b, _, ran, *_ = loop.segment_outputs(state)
            elapsed = time.perf_counter() - start
            room = int(np.max(np.where(done_b, 0, max_new_host - n_out_b), initial=0))
            return state, int(ran), elapsed, room

        def opened():
            return loop.start_on_device(*start_args, **static)

        def lean_opened():
            start = time.perf_counter()
            jax.device_get(loop.plain_call_on_device(*lean_args, **static))
            return time.perf_counter() - start

        # The programs are compiled side by side before they first run (`loop.compile_ahead`).
        loop.compile_ahead([(loop.start_on_device, start_args, static), (loop.plain_call_on_device, lean_args, static)])
        scratch = jax.block_until_ready(opened())
        loop.compile_ahead([(loop.run_on_device, run_args(scratch, 1), dict(static, plan_index=i))
                            for i in range(len(schedule.plans))])
        lean_opened()   # its first run
        lean_opening = float(np.median([lean_opened() for _ in range(3)]))
        starts = []
        for _ in range(3):   # what a run's opening costs (prefill, first plan), fetch included
            start = time.perf_counter()
            jax.tree.map(np.asarray, opened().policy)
            starts.append(time.perf_counter() - start)

        def fresh(i: int):
            # The prefilled rows after plan i's first step, untimed: a drafter whose prefill the
            # opening deferred catches up on the prompts there.
            return timed(jax.tree.map(jnp.copy, scratch), i, 1)

        runs = [fresh(i) for i in range(len(schedule.plans))]
        states, steps_j, rooms_j = [r[0] for r in runs], [r[1] for r in runs], [r[3] for r in runs]
        trips = []
        for n in range(ROUND_TRIPS):
            i = n % len(states)
            states[i], _, elapsed, _ = timed(states[i], i, 0)
            trips.append(elapsed)
        round_trip = float(np.median(trips))
        position = self.position_seconds(rows_in[0], rows_in[1], static["cache_len"])
        if not self.spec.measure_plans:
            return Warm(None, round_trip, _acceptance_seen(schedule, states), position, float(np.median(starts)),
                        lean_opening_seconds=lean_opening)
        # A pass (a 1-step call and a longer one) must fit in the tokens of fresh rows after their
        # first step, even where every step emits k + 1 tokens.
        cap_j = np.array([np.clip(static["out_len"] // (plan.k + 1) - 2, 1, MEASURE_STEPS) for plan in schedule.plans])
        pass_steps_j = np.clip(np.ceil(MEASURE_PASS_SECONDS / np.maximum(predicted["plans"], 1e-6)), 2, cap_j)
        passes_j: list[list[float]] = [[] for _ in states]
        sized_j = np.zeros(len(states), bool)   # whether a plan's passes are sized by its own timing
        retired: list[tuple] = []   # (plan, counters) of states replaced by fresh rows
        entries: list[float] = []   # a segment's seconds besides its steps, as the 1-step calls saw it
        start = time.perf_counter()
        for n in range(MEASURE_MAX_PASSES):
            if n >= MEASURE_PASSES and time.perf_counter() - start > MEASURE_SECONDS:
                break
            for i, plan in enumerate(schedule.plans):
                if rooms_j[i] < (1 + pass_steps_j[i]) * (plan.k + 1):
                    retired.append((i, states[i].counters))
                    states[i], steps_j[i], _, rooms_j[i] = fresh(i)
            # Every plan's 1-step call first, then every plan's longer call: each call follows
            # another plan's program, as a run's segment mostly does. (A plan's longer call right
            # after its own 1-step call ran faster than one after another program: the difference
            # then timed k = 1 at a fifth of its step at batch 1 on the tiny test pair.)
            ones = []
            for i, state in enumerate(states):
                states[i], one, one_elapsed, _ = timed(state, i, 1)
                ones.append((one, one_elapsed))
            for i, (state, (one, one_elapsed)) in enumerate(zip(states, ones)):
                states[i], steps, elapsed, rooms_j[i] = timed(state, i, int(pass_steps_j[i]))
                if one > steps_j[i] and steps - one >= 2:
                    # A step's time is the difference of the two calls over the steps the longer one
                    # added: what a call costs besides its steps (see MEASURE_STEPS) cancels out.
                    step = (elapsed - one_elapsed) / (steps - one - 1)
                    if step > 0:
                        passes_j[i].append(step)
                        entries.append(one_elapsed - step)
                    else:
                        # The steps were lost in the two calls' jitter: longer passes. Sized on the
                        # first pass only, a plan whose first pass timed nothing kept the cost
                        # model's 2 steps for good: the tiny test pair's 0.1 ms plain step, under a
                        # cost model 1000x too slow, came out 0.01-0.27 ms.
                        pass_steps_j[i] = min(2 * pass_steps_j[i], cap_j[i])
                elif steps > steps_j[i]:   # rows ran out: the plain round trip comes off instead
                    passes_j[i].append(cost_lib.steps_seconds(elapsed + one_elapsed, 2 * round_trip)
                                       / (steps - steps_j[i]))
                if passes_j[i] and not sized_j[i]:   # sized by the plan's first timing, not the cost model's guess
                    pass_steps_j[i] = np.clip(np.ceil(MEASURE_PASS_SECONDS / max(passes_j[i][0], 1e-6)), 2, cap_j[i])
                    sized_j[i] = True
                steps_j[i] = steps
        if entries:
            round_trip = max(round_trip, float(np.median(entries)))
        return Warm(np.array([np.median(p) if p else np.nan for p in passes_j]), round_trip,
                    _acceptance_seen(schedule, states, retired), position, float(np.median(starts)),
                    lean_opening_seconds=lean_opening)

    def position_seconds(self, tokens_bp, prompt_len_b, cache_len: int) -> float:
        """Goodput warm-up: the drafter's seconds per position fed, from its prefill of this call's
        first rows (median of 3 after a compiling run) over their padded width. Drafting from a
        run's start costs that prefill; drafting after plain steps costs a catch-up over the
        positions missed (`policy.draft_entry_seconds`)."""
        init = jax.jit(functools.partial(self.drafter.init, cache_len=cache_len))
        jax.block_until_ready(init(self.drafter.params, tokens_bp, prompt_len_b))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(init(self.drafter.params, tokens_bp, prompt_len_b))
            times.append(time.perf_counter() - start)
        return float(np.median(times)) / tokens_bp.shape[1]

    def predicted_seconds(self, schedule: Schedule, rows: int, cache_len: int) -> dict[str, np.ndarray]:
        """The cost model's step time for each compiled branch and each TETRIS budget, computed
        here once per call and passed in traced (a new cost model does not recompile)."""
        cost, spec = self.spec.cost_model, self.spec
        plans = schedule.plans if schedule.predict_ks is not None else ()
        caps = () if schedule.tetris_index is None else schedule.plans[schedule.tetris_index].capacities
        # Measured at warm-up (0 until then): "round_trip", a segment's seconds besides its steps;
        # "position", the drafter's seconds per position fed to catch up (`policy.draft_entry_seconds`).
        measured = {"round_trip": np.float32(0.0), "position": np.float32(0.0)}
        if cost is None:
            return {"plans": np.ones((len(plans),), np.float32), "capacities": np.ones((len(caps),), np.float32),
                    **measured}
        plan_seconds = []
        for plan, k in zip(plans, schedule.predict_ks or ()):
            if plan.capacities is None:
                plan_seconds.append(cost.step_seconds(rows, plan.k, cache_len))
            else:
                # TETRIS drafting on: k + extra draft positions, the standard budget N * k packed.
                plan_seconds.append(cost.step_seconds(rows, plan.k, cache_len, packed_tokens=rows * (k + 1),
                                                      window=plan.k + 1))
        cap_seconds = [cost.step_seconds(rows, spec.draft_len, cache_len, packed_tokens=rows + c,
                                         window=spec.draft_len + 1) for c in caps]
        return {"plans": np.asarray(plan_seconds, np.float32), "capacities": np.asarray(cap_seconds, np.float32),
                **measured}


def _acceptance_seen(schedule: Schedule, states, retired=()) -> tuple | None:
    """The acceptance counts of the warm-up's drafting plans on the call's own rows, the plans'
    rows side by side: every trial they made (`Counters.accepted` / `tried`), in `states` and in
    the states retired before them (`retired`: pairs of plan index and `Counters`).

    The decayed counts of the policy (about the last ten trials a row) were the rule before: they
    hold whatever stretch of text each plan's rows had reached when the warm-up stopped, and how
    far they got depends on how many passes the machine's speed allowed. At batch 1 of the
    tiny-8L pair the same prompt gave 0.755 after 3 passes and 0.866 after 8; the low one had
    the next calls decode plainly until a tie was re-timed."""
    pairs = [*retired, *((i, state.counters) for i, state in enumerate(states))]
    drafting = [(c.accepted, c.tried) for i, c in pairs if schedule.plans[i].k > 0]
    if not drafting:
        return None
    drafting = jax.device_get(drafting)   # one read for all of them
    return tuple(np.concatenate(parts).astype(np.float32) for parts in zip(*drafting))


def segment_log(schedule: Schedule, tracker: cost_lib.StepTimeTracker) -> list[tuple]:
    """A call's segments, for its stats: (draft length, steps, predicted and measured seconds per step)."""
    return [(schedule.plans[j].k, n, p, m) for j, n, p, m in tracker.history]


def scaled(predicted: dict[str, np.ndarray], ratio_j: np.ndarray, schedule: Schedule) -> dict[str, np.ndarray]:
    """Predicted step times with each plan's scaled by `ratio_j`; a TETRIS plan's budgets follow
    that plan's ratio."""
    caps_ratio = 1.0 if schedule.tetris_index is None else ratio_j[schedule.tetris_index]
    return {**predicted, "plans": (predicted["plans"] * ratio_j).astype(np.float32),
            "capacities": (predicted["capacities"] * caps_ratio).astype(np.float32)}


def corrected(predicted: dict[str, np.ndarray], tracker: cost_lib.StepTimeTracker,
              schedule: Schedule) -> dict[str, np.ndarray]:
    """Predicted step times scaled by what the run has measured."""
    return scaled(predicted, tracker.ratio(), schedule)


def with_measured(predicted: dict[str, np.ndarray], measured_j: np.ndarray,
                  schedule: Schedule) -> dict[str, np.ndarray]:
    """The cost model's step times with each plan's replaced by its time measured at warm-up; a
    plan that ran no timed step keeps the model's time, scaled by the measured plans' overall
    ratio."""
    model_j = np.asarray(predicted["plans"], np.float64)
    measured_j = _drafting_line(np.asarray(measured_j, np.float64), schedule)
    ok = np.isfinite(measured_j)
    overall = measured_j[ok].sum() / model_j[ok].sum() if ok.any() else 1.0
    return scaled(predicted, np.where(ok, measured_j / model_j, overall), schedule)


def leanable(plan) -> bool:
    """Whether a drafting plan can run a lean call (`loop.drafting_call_on_device`): standard
    selection of fixed-length drafts (TETRIS and threshold drafting read the policy's calibration
    of draft confidence, which that program does not keep)."""
    return plan.k > 0 and plan.capacity is None and plan.capacities is None and plan.threshold is None


def _drafting_line(measured_j: np.ndarray, schedule: Schedule) -> np.ndarray:
    """The warm-up's times of the standard drafting plans (k >= 1) replaced by a least-squares line
    in k through them, where at least three were timed and the line rises; plain decoding and
    TETRIS plans keep their own times.

    At one compiled shape the cost model's step is affine in k for k >= 1 (k draft positions, a
    verification of k + 1 tokens per row, the speculation terms), so the line keeps the model's
    form at the warm-up's level and averages each plan's timing noise over all of them. Timed one
    by one, near-tied plans were ranked by their noise: at batch 1 of the tiny-8L pair one
    warm-up timed k = 1..6 at 1.24 / 1.73 / 1.64 / 1.95 / 2.11 / 2.26 ms, k = 3 below k = 2, and
    the policy ran k = 3 in 15 of 16 calls where fixed k = 3 ran 0.943 of the best fixed k (4);
    through the line, k = 4 ranks first."""
    ks = np.asarray([plan.k for plan in schedule.plans])
    fit = np.isfinite(measured_j) & (ks > 0) & np.asarray([plan.capacity is None for plan in schedule.plans])
    if len(set(ks[fit].tolist())) < 3:
        return measured_j
    slope, intercept = np.polyfit(ks[fit].astype(np.float64), measured_j[fit], 1)
    if slope <= 0:   # noise swamped the line: keep the timings
        return measured_j
    return np.where(fit, intercept + slope * ks, measured_j)


def _after_trial(schedule: Schedule, policy, tokens_j, seconds_j, live_b, remaining_b, incumbent: int) -> int:
    """The plan to run after a timing trial: the best by predicted goodput (`tokens_j` over the
    corrected step times `seconds_j`) if it beats the plan the trial stood in for, `incumbent`, by
    the margin a switch on device needs (`policy.choose_k`), else the incumbent; a stop is judged
    on the rows' acceptance over their remaining tokens, as on device (`policy._stopping_judged_ahead`).

    A trial is one noisy sample against plans measured over many steps, and the argmax it replaced
    took near-ties on it: at batch 1 of the tiny-8L pair, where plain decoding ran 0.82-0.88 of
    fixed k = 5, a 16-step trial of k = 4 on a row whose acceptance estimate had dipped
    to 0.78 (0.84 over whole calls) turned plain decoding on for the call's last 49 tokens."""
    goodput_j = np.asarray(tokens_j, np.float64) / np.asarray(seconds_j, np.float64)
    drafting_j = np.asarray(schedule.predict_ks) > 0
    if drafting_j.any() and not drafting_j.all():
        profile = policy.profile_p(xp=np)
        ahead_j = _expected_tokens(np.asarray(policy.forecast_alpha_b(remaining_b, xp=np))[live_b], schedule.predict_ks,
                                   profile)
        recent_j = _expected_tokens(np.asarray(policy.alpha_b())[live_b], schedule.predict_ks, profile)
        factor = min(1.0, np.max((recent_j / seconds_j)[drafting_j]) / max(np.max((ahead_j / seconds_j)[drafting_j]),
                                                                           1e-30))
        goodput_j = np.where(drafting_j, goodput_j, goodput_j * factor)
    best = int(np.argmax(goodput_j))
    margin = float(policy_lib.switch_margin(policy, xp=np))
    return best if goodput_j[best] > (1.0 + margin) * goodput_j[incumbent] else incumbent


def _expected_tokens(alpha_r: np.ndarray, ks, profile=None) -> np.ndarray:
    """Host twin of `policy.goodput_of_ks`' numerator (numpy: no device dispatch between segments);
    `profile` as in `policy.expected_tokens`."""
    return np.sum(policy_lib.expected_tokens(alpha_r, ks, profile, xp=np), axis=1)


# Slack on `_drain_bound`'s and `_drain_floor`'s drafting rates, for the drain count's numerical integration.
DRAIN_BOUND_SLACK = 1.01


def _drain_bound(tokens_j: np.ndarray, remaining_r: np.ndarray, ks) -> np.ndarray:
    """Per plan, the drain rule's tokens per step (`policy.drain_tokens_per_step`) or more, without
    its count: plain decoding's exactly (the remaining tokens over the largest, its steps), each
    drafting plan's at most its expected tokens per step `tokens_j` (the rows' expected tokens per
    step, summed): E[max_i S_i] >= max_i E[S_i] >= max_i r_i / mu, so sum r / E[max S] <= n mu.
    The count costs about 0.3 ms of host time at batch 4; a plain call's opening needs it only
    when a drafting plan could tie."""
    remaining_r = np.asarray(remaining_r, np.float64)
    bound_j = np.asarray(tokens_j, np.float64) * DRAIN_BOUND_SLACK
    plain = np.asarray(ks) == 0
    bound_j[plain] = remaining_r.sum() / max(remaining_r.max(initial=0.0), 1.0)
    return bound_j


def _drain_floor(tokens_j: np.ndarray, remaining_r: np.ndarray, ks) -> np.ndarray:
    """Per plan, the drain rule's tokens per step (`policy.drain_tokens_per_step`) or less, without
    its count: plain decoding's exactly, each drafting plan's at least n mu R / (R + n k) / n
    (`tokens_j` = n mu, the n rows' expected tokens per step; R, their remaining tokens). A row
    done after S steps has emitted at most r + k tokens, so by Wald's identity E[S] <= (r + k) / mu,
    and E[max_i S_i] <= sum_i E[S_i]. Tight for one row (within k / r), where a drafting call at
    batch 1 otherwise counted the drain steps on the host before every call (0.5 ms on XLA:CPU) to
    find that plain decoding does not tie with it; loose for many rows."""
    remaining_r = np.asarray(remaining_r, np.float64)
    rows, total = max(remaining_r.size, 1), remaining_r.sum()
    ks_j = np.asarray(ks, np.float64)
    floor_j = np.asarray(tokens_j, np.float64) / rows * total / np.maximum(total + rows * ks_j, 1e-9)
    floor_j /= DRAIN_BOUND_SLACK
    plain = ks_j == 0
    floor_j[plain] = total / max(remaining_r.max(initial=0.0), 1.0)
    return floor_j


def as_arrays(seconds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.asarray(v, np.float32) for name, v in seconds.items()}
