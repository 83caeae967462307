"""`SpeculativeDecoder`: batched speculative decoding of a target model with a drafter.

A call validates and buckets the prompts, fills a fixed number of slots (continuous batching
refills a finished row from the queue) and runs the programs of `jaxspec.engine.loop` a segment
at a time: under a fixed policy a segment ends only to refill or hand over a finished request;
under the goodput policy also where the policy, on device, chooses another plan.
When draft and target live on separate device slices the two-slice engine of
`jaxspec.engine.sliced` runs instead.
"""

from __future__ import annotations

import functools
import time
import weakref

import jax
import numpy as np

from jaxspec import policy as policy_lib
from jaxspec import prompts as prompts_lib
from jaxspec import tetris
from jaxspec.drafting import Drafter, EagleDrafter, ModelDrafter, NgramDrafter, crossvocab
from jaxspec.drafting.trees import TreeShape
from jaxspec.engine import batching, loop, sliced, timing
from jaxspec.engine.chain import ChainDrafter
from jaxspec.engine.generate import check_eos, clear_keys, request_keys
from jaxspec.engine.loop import Schedule, cache_length, prefill_schedule, put_rows
from jaxspec.engine.step import Counters, StepPlan
from jaxspec.models.model import Model
from jaxspec.parallel import sharding as sharding_lib
from jaxspec.parallel.mesh import MeshConfig
from jaxspec.results import GenerationResult, GenerationStats, decode_texts
from jaxspec.sampling import SamplingConfig
from jaxspec.spec import SpecConfig

TREE_DRAFTERS = (ModelDrafter, EagleDrafter, NgramDrafter, crossvocab.CrossVocabDrafter)   # with `propose_tree`

_NO_CAP = 2 ** 30   # a segment's step cap when none is wanted
_DECODERS: weakref.WeakSet = weakref.WeakSet()   # live decoders, whose `_compiled` clear_caches() empties


def clear_caches() -> None:
    """Releases every compiled program, JAX's and jaxspec's, and the library's own caches.

    Programs are compiled and cached per shape, as JAX does: per batch bucket, cache length
    bucket, k / step plan and sampling config. Re-running shapes already seen compiles nothing
    and does not grow memory; every new shape adds programs (on XLA:CPU a few MB and memory maps
    each: 6 for a trivial program, about 120 for a decode program) that stay until this call. A
    long notebook or a parameter sweep calls it to release the programs of shapes it no longer
    needs. Decoders and models built before it keep working: they compile again on next use.

    Calls `jax.clear_caches()` (JAX's persistent compilation cache on disk, if set, stays), then
    empties the PRNG keys kept per seed (`jaxspec.generate`) and each live decoder's record of
    the goodput plans it compiled ahead.
    """
    jax.clear_caches()
    clear_keys()
    for decoder in list(_DECODERS):
        decoder._compiled.clear()


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
        if isinstance(draft, Drafter) and draft.feature_layers:
            _check_feature_drafter(draft, target.config, self._sliced)
        if mesh is not None:
            if isinstance(draft, SpeculativeDecoder):
                raise ValueError("a multi-level chain draft cannot be placed on a MeshConfig yet; pass mesh=None")
            mesh.check(target.config, draft.config if isinstance(draft, Model) else
                       draft.head.config.layer if isinstance(draft, EagleDrafter) else
                       draft.model.config if isinstance(draft, crossvocab.CrossVocabDrafter) else None)
            self._target_mesh, self._draft_mesh = mesh.target_mesh(), mesh.draft_mesh()
            target = sharding_lib.place_params(target, self._target_mesh)
            if isinstance(draft, Model):
                draft = sharding_lib.place_params(draft, self._draft_mesh)
            elif isinstance(draft, crossvocab.CrossVocabDrafter):
                draft = crossvocab.CrossVocabDrafter(sharding_lib.place_params(draft.model, self._draft_mesh),
                                                     draft.map, greedy=draft.greedy)
            elif isinstance(draft, EagleDrafter) and not self._sliced:   # the head on the target's devices
                draft = EagleDrafter(sharding_lib.place_head(draft.head, self._target_mesh, target))
        elif self._sliced:
            self._target_mesh = self._draft_mesh = MeshConfig(target_tp=1, draft_tp=0).target_mesh()
        else:
            self._target_mesh = self._draft_mesh = None
        self.target = target
        self.drafter = _as_drafter(draft, target, self.spec)
        if self.spec.tree is not None and type(self.drafter) not in TREE_DRAFTERS:
            raise ValueError("tree drafting (SpecConfig(tree=...)) needs a draft Model, an EAGLE head or n-gram "
                             f"lookup, got {type(self.drafter).__name__}")
        if isinstance(self.drafter, crossvocab.CrossVocabDrafter) and self._draft_mesh is not None:
            self.drafter = self.drafter.placed(sharding_lib.replicated(self._draft_mesh))
        self.draft = draft
        # Two-slice engines only: set to {"draft": [], "verify": []} to record the seconds of each
        # draft and verify call, each timed alone (blocking: no overlap; for measurements).
        self.phase_timings: dict[str, list[float]] | None = None
        self._compiled: set[tuple] = set()   # goodput: batch shapes whose plans are compiled
        _DECODERS.add(self)

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
        return self._generate_single(batch, seed, eos, cache_len, batch_size, on_finish)

    def _policy_seconds(self, schedule, slots: int, cache_len: int):
        """The goodput policy's clock: each plan's predicted step seconds, and one drafter forward
        (the catch-up's unit; none for a drafter fed the target's features, which keeps up
        through plain steps too)."""
        catch_up = 0.0 if self.drafter.feature_layers else self.spec.cost_model.draft_seconds(slots)
        return self._plan_seconds(schedule, slots, cache_len), np.float32(catch_up)

    def _generate_single(self, batch, seed: int, eos: int, cache_len: int, batch_size,
                         on_finish=None) -> GenerationResult:
        """One program at a time on the target's device (or mesh): segments of `run_on_device`."""
        multiple = self.mesh.target_dp if self.mesh is not None else 1
        slots = prompts_lib.bucket_batch(batching.check_batch_size(batch_size, batch.num_prompts))
        slots = -(-slots // multiple) * multiple
        queue = batching.RequestQueue(batch, on_finish=on_finish)
        table = batching.SlotTable(queue, slots, multiple)
        first = table.first_batch(queue.pop(slots))
        schedule, budgets = self._schedule(slots, first.num_prompts)
        goodput = schedule.goodput
        static = dict(cache_len=cache_len, seq_len=cache_len, out_len=batch.out_len, mesh=self._target_mesh)
        graphdef, params, dparams = self.target.graphdef, self.target.params, self.drafter.params
        drafter = self.drafter.static()   # compiled programs keep their static arguments
        # On a mesh host values are placed replicated; on one device they go to the compiled calls
        # as numpy arrays (jit's own transfer of a few small arrays is cheaper than device_put's).
        put = (functools.partial(sharding_lib.put, sharding=sharding_lib.replicated(self._target_mesh))
               if self._target_mesh is not None else (lambda tree: tree))
        keys_b = request_keys(seed, first.request_ids_b)
        *rows_in, eos_t = put((first.tokens_bp, first.lengths_b, first.max_new_b, keys_b, np.int32(eos)))
        seconds = put(self._policy_seconds(schedule, slots, cache_len)) if goodput else None
        start = time.perf_counter()
        state = loop.start_on_device(graphdef, drafter, prefill_schedule(schedule), self.sampling, params, dparams,
                                     *rows_in, eos_t, seconds, policy_lib.PRIOR_ALPHA if goodput else None,
                                     put(np.bool_(not len(queue))) if goodput else None, **static)
        max_new_b, keys_b = rows_in[2], rows_in[3]
        if goodput and (slots, cache_len, batch.out_len) not in self._compiled:
            # Every plan's program, compiled side by side now: the policy may switch to any of
            # them mid-call, and a compilation there would stall the batch for seconds.
            self._compiled.add((slots, cache_len, batch.out_len))
            args = (graphdef, drafter, schedule, self.sampling, params, dparams, state, keys_b, max_new_b, eos_t,
                    *put((np.int32(0), np.int32(0), np.int32(0))), seconds, put(np.bool_(True)))
            timing.side_by_side([functools.partial(
                lambda j: loop.run_on_device.lower(*args, **static, plan_index=j).compile(), j)
                for j in range(len(schedule.plans))])
        plan_index = int(jax.device_get(state.policy.choice)) if goodput else 0
        step_ks: list[int] = []
        segments: list[tuple[int, int, float]] = []
        while True:
            # With requests waiting (or a caller waiting for each result), stop as soon as one
            # more row is done, to refill it or hand it over.
            stop = 1 if len(queue) or (on_finish is not None and table.active > 1) else 0
            segment_start = time.perf_counter()
            state = loop.run_on_device(graphdef, drafter, schedule, self.sampling, params, dparams, state, keys_b,
                                       max_new_b, eos_t, *put((np.int32(budgets[plan_index]), np.int32(stop),
                                                               np.int32(_NO_CAP))),
                                       seconds, put(np.bool_(not len(queue))) if goodput else None, **static,
                                       plan_index=plan_index)
            done_b, out_bo, n_out_b, counters, steps, choice = loop.segment_outputs(state)
            ran = int(steps) - len(step_ks)
            step_ks += [schedule.plans[plan_index].k] * ran
            if goodput:
                segments.append((plan_index, ran, time.perf_counter() - segment_start))
                plan_index = int(choice)
            table.harvest(done_b, out_bo, n_out_b, counters)
            refill = table.refill()
            if refill is None:
                if table.active == 0 and not len(queue):
                    break
                continue
            new_in = put((refill[0], refill[1].tokens_bp, refill[1].lengths_b, refill[1].max_new_b,
                          request_keys(seed, refill[1].request_ids_b)))
            state = loop.refill_on_device(graphdef, drafter, schedule, self.sampling, params, dparams, state,
                                          *new_in, eos_t, seconds, put(np.bool_(not len(queue))) if goodput else None,
                                          **static)
            max_new_b, keys_b = put_rows(max_new_b, new_in[0], new_in[3]), put_rows(keys_b, new_in[0], new_in[4])
            if goodput and bool(np.all(done_b)):   # no row was running: the new rows' opening choice
                plan_index = int(jax.device_get(state.policy.choice))
        seconds_taken = time.perf_counter() - start
        tokens = queue.results()
        stats = _stats(Counters(**queue.counters), batch.num_prompts, int(steps), seconds_taken, step_ks, self.drafter)
        stats.extra["slots"] = slots
        if goodput:
            # (plan, steps, wall seconds) of each segment, and each plan's predicted step seconds.
            stats.extra.update(segments=segments,
                               plan_seconds=self._plan_seconds(schedule, slots, cache_len).tolist())
        return GenerationResult(tokens=tokens, texts=decode_texts(self.target.tokenizer, tokens), stats=stats)

    def _plan_seconds(self, schedule: Schedule, slots: int, cache_len: int) -> np.ndarray:
        """The cost model's seconds for one step of each plan at this batch shape."""
        cost = self.spec.cost_model
        return np.asarray([cost.step_seconds(slots, plan.k, cache_len, tree=plan.tree,
                                             packed_tokens=None if plan.capacity is None else slots + plan.capacity)
                           for plan in schedule.plans], np.float32)

    def _generate_sliced(self, batch, seed: int, eos: int, cache_len: int, batch_size,
                         on_finish=None) -> GenerationResult:
        """Draft and target on two slices, stepped from the host; two pipelined batches if asked.

        Pipelined, the slots are split between two lanes that share one request queue; the first
        requests are split so both lanes start with equal work (MineDraft's assignment), and a
        lane refills its finished rows from the queue, so both stay full until it drains.
        """
        n = batch.num_prompts
        multiple = self.mesh.target_dp if self.mesh is not None else 1
        slots_total = batching.check_batch_size(batch_size, n)
        queue = batching.RequestQueue(batch, on_finish=on_finish)
        first = queue.pop(slots_total)
        if self.spec.pipeline and n >= 2:
            halves = sliced.balanced_split(batch.max_new_b[first], len(first))
            groups = [[first[i] for i in h] for h in halves]
        else:
            groups = [first]
        rows = max(prompts_lib.bucket_batch(len(g)) for g in groups)   # one program for both lanes
        rows = -(-rows // multiple) * multiple
        tables = [batching.SlotTable(queue, rows, multiple) for _ in groups]
        lane_batches = [t.first_batch(g) for t, g in zip(tables, groups)]
        # Both lanes run one program per plan, compiled for the larger lane's TETRIS capacity.
        schedule, _ = self._schedule(rows, max(len(g) for g in groups))
        seconds = None
        if schedule.goodput:
            seconds = {mode: sliced.lane_step_seconds(self.spec.cost_model, rows, schedule.plans, cache_len,
                                                        pipelined=mode == "pipelined")
                       for mode in ("pipelined", "sequential")}
        runner = sliced.SlicedRunner(self.target, self.drafter, schedule, self.sampling, self._target_mesh,
                                       self._draft_mesh, seconds=seconds)
        runner.timings = self.phase_timings
        start = time.perf_counter()
        lanes = [runner.start(t, lb, seed, eos, cache_len, self._schedule(rows, len(g))[1])
                 for t, lb, g in zip(tables, lane_batches, groups)]
        runner.run(lanes, eos)
        steps = sum(int(s) for s in jax.device_get([ln.state.steps for ln in lanes]))
        seconds_taken = time.perf_counter() - start
        tokens = queue.results()
        step_ks = runner.trace if schedule.goodput else [schedule.plans[0].k] * steps
        stats = _stats(Counters(**queue.counters), n, steps, seconds_taken, step_ks, self.drafter)
        stats.extra["lanes"] = len(lanes)
        stats.extra["slots"] = rows * len(lanes)
        return GenerationResult(tokens=tokens, texts=decode_texts(self.target.tokenizer, tokens), stats=stats)

    def _schedule(self, rows: int, num_prompts: int) -> tuple[Schedule, tuple[int, ...]]:
        """The compiled step shapes and each one's TETRIS budget C per step (0 for standard).

        TETRIS with capacity=None spends C = N * k over the N real requests: the budget standard
        speculative decoding with k spends, the paper's fair comparison. A fixed program is
        compiled for C rounded up to a bucket and selects exactly C inside it. The goodput policy's
        candidates are every draft length 0..k (standard), or with TETRIS 0..k+extra-1 and the
        TETRIS window at a few budgets around C, each budget a bucket of its own; with a tree,
        plain decoding and the tree.
        """
        spec, big_k = self.spec, self.spec.draft_len
        if spec.tree is not None:   # each row's k best nodes, or the batch's C best
            shape, budget, capacity = TreeShape(*spec.tree), 0, None
            if spec.selection == "tetris":
                budget = min(spec.capacity if spec.capacity is not None else num_prompts * spec.k, rows * big_k)
                capacity = tetris.capacity_bucket(budget, rows, big_k)
            tree = StepPlan(k=spec.k, capacity=capacity, tree=shape)
            if spec.policy == "fixed":
                return Schedule(plans=(tree,)), (budget,)
            return Schedule(plans=(StepPlan(k=0), tree), goodput=True), (0, budget)   # plain or the tree
        tetris_on = spec.selection == "tetris" and big_k > 0
        budget = 0
        if tetris_on:
            budget = min(spec.capacity if spec.capacity is not None else num_prompts * spec.k, rows * big_k)
        threshold = spec.threshold
        if spec.policy == "fixed":
            capacity = tetris.capacity_bucket(budget, rows, big_k) if tetris_on else None
            return Schedule(plans=(StepPlan(k=big_k, capacity=capacity, threshold=threshold),)), (budget,)
        top = big_k if tetris_on else spec.k + 1
        plans = tuple(StepPlan(k=j, threshold=threshold if j else None) for j in range(top))
        if tetris_on:
            capacities = sorted({tetris.capacity_bucket(max(1, round(f * budget)), rows, big_k) for f in (0.5, 1, 2)})
            plans += tuple(StepPlan(k=big_k, capacity=c, threshold=threshold) for c in capacities)
        return Schedule(plans=plans, goodput=True), tuple(plan.capacity or 0 for plan in plans)


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


def _as_drafter(draft, target: Model, spec: SpecConfig) -> Drafter:
    vocab_size = target.config.vocab_size
    if isinstance(draft, Model):
        if draft.tokenizer is not None and target.tokenizer is not None and (
                draft.config.vocab_size != vocab_size or not crossvocab.same_vocabulary(draft.tokenizer,
                                                                                        target.tokenizer)):
            vocab_map = crossvocab.VocabMap.from_tokenizers(draft.tokenizer, draft.config.vocab_size,
                                                            target.tokenizer, vocab_size)
            return crossvocab.CrossVocabDrafter(draft, vocab_map, greedy=spec.greedy_draft)
        if draft.config.vocab_size != vocab_size:
            raise ValueError(f"draft vocab_size ({draft.config.vocab_size}) differs from the target's "
                             f"vocab_size ({vocab_size}) and the two have no tokenizers to bridge them "
                             "(or pass a jaxspec.CrossVocabDrafter)")
        return ModelDrafter(draft, greedy=spec.greedy_draft)
    if isinstance(draft, NgramDrafter):
        return draft.bind_vocab(vocab_size)
    if isinstance(draft, SpeculativeDecoder):
        tokenizers = (draft.target.tokenizer, target.tokenizer)
        if draft.vocab_size != vocab_size or (None not in tokenizers and not crossvocab.same_vocabulary(*tokenizers)):
            raise ValueError(f"a multi-level chain's levels must share one tokenizer: the draft chain's vocab_size "
                             f"is {draft.vocab_size}, the target's {vocab_size}")
        return ChainDrafter(draft)
    if isinstance(draft, Drafter):
        if draft.vocab_size not in (None, vocab_size):
            raise ValueError(f"drafter vocab_size ({draft.vocab_size}) differs from the target's "
                             f"vocab_size ({vocab_size})")
        return draft
    raise ValueError("draft must be a jaxspec.Model, a drafter (e.g. jaxspec.NgramDrafter()) or a "
                     f"SpeculativeDecoder, got {type(draft).__name__}")


def _check_feature_drafter(drafter: Drafter, config, sliced: bool) -> None:
    """A drafter reading the target's features (EAGLE) must fit the target, and runs where the
    target does (its features do not cross to a separate draft slice)."""
    if sliced:
        raise ValueError("an EAGLE drafter runs on the target's own devices (pipeline=False and a MeshConfig "
                         "with draft_tp=0): the target's features do not cross to a separate draft slice")
    if max(drafter.feature_layers) >= config.num_layers:
        raise ValueError(f"the drafter's feature_layers {drafter.feature_layers} must be below the target's "
                         f"num_layers ({config.num_layers})")
    if isinstance(drafter, EagleDrafter) and drafter.head.config.target_hidden_size != config.hidden_size:
        raise ValueError(f"the EAGLE head reads target features of width {drafter.head.config.target_hidden_size}, "
                         f"but the target's hidden_size is {config.hidden_size}")
