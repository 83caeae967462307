"""`SpeculativeDecoder`: batched speculative decoding of a target model with a drafter.

A call validates and buckets the prompts, fills a fixed number of slots (continuous batching
refills a finished row from the queue) and runs the loop programs of `jaxspec.engine.loop`: one
call of `run_on_device` under a fixed policy, a segment at a time under the goodput policy (the
host's side of which is `jaxspec.engine.control`), or the two-slice engine of
`jaxspec.parallel.pipeline` when draft and target live on separate device slices.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from jaxspec import batching, tetris
from jaxspec import prompts as prompts_lib
from jaxspec.cost import StepTimeTracker
from jaxspec.drafters import Drafter, ModelDrafter, NgramDrafter
from jaxspec.engine import loop
from jaxspec.engine.control import (
    FIRST_SEGMENT_CAP,
    MAX_SEGMENT_CAP,
    TRIAL_STEPS,
    GoodputControl,
    Warm,
    as_arrays,
    corrected,
    scaled,
    segment_log,
)
from jaxspec.engine.loop import Schedule, cache_length, prefill_schedule, put_rows
from jaxspec.engine.step import Counters, StepPlan
from jaxspec.generate import check_eos, request_keys
from jaxspec.models.model import Model
from jaxspec.parallel import sharding as sharding_lib
from jaxspec.parallel.mesh import MeshConfig
from jaxspec.results import GenerationResult, GenerationStats, decode_texts
from jaxspec.sampling import SamplingConfig
from jaxspec.spec import SpecConfig


def _on_host(tree):
    """`put` on one device: values stay on the host until a compiled call takes them."""
    return tree


class SpeculativeDecoder:
    """Batched speculative decoding of a target model with a drafter.

    Args:
      target: the jaxspec.Model whose distribution the output follows exactly.
      draft: a smaller Model with the same vocabulary, a drafter such as
        `jaxspec.NgramDrafter(max_ngram=3)`, or another SpeculativeDecoder (a multi-level chain).
      spec: SpecConfig (k, selection, policy, ...).
      sampling: SamplingConfig used by target and draft alike.
      mesh: a `jaxspec.MeshConfig`: the target sharded over its (data, tensor) mesh and the draft
        on its own slice (or on the target's mesh when draft_tp=0). None: the default device.
    """

    def __init__(self, target: Model, draft, spec: SpecConfig | None = None,
                 sampling: SamplingConfig | None = None, mesh=None):
        self.spec = spec if spec is not None else SpecConfig()
        self.sampling = sampling if sampling is not None else SamplingConfig()
        if not isinstance(self.spec, SpecConfig):
            raise ValueError(f"spec must be a jaxspec.SpecConfig, got {type(self.spec).__name__}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(f"sampling must be a jaxspec.SamplingConfig, got {type(self.sampling).__name__}")
        if not isinstance(target, Model):
            raise ValueError(f"target must be a jaxspec.Model, got {type(target).__name__}")
        if mesh is not None and not isinstance(mesh, MeshConfig):
            raise ValueError(f"mesh must be None or a jaxspec.MeshConfig, got {type(mesh).__name__}")
        self.mesh = mesh
        self._sliced = self.spec.pipeline or (mesh is not None and mesh.separate_draft)
        if mesh is not None:
            if isinstance(draft, SpeculativeDecoder):
                raise ValueError("a multi-level chain draft cannot be placed on a MeshConfig yet; pass mesh=None")
            mesh.check(target.config, draft.config if isinstance(draft, Model) else None)
            self._target_mesh, self._draft_mesh = mesh.target_mesh(), mesh.draft_mesh()
            target = sharding_lib.place_params(target, self._target_mesh)
            if isinstance(draft, Model):
                draft = sharding_lib.place_params(draft, self._draft_mesh)
        elif self._sliced:
            self._target_mesh = self._draft_mesh = MeshConfig(target_tp=1, draft_tp=0).target_mesh()
        else:
            self._target_mesh = self._draft_mesh = None
        self.target = target
        self.drafter = _as_drafter(draft, target.config.vocab_size, self.spec)
        self.draft = draft
        # Two-slice engines only: set to {"draft": [], "verify": []} to record the seconds of each
        # draft and verify call, each timed alone (blocking: no overlap; for measurements).
        self.phase_timings: dict[str, list[float]] | None = None
        # Goodput: what the decoder measures and decides on the host, kept between calls.
        self._goodput = GoodputControl(self.target, self.drafter, self.sampling, self.spec, self._target_mesh)
        # Goodput on two slices: what was measured per (lane rows, cache length, pipelined), kept between calls.
        self._slice_timings: dict = {}

    def __repr__(self):
        return f"SpeculativeDecoder(target={self.target!r}, draft={self.draft!r}, spec={self.spec!r})"

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size

    def generate(self, prompts, max_new_tokens=64, seed: int = 0, eos_token_id: int | None = None,
                 batch_size: int | None = None, on_finish=None, request_ids=None) -> GenerationResult:
        """Speculative generation; same arguments and result as `jaxspec.generate`.

        Args:
          batch_size: rows decoded at once (slots). None: every prompt at once. With more prompts
            than slots, a finished row is refilled with the next queued prompt (continuous
            batching); each request's output is the same as generating it alone.
          on_finish: called on the host as `on_finish(index, tokens, counters)` as soon as the
            request at `prompts[index]` finishes (counters: its row_steps, drafted, verified,
            accepted and emitted). The loop then returns to the host once per finished request
            (not per token), so a batch job can save each result as it comes.
          request_ids: distinct ints naming each prompt's RNG stream (default: its index), as in
            `jaxspec.generate`.
        """
        cfg, k = self.target.config, self.spec.draft_len
        eos = check_eos(eos_token_id, cfg.vocab_size)
        batch = prompts_lib.prepare(prompts, self.target.tokenizer, vocab_size=cfg.vocab_size,
                                    max_positions=cfg.max_position_embeddings, max_new_tokens=max_new_tokens,
                                    request_ids=request_ids)
        cache_len = cache_length(batch.tokens_bp.shape[1], batch.out_len, int(np.max(batch.max_new_b)), k)
        if self._sliced:
            return self._generate_sliced(batch, seed, eos, cache_len, batch_size, on_finish)
        multiple = self.mesh.target_dp if self.mesh is not None else 1
        slots = prompts_lib.bucket_batch(batching.check_batch_size(batch_size, batch.num_prompts))
        slots = -(-slots // multiple) * multiple
        queue = batching.RequestQueue(batch, on_finish=on_finish)
        table = batching.SlotTable(queue, slots, multiple)
        first = table.first_batch(queue.pop(slots))
        schedule, budget = self._schedule(slots, first.num_prompts, cache_len)
        goodput = schedule.predict_ks is not None
        predicted = self._goodput.predicted_seconds(schedule, slots, cache_len)
        static = dict(cache_len=cache_len, seq_len=cache_len, out_len=batch.out_len, mesh=self._target_mesh)
        graphdef, params, dparams = self.target.graphdef, self.target.params, self.drafter.params
        # On a mesh host values are placed replicated. On one device they go to the compiled calls
        # as numpy arrays: jit's own transfer of a few small arrays costs microseconds, where an
        # eager `jax.device_put` of them cost 0.1-0.4 ms of host time each (tiny-8L pair, XLA:CPU),
        # before the prefill and after each segment, while the device sits idle.
        put = (functools.partial(sharding_lib.put, sharding=sharding_lib.replicated(self._target_mesh))
               if self._target_mesh is not None else _on_host)
        keys_b = request_keys(seed, first.request_ids_b)
        *rows_in, eos_t, budget_t = put((first.tokens_bp, first.lengths_b, first.max_new_b, keys_b, np.int32(eos),
                                         np.int32(budget)))
        tracker = None
        if goodput:
            shape_key = (slots, cache_len, batch.out_len, schedule)
            control = self._goodput
            warm, tracker = control.prepare(shape_key, schedule, rows_in, eos_t, budget_t, predicted, static, put)
            predicted = warm.predicted
            # Goodput: the first segment is queued behind the prefill on a guess of the opening plan
            # (the last call's at this shape; `follow` below); on XLA:CPU waiting for the device's
            # choice first cost 1-1.5 ms a call, 2% of a 96-token call at batch 1. A wrong guess runs
            # no step and costs what that wait did. A call that opens on a timing trial runs the
            # trial's plan instead (the drafter prefilled if it drafts), timed once the prefill is done.
            plan_index = control.openings.get(shape_key, schedule.predict_ks.index(0))
            remembered = control.acceptance.seed(schedule.positions)   # (alpha, weight, evidence, spread, profile...)
            trial, whole = control.opening_trial(schedule, tracker, plan_index, remembered,
                                                 np.asarray(first.max_new_b)[:first.num_prompts], not len(queue))
            incumbent = plan_index   # what a trial stands in for (`control._after_trial`)
            plan_index = plan_index if trial is None else trial
            opening_trial = trial
            longest = int(np.max(np.asarray(first.max_new_b)[:first.num_prompts]))
            opening_ratio_j = tracker.ratio()
            lean_key = (shape_key, plan_index, first.tokens_bp.shape)
            remaining_r = np.asarray(first.max_new_b)[:first.num_prompts]
            if trial is None and on_finish is None and not len(queue) and control.lean_call(
                    shape_key, schedule, plan_index, longest, opening_ratio_j,
                    lambda: control.opening_tokens(schedule, remembered, remaining_r, drain=False),
                    tracker.corrected, lean_key):
                return self._generate_lean(schedule, shape_key, tracker, warm, plan_index, batch, queue, table,
                                           rows_in, eos_t, static, slots)
            # The acceptance last measured seeds the rows; whether requests wait for slots.
            seconds, next_choice, acceptance, draining = put((
                as_arrays(scaled(predicted, opening_ratio_j, schedule)), np.int32(-1 if trial is None else trial),
                remembered, np.bool_(not len(queue))))
        else:
            seconds, next_choice, acceptance, draining = put(as_arrays(predicted)), None, None, None
            plan_index, trial, whole = 0, None, False
        start = time.perf_counter()
        state = loop.start_on_device(graphdef, self.drafter, prefill_schedule(schedule), self.sampling, params, dparams,
                                     *rows_in, eos_t, seconds, next_choice, acceptance, draining, **static)
        max_new_b, keys_b = rows_in[2], rows_in[3]
        opening = goodput and trial is None
        if trial is not None:
            jax.block_until_ready(state)
        hold = 0
        no_cap = put(np.int32(batch.out_len + 1))
        step_ks: list[int] = []
        segment_cap = (FIRST_SEGMENT_CAP if goodput and warm.plan_seconds is None and not tracker.segments
                       else MAX_SEGMENT_CAP)
        while True:
            # With requests waiting (or a caller waiting for each result), stop as soon as one
            # more row is done, to refill it or hand it over.
            stop = 1 if len(queue) or (on_finish is not None and table.active > 1) else 0
            # A plain segment runs until the policy would probe speculation again
            # (`policy.plain_horizon`): no round trips in between.
            plain = goodput and trial is None and schedule.plans[plan_index].k == 0 and hold > 0
            drains = not len(queue)
            segment_start = time.perf_counter()
            if goodput:
                steps_cap = hold if plain else (TRIAL_STEPS if trial is not None and not whole else segment_cap)
                flags = put((np.int32(stop), np.int32(steps_cap), np.bool_(drains),
                             np.bool_(opening)))
            else:
                flags = (put(np.int32(stop)), no_cap, None, None)
            state = loop.run_on_device(graphdef, self.drafter, schedule, self.sampling, params, dparams, state, keys_b,
                                       max_new_b, eos_t, budget_t, seconds, *flags, **static, plan_index=plan_index)
            done_b, out_bo, n_out_b, counters, steps, policy, max_new = loop.segment_outputs(state, max_new_b)
            segment_seconds = time.perf_counter() - segment_start
            segment_steps = int(steps) - len(step_ks)
            idle = bool(done_b.all())
            if opening:
                opening = False
                if segment_steps == 0 and not idle:   # the guess was wrong: run the device's choice
                    plan_index, hold = int(policy.choice), int(policy.hold)
                    control.openings[shape_key] = plan_index
                    continue
                control.openings[shape_key] = plan_index
                # Timed from the opening's dispatch: the segment started when the prefill ended.
                segment_seconds = time.perf_counter() - start - (warm.opening_seconds - warm.round_trip)
            step_ks += [schedule.plans[plan_index].k] * segment_steps
            if goodput:
                tracker.observe(plan_index, segment_steps, max(segment_seconds, 0.0),
                                trial=trial is not None and not whole)
                segment_cap, whole = MAX_SEGMENT_CAP, False
            if goodput and not idle:   # another segment follows: plan it
                seconds = put(as_arrays(corrected(predicted, tracker, schedule)))
                plan_index, hold, trial, incumbent = control.plan_segment(
                    schedule, tracker, policy, done_b, max_new - n_out_b, drains, trial, plan_index, incumbent)
            table.harvest(done_b, out_bo, n_out_b, counters)
            refill = table.refill()
            if refill is None:
                if table.active == 0 and not len(queue):
                    break
                continue
            slots_r, sub = refill
            keys_r = request_keys(seed, sub.request_ids_b)
            new_in = put((slots_r, sub.tokens_bp, sub.lengths_b, sub.max_new_b, keys_r))
            if goodput and idle:
                seconds = put(as_arrays(corrected(predicted, tracker, schedule)))
            state = loop.refill_on_device(graphdef, self.drafter, schedule, self.sampling, params, dparams, state,
                                          *new_in, eos_t, seconds, **static)
            max_new_b, keys_b = put_rows(max_new_b, new_in[0], new_in[3]), put_rows(keys_b, new_in[0], new_in[4])
            if goodput and idle:
                # Every row was done: the refilled rows opened on their own plan (the read also
                # waits for the refill, as below).
                policy, done_b, n_out_b, max_new = jax.device_get((state.policy, state.done_b, state.n_out_b,
                                                                   max_new_b))
                plan_index, hold, trial, incumbent = control.plan_segment(
                    schedule, tracker, policy, done_b, max_new - n_out_b, not len(queue), trial, plan_index,
                    incumbent)
            elif goodput:
                jax.block_until_ready(state)   # so the next segment's wall time is its steps alone
        seconds_taken = time.perf_counter() - start
        tokens = queue.results()
        stats = _stats(Counters(**queue.counters), batch.num_prompts, int(steps), seconds_taken, step_ks, self.drafter)
        stats.extra["slots"] = slots
        if goodput:
            control.finish_call(shape_key, schedule, tracker, opening_trial, longest, opening_ratio_j, policy,
                                queue.counters)
            lean_plan = control.lean_program_due(shape_key, schedule)
            if lean_plan is not None:
                control.compile_lean((shape_key, lean_plan, first.tokens_bp.shape), (
                    graphdef, self.drafter, schedule.plans[lean_plan], self.sampling, params, dparams, *rows_in,
                    eos_t), dict(static))
            stats.extra["segments"] = segment_log(schedule, tracker)
            # Per draft position p: how often the p-th draft was accepted when it was tried (None: never tried).
            stats.extra["acceptance_by_position"] = [float(a / t) if t > 0 else None for a, t in
                                                     zip(policy.pos_total_accepted_p, policy.pos_total_tried_p)]
        return GenerationResult(tokens=tokens, texts=decode_texts(self.target.tokenizer, tokens), stats=stats)

    def _generate_lean(self, schedule: Schedule, shape_key, tracker: StepTimeTracker, warm: Warm,
                       plan_index: int, batch, queue, table, rows_in, eos_t, static, slots: int) -> GenerationResult:
        """A goodput call of one plan throughout, in one program: plain decoding
        (`plain_call_on_device`) or a standard drafting plan (`drafting_call_on_device`)."""
        plan = schedule.plans[plan_index]
        graphdef, params = self.target.graphdef, self.target.params
        start = time.perf_counter()
        if plan.k == 0:
            outputs = loop.plain_call_on_device(graphdef, self.sampling, params, *rows_in, eos_t, **static)
        else:
            outputs = loop.drafting_call_on_device(graphdef, self.drafter, plan, self.sampling, params,
                                                   self.drafter.params, *rows_in, eos_t, **static)
        done_b, out_bo, n_out_b, counters, steps = jax.device_get(outputs)
        seconds_taken = time.perf_counter() - start
        steps = int(steps)
        # Timed from the dispatch, less what such a call costs besides its steps, plus the round trip
        # a segment's time holds. The general path's opening (`warm.opening_seconds`, the policy's
        # choice and conditionals in it) is dearer than this program's prefill: taken off instead,
        # it left no time at all for the steps of a 10-token call of the tiny test pair, and the
        # plain plan's corrected time went to zero. A drafting plan's prefill adds the drafter's, at
        # the rate the warm-up timed it (`Warm.position_seconds`). A call timed within the noise of
        # that estimate says nothing of its steps and is not folded in.
        opening = warm.lean_opening_seconds + (warm.position_seconds * rows_in[0].shape[1] if plan.k else 0.0)
        segment_seconds = seconds_taken - (opening - warm.round_trip)
        if segment_seconds > warm.round_trip:
            tracker.observe(plan_index, steps, segment_seconds)
        table.harvest(done_b, out_bo, n_out_b, counters)
        self._goodput.lean_called(shape_key)
        if plan.k:   # what its requests accepted seeds the next calls (per draft position: not counted)
            self._goodput.acceptance.remember_requests_of_call(queue.counters["accepted"], queue.counters["tried"])
        tokens = queue.results()
        stats = _stats(Counters(**queue.counters), batch.num_prompts, steps, seconds_taken, [plan.k] * steps,
                       self.drafter)
        stats.extra.update(slots=slots, lean=True,
                           segments=segment_log(schedule, tracker),
                           acceptance_by_position=[None] * schedule.positions)
        return GenerationResult(tokens=tokens, texts=decode_texts(self.target.tokenizer, tokens), stats=stats)

    def _generate_sliced(self, batch, seed: int, eos: int, cache_len: int, batch_size,
                         on_finish=None) -> GenerationResult:
        """Draft and target on two slices, stepped from the host; two pipelined batches if asked.

        Pipelined, the slots are split between two lanes that share one request queue; the first
        requests are split so both lanes start with equal work (MineDraft's assignment), and a
        lane refills its finished rows from the queue, so both stay full until it drains.
        """
        from jaxspec.parallel.pipeline import SlicedRunner, balanced_split
        n = batch.num_prompts
        multiple = self.mesh.target_dp if self.mesh is not None else 1
        slots_total = batching.check_batch_size(batch_size, n)
        queue = batching.RequestQueue(batch, on_finish=on_finish)
        first = queue.pop(slots_total)
        if self.spec.pipeline and n >= 2:
            halves = balanced_split(batch.max_new_b[first], len(first))
            groups = [[first[i] for i in h] for h in halves]
        else:
            groups = [first]
        rows = max(prompts_lib.bucket_batch(len(g)) for g in groups)   # one program for both lanes
        rows = -(-rows // multiple) * multiple
        tables = [batching.SlotTable(queue, rows, multiple) for _ in groups]
        lane_batches = [t.first_batch(g) for t, g in zip(tables, groups)]
        # Both lanes run one program, compiled for the larger lane's TETRIS capacity; each selects
        # its own budget inside it. Goodput: one program per plan, each lane choosing its own.
        schedule = self._schedule(rows, max(len(g) for g in groups), cache_len)[0]
        control = self._sliced_goodput(schedule, rows, cache_len, len(groups) == 2)
        runner = SlicedRunner(self.target, self.drafter, schedule.plans, self.sampling, self._target_mesh,
                              self._draft_mesh, goodput=control)
        runner.timings = self.phase_timings
        start = time.perf_counter()
        lanes = [runner.start(t, lb, seed, eos, cache_len, self._schedule(rows, len(g), cache_len)[1])
                 for t, lb, g in zip(tables, lane_batches, groups)]
        runner.run(lanes, eos)
        if control is not None and control.timing is not None:   # measured at this shape: kept for its next calls
            self._slice_timings[(rows, cache_len, len(groups) == 2)] = control.timing
        steps = sum(int(s) for s in jax.device_get([ln.state.steps for ln in lanes]))
        seconds = time.perf_counter() - start
        tokens = queue.results()
        step_ks = [schedule.plans[0].k] * steps if control is None else control.trace
        stats = _stats(Counters(**queue.counters), n, steps, seconds, step_ks, self.drafter)
        stats.extra["lanes"] = len(lanes)
        stats.extra["slots"] = rows * len(lanes)
        if control is not None:
            # What its requests accepted seeds the next calls' rows, and (one read of the lanes'
            # counts, after the run) the acceptance along the window.
            memory = self._goodput.acceptance
            drafted = memory.remember_requests_of_call(queue.counters["accepted"], queue.counters["tried"])
            if drafted and schedule.positions:
                for policy in jax.device_get([lane.policy for lane in lanes]):
                    memory.remember_positions(policy.pos_total_accepted_p, policy.pos_total_tried_p)
            stats.extra["lane_step_seconds"] = control.report()   # per mode: planned, corrected, errors
        return GenerationResult(tokens=tokens, texts=decode_texts(self.target.tokenizer, tokens), stats=stats)

    def _sliced_goodput(self, schedule: Schedule, rows: int, cache_len: int, pipelined: bool):
        """The goodput policy's host side for a two-slice call (None under a fixed policy): each
        plan's predicted seconds per lane step (the TETRIS plan's at its standard budget N * k, and
        at each of its budgets), in the call's modes (a pipelined call's tail runs sequentially),
        and what this decoder measured of the shape before."""
        from jaxspec.parallel import goodput as sliced

        if schedule.predict_ks is None:
            return None
        ks, plans, model = schedule.predict_ks, schedule.plans, self.spec.cost_model
        modes = ("pipelined", "sequential") if pipelined else ("sequential",)
        packed = [None if plan.capacities is None else rows * (k + 1) for plan, k in zip(plans, ks)]
        cost = {mode: sliced.lane_step_seconds(model, rows, [plan.k for plan in plans], cache_len,
                                               mode == "pipelined", packed) for mode in modes}
        caps = () if schedule.tetris_index is None else plans[schedule.tetris_index].capacities
        cost_c = {mode: sliced.lane_step_seconds(model, rows, [self.spec.draft_len] * len(caps), cache_len,
                                                 mode == "pipelined", [rows + c for c in caps]) for mode in modes}
        timing = self._slice_timings.get((rows, cache_len, pipelined)) if self.spec.measure_plans else None
        for tracker in (timing.trackers.values() if timing is not None else ()):
            tracker.new_call()
        put = functools.partial(sharding_lib.put, sharding=sharding_lib.replicated(self._target_mesh))
        return sliced.SlicedGoodput(plans, ks, cost, cost_c, put, timing=timing, measure=self.spec.measure_plans,
                                    acceptance=self._goodput.acceptance.seed(schedule.positions),
                                    positions=schedule.positions)

    def _schedule(self, rows: int, num_prompts: int, cache_len: int) -> tuple[Schedule, int]:
        """The compiled step shapes and the TETRIS per-step budget C (0 for standard selection).

        TETRIS with capacity=None spends C = N * k over the N real requests: the budget standard
        speculative decoding with k spends, the paper's fair comparison. The program is compiled
        for C rounded up to a bucket and selects exactly C inside it. The goodput policy compiles
        one branch per candidate: k = 0..k (standard), or k = 0..k+extra-1 and TETRIS with a few
        candidate budgets up to C.
        """
        spec, big_k = self.spec, self.spec.draft_len
        tetris_on = spec.selection == "tetris" and big_k > 0
        budget = 0
        if tetris_on:
            budget = min(spec.capacity if spec.capacity is not None else num_prompts * spec.k, rows * big_k)
        threshold = spec.threshold
        if spec.policy == "fixed":
            capacity = tetris.capacity_bucket(budget, rows, big_k) if tetris_on else None
            plan = StepPlan(k=big_k, capacity=capacity, cache_len=cache_len, threshold=threshold)
            return Schedule(plans=(plan,)), budget
        if not tetris_on:
            ks = tuple(range(spec.k + 1))
            plans = tuple(StepPlan(k=k, cache_len=cache_len, threshold=threshold, calibrate=threshold is not None)
                          for k in ks)
            return Schedule(plans=plans, predict_ks=ks, choose_every=spec.choose_every,
                            positions=spec.k if spec.position_profile else 0), 0
        capacities = tuple(sorted({0} | {tetris.capacity_bucket(round(f * budget), rows, big_k)
                                         for f in (0.25, 0.5, 1.0, 1.5, 2.0)}))
        tetris_plan = StepPlan(k=big_k, capacity=max(capacities), capacities=capacities, cache_len=cache_len,
                               threshold=threshold)
        # Drafting k + extra positions costs the same whatever budget is then verified, so where
        # the batch's best budget is small (few rows, or acceptance that does not pay for the
        # extra drafts) a standard window is the cheaper choice: every draft length below k +
        # extra is offered (k = 1 is also the opening probe, `policy.opening_choice`). The TETRIS
        # plan stands for k where a draft length is needed (the host's trial proposals, a drain)
        # and is otherwise judged by its best budget (`policy.tetris_goodput`). With only k = 1
        # besides plain decoding and TETRIS, batch-1 decoders of the tiny-8L pair decoded plainly
        # and ran 0-10% behind the best fixed configuration in eight runs (5% at the median); with
        # k = 1..k - 1 and TETRIS judged as k, one at SmolLM2 shapes ran k = 3 at batch 1, 9% behind
        # the best fixed k (5).
        # The standard plans count the calibration only where they read it (threshold drafting):
        # TETRIS's ranking reads it in the TETRIS plan's own steps, and counted in every standard
        # step (most of a run's steps where the policy prefers a standard length) it cost a
        # standard k = 4 step 13 kernels over fixed k = 4's 567 at batch 1, against 3 without.
        # The TETRIS plan's steps still count it, so a run that stays on TETRIS learns the curve;
        # one that switches to it ranks by the drafter's own probabilities until its steps have.
        standard = tuple(StepPlan(k=j, cache_len=cache_len, threshold=threshold if j else None,
                                  calibrate=threshold is not None and j > 0)
                         for j in range(big_k))
        return Schedule(plans=standard + (tetris_plan,), predict_ks=tuple(range(big_k)) + (spec.k,),
                        choose_every=spec.choose_every, positions=big_k if spec.position_profile else 0), 0


def _stats(c: Counters, n: int, steps: int, seconds: float, step_ks: list[int], drafter: Drafter) -> GenerationStats:
    real = slice(0, n)
    emitted = int(c.emitted[real].sum())
    row_steps = int(c.row_steps[real].sum())
    drafted, verified, accepted = (int(x[real].sum()) for x in (c.drafted, c.verified, c.accepted))
    # Step emissions exclude the prefill's first token.
    step_emitted = emitted - int((c.emitted[real] > 0).sum())
    return GenerationStats(
        new_tokens=emitted, steps=steps, seconds=seconds,
        tokens_per_second=emitted / seconds if seconds > 0 else 0.0,
        per_request_new_tokens=[int(x) for x in c.emitted[real]],
        target_forwards=steps + 1,
        draft_forwards=sum(drafter.forwards_per_step(k) for k in step_ks) + (1 if any(step_ks) else 0),
        drafted_tokens=drafted, verified_tokens=verified, accepted_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        vsr=accepted / verified if verified else 0.0,
        ter=step_emitted / (verified + row_steps) if row_steps else 0.0,
        mean_accepted_length=step_emitted / row_steps if row_steps else 0.0,
        mean_draft_length=verified / row_steps if row_steps else 0.0,
        extra={"per_request_steps": [int(x) for x in c.row_steps[real]],
               "per_request_accepted": [int(x) for x in c.accepted[real]],
               "k_trace": step_ks})


def _as_drafter(draft, vocab_size: int, spec: SpecConfig) -> Drafter:
    if isinstance(draft, Model):
        if draft.config.vocab_size != vocab_size:
            raise ValueError(f"draft vocab_size ({draft.config.vocab_size}) differs from the target's "
                             f"vocab_size ({vocab_size}); they must share one tokenizer")
        return ModelDrafter(draft, greedy=spec.greedy_draft)
    if isinstance(draft, NgramDrafter):
        return draft.bind_vocab(vocab_size)
    if isinstance(draft, SpeculativeDecoder):
        from jaxspec.chain import ChainDrafter
        if draft.vocab_size != vocab_size:
            raise ValueError(f"draft chain vocab_size ({draft.vocab_size}) differs from the target's "
                             f"vocab_size ({vocab_size})")
        return ChainDrafter(draft)
    if isinstance(draft, Drafter):
        if draft.vocab_size not in (None, vocab_size):
            raise ValueError(f"drafter vocab_size ({draft.vocab_size}) differs from the target's "
                             f"vocab_size ({vocab_size})")
        return draft
    raise ValueError("draft must be a jaxspec.Model, a drafter (e.g. jaxspec.NgramDrafter()) or a "
                     f"SpeculativeDecoder, got {type(draft).__name__}")

