"""`SpeculativeDecoder`: batched speculative decoding of a target model with a drafter.

A call validates and buckets the prompts, fills a fixed number of slots (continuous batching
refills a finished row from the queue) and runs the programs of `jaxspec.engine.loop` in segments
of S steps, queued and read by `segments.Host`. When draft and target live on separate device
slices the two-slice engine of `jaxspec.engine.sliced` runs instead.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref

import jax
import numpy as np

from jaxspec import prompts as prompts_lib
from jaxspec.drafting import Drafter, EagleDrafter, HybridDrafter, ModelDrafter, NgramDrafter, SuffixDrafter, crossvocab
from jaxspec.engine import batching, loop, segments, sliced, timing
from jaxspec.engine import plans as plans_lib
from jaxspec.engine.chain import ChainDrafter
from jaxspec.engine.loop import Control
from jaxspec.engine.plans import Program, Schedule, cache_length
from jaxspec.engine.step import Counters, Requests
from jaxspec.models.model import Model
from jaxspec.parallel import sharding as sharding_lib
from jaxspec.parallel.mesh import MeshConfig
from jaxspec.results import GenerationResult, GenerationStats, decode_texts
from jaxspec.sampling import SamplingConfig, clear_keys
from jaxspec.spec import SpecConfig

_DECODERS: weakref.WeakSet = weakref.WeakSet()   # live decoders, whose `_compiled` clear_caches() empties


def clear_caches() -> None:
    """Releases every compiled program, JAX's and jaxspec's, and the library's own caches.

    Programs are cached per shape (batch bucket, cache length bucket, plan, sampling) until this
    call, which a long notebook or a sweep makes to release shapes it no longer needs; decoders and
    models built before keep working (they compile again on next use). A persistent compilation
    cache on disk stays."""
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
        for name, value, cls in (("spec", self.spec, SpecConfig), ("sampling", self.sampling, SamplingConfig),
                                 ("target", target, Model)):
            if not isinstance(value, cls):
                raise ValueError(f"{name} must be a jaxspec.{cls.__name__}, got {type(value).__name__}")
        if mesh is not None and not isinstance(mesh, MeshConfig):
            raise ValueError(f"mesh must be None or a jaxspec.MeshConfig, got {type(mesh).__name__}")
        self.mesh = mesh
        self._sliced = self.spec.pipeline or (mesh is not None and mesh.separate_draft)
        if self._sliced and isinstance(draft, Drafter) and (draft.feature_layers or isinstance(draft, HybridDrafter)):
            # The target's features (EAGLE) do not cross to a separate draft slice; a hybrid drafts beside them.
            raise ValueError(f"a {type(draft).__name__} runs on the target's own devices: use pipeline=False and "
                             "a MeshConfig without a separate draft slice (draft_tp=0)")
        if mesh is not None and isinstance(draft, HybridDrafter):
            raise ValueError("a HybridDrafter cannot be placed on a MeshConfig yet; pass mesh=None")
        if isinstance(draft, Drafter) and draft.feature_layers:
            _check_feature_drafter(draft, target.config)
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
            elif isinstance(draft, EagleDrafter):   # the head on the target's devices
                draft = EagleDrafter(sharding_lib.place_head(draft.head, self._target_mesh, target))
        elif self._sliced:
            self._target_mesh = self._draft_mesh = MeshConfig(target_tp=1, draft_tp=0).target_mesh()
        else:
            self._target_mesh = self._draft_mesh = None
        self.target = target
        self.drafter = _as_drafter(draft, target, self.spec)
        if self.spec.tree is not None and type(self.drafter).propose_tree is Drafter.propose_tree:
            raise ValueError("tree drafting (SpecConfig(tree=...)) needs a draft Model, an EAGLE head, n-gram "
                             f"or suffix lookup, got {type(self.drafter).__name__}")
        if isinstance(self.drafter, crossvocab.CrossVocabDrafter) and self._draft_mesh is not None:
            self.drafter = self.drafter.placed(sharding_lib.replicated(self._draft_mesh))
        self.draft = draft
        # Two-slice engines only: set to {"draft": [], "verify": []} to record the seconds of each
        # draft and verify call, each timed alone (blocking: no overlap).
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
          on_finish: called on the host as `on_finish(index, tokens, counters)` once it reads that
            the request at `prompts[index]` finished (counters: its row_steps, drafted, verified,
            accepted, emitted and tried), so a batch job can save each result as it comes.
          request_ids: distinct ints naming each prompt's RNG stream (default: its index), as in
            `jaxspec.generate`.
        """
        cfg, k = self.target.config, self.spec.draft_len
        eos = prompts_lib.check_eos(eos_token_id, cfg.vocab_size)
        batch = prompts_lib.prepare(prompts, self.target.tokenizer, vocab_size=cfg.vocab_size,
                                    max_positions=cfg.max_position_embeddings, max_new_tokens=max_new_tokens,
                                    request_ids=request_ids)
        cache_len = cache_length(batch.tokens_bp.shape[1], batch.out_len, int(np.max(batch.max_new_b)), k)
        if self._sliced:
            return self._generate_sliced(batch, seed, eos, cache_len, batch_size, on_finish)
        return self._generate_single(batch, seed, eos, cache_len, batch_size, on_finish)

    def warm_up(self, prompts, max_new_tokens=64, **generate_args) -> float:
        """Runs `generate` to compile what calls of the same shapes need (prompt and batch buckets, token budgets)
        and returns its `stats.compile_seconds`. A later call may still compile a refill or drafter catch-up
        this one did not need. A SuffixDrafter keeps these requests in its corpus."""
        return self.generate(prompts, max_new_tokens, **generate_args).stats.compile_seconds

    def _program(self, schedule: Schedule, cache_len: int, out_len: int) -> Program:
        return Program(target=self.target.graphdef, drafter=self.drafter.static(), schedule=schedule,
                       sampling=self.sampling, cache_len=cache_len, out_len=out_len, mesh=self._target_mesh)

    def _clock(self, schedule: Schedule, slots: int, cache_len: int) -> dict:
        """The goodput policy's clock (`Control` fields): each plan's predicted step seconds, and one drafter
        forward (the catch-up's unit; none for a drafter fed the target's features: it keeps up anyway).
        A free drafter (n-gram, suffix) is priced by the cost model's `free` part where it has one."""
        if not schedule.goodput:
            return {}
        cost = self.spec.cost_model
        cost = cost.free if self.drafter.free and cost.free is not None else cost
        return dict(seconds_j=plans_lib.plan_seconds(cost, slots, schedule.plans, cache_len),
                    catch_up=0.0 if self.drafter.feature_layers else cost.draft_seconds(slots))

    def _generate_single(self, batch, seed: int, eos: int, cache_len: int, batch_size,
                         on_finish=None) -> GenerationResult:
        """One program at a time on the target's device (or mesh): segments of `run_on_device`."""
        multiple = self.mesh.target_dp if self.mesh is not None else 1
        slots = prompts_lib.bucket_batch(batching.check_batch_size(batch_size, batch.num_prompts))
        slots = -(-slots // multiple) * multiple
        queue = batching.RequestQueue(batch, on_finish=on_finish)
        table = batching.SlotTable(queue, slots, multiple)
        first = table.first_batch(queue.pop(slots))
        schedule, budgets = plans_lib.schedule_for(self.spec, slots, first.num_prompts,
                                                   isinstance(self.drafter, HybridDrafter))
        program, clock = self._program(schedule, cache_len, batch.out_len), self._clock(schedule, slots, cache_len)
        params = (self.target.params, self.drafter.params)
        # On a mesh host values are placed replicated; on one device they go to the compiled calls
        # as numpy arrays (jit's own transfer of a few small arrays is cheaper than device_put's).
        put = (functools.partial(sharding_lib.put, sharding=sharding_lib.replicated(self._target_mesh))
               if self._target_mesh is not None else (lambda tree: tree))

        def control(plan=0):
            return put(Control.of(budget=budgets[plan], draining=not len(queue), **clock))

        start = time.time()
        state, report = loop.start_on_device(dataclasses.replace(program, schedule=schedule.for_prefill()), params,
                                             put(Requests.of(first, seed, eos)), control())
        host = segments.Host(program, table, jax.device_get(report), self.spec.segment_steps())
        if schedule.goodput:
            self._compile_plans(program, params, state, control(), host)
        while host.plan is not None:
            if not host.inflight:   # the host may change the state: refill finished rows, catch the drafter up
                refill = table.refill()
                if refill is not None:
                    self._remember(queue, final=False)
                    params = (self.target.params, self.drafter.params)   # same shapes: no compilation
                    state, report = loop.refill_on_device(program, params, state, put(refill[0]),
                                                          put(Requests.of(refill[1], seed, eos)), control())
                    host.refilled(jax.device_get(report))
                width = host.catch_up_width()
                if width:
                    state, _ = loop.catch_up_on_device(program, params, state, width)
            segment = host.next_segment()
            state, report = loop.run_on_device(program, params, state, control(segment.plan), segment)
            host.dispatched(report, segment)
        extra = dict(slots=slots, **host.extra())
        if schedule.goodput:   # each plan's predicted step seconds
            extra.update(plan_seconds=clock["seconds_j"].tolist())
        return self._result(queue, host.steps, start, host.step_ks, extra, eos)

    def _result(self, queue, steps: int, start: float, step_ks: list[int], extra: dict, eos: int) -> GenerationResult:
        seconds = timing.split_compile(start)   # (compile, decode): the device work began at `start` (time.time())
        tokens = queue.results()
        self._remember(queue, final=True)
        stats = _stats(Counters(**queue.counters), queue.batch.num_prompts, steps, seconds, step_ks, self.drafter)
        stats.extra.update(extra)
        return GenerationResult(tokens=tokens, texts=decode_texts(self.target.tokenizer, tokens, eos), stats=stats)

    def _remember(self, queue, final: bool) -> None:
        """Hands the drafter the requests finished since it was last given any (the suffix corpus)."""
        batch, done = queue.batch, list(queue.tokens)[queue.remembered:]
        queue.remembered += len(done)
        self.drafter.remember((list(batch.tokens_bp[i, :batch.lengths_b[i]]) + queue.tokens[i] for i in done), final)

    def _compile_plans(self, program: Program, params, state, control, host) -> None:
        """Every plan's first segment at this batch shape, compiled side by side once: the policy
        may switch to any of them mid-call, and a compilation there would stall the batch for seconds."""
        segments_j = [host.next_segment(plan=j) for j in range(len(program.schedule.plans))]
        key = (program, state.seq_bl.shape[0], segments_j[0].live)
        if key in self._compiled:
            return
        self._compiled.add(key)
        lowered = [loop.run_on_device.lower(program, params, state, control, s) for s in segments_j]
        timing.side_by_side([lower.compile for lower in lowered])

    def _generate_sliced(self, batch, seed: int, eos: int, cache_len: int, batch_size,
                         on_finish=None) -> GenerationResult:
        """Draft and target on two slices, stepped from the host; pipelined, two lanes share one
        request queue, and the first requests are split so both start with equal work (MineDraft)."""
        n = batch.num_prompts
        multiple = self.mesh.target_dp if self.mesh is not None else 1
        queue = batching.RequestQueue(batch, on_finish=on_finish)
        first = queue.pop(batching.check_batch_size(batch_size, n))
        groups = ([[first[i] for i in half] for half in sliced.balanced_split(batch.max_new_b[first], len(first))]
                  if self.spec.pipeline and n >= 2 else [first])
        rows = max(prompts_lib.bucket_batch(len(g)) for g in groups)   # one program for both lanes
        rows = -(-rows // multiple) * multiple
        tables = [batching.SlotTable(queue, rows, multiple) for _ in groups]
        # Both lanes run one program per plan, compiled for the larger lane's TETRIS capacity.
        schedule, _ = plans_lib.schedule_for(self.spec, rows, max(len(g) for g in groups))
        seconds = {mode: plans_lib.plan_seconds(self.spec.cost_model, rows, schedule.plans, cache_len,
                                                pipelined=mode == "pipelined")
                   for mode in ("pipelined", "sequential")} if schedule.goodput else None
        runner = sliced.SlicedRunner(self.target, self.drafter, self._program(schedule, cache_len, batch.out_len),
                                     self._target_mesh, self._draft_mesh, seconds=seconds)
        runner.timings = self.phase_timings
        start = time.time()
        lanes = [runner.start(t, t.first_batch(g), seed, eos, plans_lib.schedule_for(self.spec, rows, len(g))[1])
                 for t, g in zip(tables, groups)]
        runner.run(lanes)
        steps = sum(int(s) for s in jax.device_get([ln.state.steps for ln in lanes]))
        step_ks = runner.trace if schedule.goodput else [schedule.plans[0].k] * steps
        return self._result(queue, steps, start, step_ks, dict(lanes=len(lanes), slots=rows * len(lanes)), eos)


def _stats(c: Counters, n: int, steps: int, seconds: tuple, step_ks: list[int], drafter: Drafter) -> GenerationStats:
    real = slice(0, n)
    emitted, row_steps, drafted, verified, accepted = (int(x[real].sum()) for x in (
        c.emitted, c.row_steps, c.drafted, c.verified, c.accepted))
    step_emitted = emitted - int((c.emitted[real] > 0).sum())   # without the prefill's first token
    return GenerationStats(
        new_tokens=emitted, steps=steps, compile_seconds=seconds[0], seconds=seconds[1],
        tokens_per_second=emitted / seconds[1] if seconds[1] > 0 else 0.0,
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
    if isinstance(draft, (NgramDrafter, SuffixDrafter)):
        return draft.bind_vocab(vocab_size)
    if isinstance(draft, HybridDrafter):
        return draft.bound([_as_drafter(m, target, spec) for m in draft.members], spec.draft_len)
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


def _check_feature_drafter(drafter: Drafter, config) -> None:
    """A drafter reading the target's features (EAGLE) must fit the target."""
    if max(drafter.feature_layers) >= config.num_layers:
        raise ValueError(f"the drafter's feature_layers {drafter.feature_layers} must be below the target's "
                         f"num_layers ({config.num_layers})")
    if isinstance(drafter, EagleDrafter) and drafter.head.config.target_hidden_size != config.hidden_size:
        raise ValueError(f"the EAGLE head reads target features of width {drafter.head.config.target_hidden_size}, "
                         f"but the target's hidden_size is {config.hidden_size}")
