"""The `jaxspec` command line: thin front ends over the library.

    jaxspec generate --target PATH --draft PATH|ngram|none --prompts IN.jsonl --output OUT.jsonl
             [--coordinator HOST:PORT --num-processes N --process-id I]
    jaxspec merge OUT.jsonl
    jaxspec profile --target PATH --draft PATH --output cost.json
    jaxspec distill / train-eagle --target PATH ... --output DIR
    jaxspec bench [--quick] [--only NAME] [--out DIR]

A model argument is a path (GGUF file, HF folder, jaxspec checkpoint) or `preset:NAME` for random
weights at a preset's shape (`preset:qwen2.5-1.5b`): timings depend on shapes, not on weights.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path

import jax
from tqdm import tqdm

import jaxspec
from jaxspec import prompts as prompts_lib
from jaxspec.cli import checks, multihost, report
from jaxspec.cli import jobs as jobs_lib
from jaxspec.cli import settings as settings_lib
from jaxspec.cli.eagle import add_train_eagle
from jaxspec.cli.tools import (
    add_bench,
    add_distill,
    add_model_args,
    add_profile,
    chat_prompt,
    chat_tokenizer,
    load_model,
    output_path,
    warn,
)
from jaxspec.models.eagle import is_eagle_folder
from jaxspec.policy.cost import CostModel
from jaxspec.tools.benchmarking import table


def _build_spec(args, form: checks.DraftForm
                ) -> tuple[jaxspec.SpecConfig, jaxspec.SamplingConfig, jaxspec.MeshConfig | None]:
    """Decoding settings from the arguments; bad values fail here, before any model is loaded."""
    plain = form.plain
    if plain and args.policy == "goodput":
        raise ValueError("--policy goodput chooses draft lengths and needs a drafter; got --draft none")
    if args.extra and args.selection != "tetris":
        raise ValueError(f"--extra {args.extra} only applies with --selection tetris")
    if args.policy == "goodput" and args.cost_model is None:
        raise ValueError("--policy goodput needs --cost-model FILE (written by `jaxspec profile`)")
    if args.cost_model is not None and args.policy != "goodput":
        raise ValueError("--cost-model is only used with --policy goodput")
    cost = CostModel.load(args.cost_model) if args.cost_model is not None else None
    # --draft none: plain decoding through the speculative engine (k = 0), so continuous batching
    # and the per-request callback work the same way.
    spec = jaxspec.SpecConfig(k=0 if plain else args.k, extra=0 if plain else args.extra,
                              selection="standard" if plain else args.selection, capacity=args.capacity,
                              policy=args.policy, cost_model=cost,
                              pipeline=args.pipeline, tree=None if plain else _tree(args.tree))
    sampling = jaxspec.SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    mesh = None
    if args.target_tp != 1 or args.target_dp != 1 or args.draft_tp is not None:
        mesh = jaxspec.MeshConfig(target_tp=args.target_tp, target_dp=args.target_dp,
                                  draft_tp=args.draft_tp if args.draft_tp is not None else 0)
    return spec, sampling, mesh


def _tree(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        depth, width = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--tree must be DEPTH,WIDTH (two ints, e.g. 3,2), got {text!r}") from None
    return depth, width


def _encode_jobs(todo: list[jobs_lib.Job], model: jaxspec.Model, args, max_positions: int
                 ) -> tuple[list[list[int]], list[int]]:
    """Token ids and budgets of the requests to run, checked against the model; a bad request is
    reported with its input line, before anything is written."""
    tok, vocab = model.tokenizer, model.config.vocab_size
    where = args.prompts
    if args.chat:
        chat_tokenizer(model, args.target)
    ids_list, budgets = [], []
    for job in todo:
        prompt = job.prompt
        if args.chat:
            if not isinstance(prompt, str):
                raise jobs_lib.JobFileError(f"{where}:{job.line}: --chat needs string prompts, got token ids")
            prompt = chat_prompt(tok, prompt)
        try:
            (ids,) = prompts_lib.encode_prompts([prompt], tok, vocab)
        except ValueError as err:
            message = str(err).replace("prompts[0]", "prompt")
            raise jobs_lib.JobFileError(f"{where}:{job.line}: {message}") from None
        budget = job.max_new_tokens if job.max_new_tokens is not None else args.max_new_tokens
        if len(ids) + budget > max_positions:
            raise jobs_lib.JobFileError(
                f"{where}:{job.line}: prompt of id {jobs_lib.id_key(job.id)} has {len(ids)} tokens; with "
                f"max_new_tokens={budget} that is {len(ids) + budget} positions, more than the context "
                f"(max_position_embeddings={max_positions})")
        ids_list.append(ids)
        budgets.append(budget)
    return ids_list, budgets


def generate(args) -> int:
    """`jaxspec generate`: a JSONL batch job, resumable (see jaxspec.cli.jobs), over one process or
    several (see jaxspec.cli.multihost), that refuses to mix settings (see jaxspec.cli.settings)."""
    # Everything that can be checked without the models is checked first, so a typo fails in a
    # second: the --draft form, the values, the output folder, the input (read whole), the cost
    # model, the target's path; then the job's recorded settings.
    form = checks.parse_draft(args.draft)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if Path(args.output).resolve() == Path(args.prompts).resolve():
        raise ValueError("--output must differ from --prompts")
    output = output_path(args.output)
    placement = multihost.placement(args.coordinator, args.num_processes, args.process_id)
    jobs = jobs_lib.read_jobs(args.prompts, skip_bad_lines=args.skip_bad_lines, warn=warn)
    spec = _build_spec(args, form)
    checks.check_model("--target", args.target)
    now = settings_lib.job_settings(args, spec[0], form)
    n, me, peers, began = 1, 0, None, time.perf_counter()
    if placement is not None:
        multihost.start(*placement)
        n, me = placement[1], placement[2]
        multihost.agree({**{k: v for k, v in vars(args).items() if k not in _OWN_ARGS},
                         "prompts": multihost.digest(args.prompts), "settings": now})
    settings_lib.check([output, *multihost.parts(output)], now, args.allow_mixed_settings, warn)
    done = multihost.finished(args.output)   # the output and every part file of earlier runs
    if placement is not None:
        peers = multihost.PeerProgress(args.output, me, n)
        multihost.barrier("jaxspec-generate-scanned")   # nobody writes before everyone has read
        if me == 0:
            multihost.write_manifest(args.output, args.prompts)
    pending = jobs_lib.pending(jobs, done)
    own = multihost.part_path(args.output, me) if placement is not None else output
    share = _Share(todo=pending[me::n], output=own, scan=jobs_lib.scan_output(own), total=len(pending),
                   peers=peers, settings=now)
    if me == 0 and len(pending) < len(jobs):
        print(f"resuming: skipped {len(jobs) - len(pending)} of {len(jobs)} requests already in {args.output}"
              + (" and its parts" if placement is not None else ""), flush=True)
    coordination = time.perf_counter() - began   # the job's reading and agreeing, before any decoding
    summary = {"process": me, "requests": 0, "new_tokens": 0}
    if share.todo:
        stages = report.Stages(me if n > 1 else None)
        summary = {"process": me, "requests": len(share.todo), **_decode(args, jobs, share, spec, form, stages),
                   "output": str(share.output)}
    elif share.scan.torn or share.scan.needs_newline:
        _repair(own, share.scan)
    if n > 1:
        summary["setup_s"] = coordination   # multi-process coordination: meaningless with one process
    _print_summary(multihost.gather(summary) if placement is not None else [summary], args, len(jobs), pending)
    return 0


def _print_summary(everyone: list[dict], args, total: int, pending: list) -> None:
    if jax.process_index() != 0:
        return
    if not pending:
        print(f"nothing to do: all {total} requests are in {args.output}")
    else:
        rows = everyone if len(everyone) > 1 else [{k: v for k, v in everyone[0].items() if k != "process"}]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        print(table(rows, columns))
    if len(everyone) > 1:
        print(f"parts written: `jaxspec merge {args.output}` gathers them in input order once every request "
              "is done", flush=True)


# Options that may differ between the processes of one job (none changes a request's tokens).
_OWN_ARGS = ("process_id", "no_progress", "batch_size", "run")


@dataclasses.dataclass(frozen=True)
class _Share:
    """This process's part of a job.

    Attributes:
      todo: its requests, in input order.
      output: the file it appends to (the job's output, or its part file in a multi-process job).
      scan: what that file already holds (`jobs.scan_output`).
      total: the requests left in the whole job (what the progress bar counts).
      peers: the other processes' progress (`multihost.PeerProgress`); None: a single-process job.
      settings: the job's settings (`settings.job_settings`), recorded before the first line.
    """

    todo: list[jobs_lib.Job]
    output: Path
    scan: jobs_lib.OutputScan
    total: int
    peers: multihost.PeerProgress | None
    settings: dict


def _decode(args, jobs: list[jobs_lib.Job], share: _Share, settings, form: checks.DraftForm,
            stages: report.Stages) -> dict:
    """Loads the models and runs this process's requests, appending to `share.output`; `settings`:
    `_build_spec`'s. The processes of a multi-process job each run a replica on their local devices.
    Returns the summary row (`report.summary`)."""
    spec, sampling, mesh = settings
    device = None
    if share.peers is not None:
        local = jax.local_devices()
        if mesh is not None and mesh.num_devices > len(local):
            raise ValueError(f"this mesh needs {mesh.num_devices} devices and a process has {len(local)}: "
                             "jaxspec generate runs one replica per process (a mesh over hosts: the Python API)")
        mesh = None if mesh is None else dataclasses.replace(mesh, devices=local)
        device = jax.default_device(local[0])
    with device or contextlib.nullcontext():
        loading = time.perf_counter()
        stages(f"loading target {args.target}")
        target = load_model(args.target, args.dtype, quantize=args.quantize)
        model, max_positions = None, target.config.max_position_embeddings
        if form.model is not None and is_eagle_folder(form.model):
            stages(f"loading draft {form.model} (EAGLE-3 head)")
            model = jaxspec.EagleDrafter(jaxspec.load(form.model, target=target))
        elif form.model is not None:
            stages(f"loading draft {form.model}")
            model = load_model(form.model, args.dtype, seed=1, quantize=args.quantize)
            max_positions = min(max_positions, model.config.max_position_embeddings)
        load_s = time.perf_counter() - loading
        prompts, budgets = _encode_jobs(share.todo, target, args, max_positions)
        decoder = jaxspec.SpeculativeDecoder(target, checks.make_drafter(form, model), spec=spec, sampling=sampling,
                                             mesh=mesh)
        _repair(share.output, share.scan)
        if form.lookup == "suffix":
            _remember_job(decoder, jobs, args, target, max_positions)
        settings_lib.record(share.output, share.settings, args.prompts)
        # Each request samples from the RNG stream of its position in the input file, so a resumed
        # run, or another process, draws the same tokens an uninterrupted one would have.
        position = {jobs_lib.id_key(job.id): i for i, job in enumerate(jobs)}
        streams = [position[jobs_lib.id_key(job.id)] for job in share.todo]
        stages(f"decoding {len(prompts)} requests (programs compile as first needed)")
        stats, run_s, finished = _run(decoder, share, prompts, budgets, streams, args)
        stages(f"done: {stats.new_tokens} tokens in {run_s:.1f} s, {report.compile_seconds(stats) or 0:.1f} s of it "
               "compiling")
        return report.summary(stats, load_s, run_s, finished)


def _remember_job(decoder, jobs: list[jobs_lib.Job], args, target, max_positions: int) -> None:
    """A resumed suffix-decoding job starts with the corpus it had: each request already in the output
    (or its parts), prompt and output, as the decoder adds them when they finish."""
    tokens = jobs_lib.finished_tokens([args.output, *multihost.parts(args.output)])
    earlier = [job for job in jobs if jobs_lib.id_key(job.id) in tokens]
    if earlier:
        prompts, _ = _encode_jobs(earlier, target, args, max_positions)
        decoder.drafter.remember([p + tokens[jobs_lib.id_key(job.id)] for p, job in zip(prompts, earlier)])


def _repair(path, scan: jobs_lib.OutputScan) -> None:
    if scan.torn:
        shown = scan.torn if len(scan.torn) <= 60 else scan.torn[:57] + "..."
        warn(f"{path} ends with a torn line (an interrupted write: {shown!r}); truncating it away, its request "
             "runs again")
    jobs_lib.repair_output(path, scan)


def _run(decoder: jaxspec.SpeculativeDecoder, share: _Share, prompts: list[list[int]], budgets: list[int],
         streams: list[int], args) -> tuple[jaxspec.GenerationStats, float, list[float]]:
    """Runs the requests, appending each one's line to `share.output` as soon as it finishes. Process 0
    of a multi-process job shows the whole run's progress (the other processes' parts, read as it goes).
    Returns the call's stats, its wall time (compilation included) and each request's finish time."""
    tok = decoder.target.tokenizer
    eos = tok.eos_token_id if args.eos and tok is not None else None
    totals = {"all_tokens": 0, "drafted": 0, "accepted": 0}
    finished: list[float] = []
    lead = share.peers is None or jax.process_index() == 0
    start = time.perf_counter()
    with jobs_lib.ResultWriter(share.output) as writer, \
            tqdm(total=share.total, unit="req", desc="generate", file=sys.stderr,
                 disable=args.no_progress or not lead, dynamic_ncols=True) as bar:
        def on_finish(index: int, tokens: list[int], counters: dict[str, int]) -> None:
            stats = jobs_lib.request_stats(counters)
            stats["finish"] = "eos" if eos is not None and tokens and tokens[-1] == eos else "length"
            kept = tokens[:-1] if stats["finish"] == "eos" else tokens   # the text ends before eos, as result.texts
            text = tok.decode(kept, skip_special_tokens=False) if tok is not None else None
            writer.write({"id": share.todo[index].id, "text": text, "tokens": tokens, "stats": stats})
            elapsed = time.perf_counter() - start
            finished.append(elapsed)
            totals["drafted"] += counters["drafted"]
            totals["accepted"] += counters["accepted"]
            others, other_tokens = share.peers.poll() if share.peers is not None and lead else (0, 0)
            totals["all_tokens"] += counters["emitted"] + other_tokens
            postfix = {"tok/s": f"{totals['all_tokens'] / elapsed:.1f}"}
            if totals["drafted"]:
                postfix["accept"] = f"{totals['accepted'] / totals['drafted']:.2f}"
            bar.set_postfix(postfix, refresh=False)
            bar.update(1 + others)

        result = decoder.generate(prompts, max_new_tokens=budgets, seed=args.seed, eos_token_id=eos,
                                  batch_size=min(args.batch_size, len(prompts)), on_finish=on_finish,
                                  request_ids=streams)
    return result.stats, time.perf_counter() - start, finished


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate", help="run a JSONL file of prompts through (speculative) decoding, resumably",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Reads requests from a JSONL file, one per line:\n"
                    '  {"id": "a", "prompt": "text or a list of token ids", "max_new_tokens": 32}\n'
                    "(max_new_tokens optional), and appends one line per finished request to the output:\n"
                    '  {"id": "a", "text": "...", "tokens": [...], "stats": {...}}\n'
                    "as soon as it finishes (flushed and synced). Rerunning with the same output skips the ids\n"
                    "already there, so a killed job resumes where it stopped; a torn last line is cut away.\n"
                    "Outputs are in finishing order, not input order. The whole input is validated before\n"
                    "anything is run or written.",
        epilog="example:\n  jaxspec generate --target model.gguf --draft ngram --prompts in.jsonl "
               "--output out.jsonl --max-new-tokens 128 --k 4 --chat")
    models = p.add_argument_group("models")
    add_model_args(models, quantize=True)
    models.add_argument("--draft", default="ngram",
                        help="a draft model (path or preset:NAME; its tokenizer may differ), an EAGLE-3 head folder "
                             "(jaxspec train-eagle), 'ngram' (prompt lookup, the default), 'none' (plain "
                             "autoregressive decoding), or, where this version has them, 'suffix' (suffix decoding) "
                             f"and suffix+PATH (suffix decoding, then a model). Here: {checks.valid_forms()}")
    io = p.add_argument_group("input and output")
    io.add_argument("--prompts", required=True, metavar="IN.jsonl", help="requests, one JSON object per line")
    io.add_argument("--output", required=True, metavar="OUT.jsonl", help="results, appended (resumable)")
    io.add_argument("--skip-bad-lines", action="store_true",
                    help="skip malformed input lines with a warning instead of failing")
    io.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    io.add_argument("--no-progress", action="store_true", help="no progress bar")
    io.add_argument("--allow-mixed-settings", action="store_true",
                    help="append to an output written with other settings (each output records the settings that "
                         "change tokens, in OUT.settings.json; without this flag a rerun with others is refused)")
    _add_decoding_args(p.add_argument_group("decoding"))
    par = p.add_argument_group("devices")
    par.add_argument("--target-tp", type=int, default=1, help="tensor-parallel degree of the target")
    par.add_argument("--target-dp", type=int, default=1, help="data-parallel degree of the target")
    par.add_argument("--draft-tp", type=int, default=None,
                     help="devices of the draft model's own slice (default: share the target's)")
    par.add_argument("--pipeline", action="store_true",
                     help="two pipelined batches: the draft drafts one while the target verifies the other")
    hosts = p.add_argument_group("several processes (hosts): the same command once per process; each runs a "
                                 "replica on its own devices and a share of the requests, writing OUT.part-ID")
    hosts.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (or JAX_COORDINATOR_ADDRESS)")
    hosts.add_argument("--num-processes", type=int, metavar="N", help="processes of the job (or JAX_NUM_PROCESSES)")
    hosts.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (or JAX_PROCESS_ID)")
    p.set_defaults(run=generate)


def _add_decoding_args(dec) -> None:
    """`generate`'s decoding options: budgets, draft lengths and selection, policy, sampling, batching."""
    dec.add_argument("--max-new-tokens", type=int, default=128,
                     help="token budget of each request without its own max_new_tokens (default 128)")
    dec.add_argument("--k", type=int, default=4, help="draft tokens per row per step (default 4)")
    dec.add_argument("--selection", default="standard", choices=["standard", "tetris"],
                     help="tetris: draft k + extra per row, verify the batch's most promising drafts")
    dec.add_argument("--extra", type=int, default=0, help="extra draft tokens per row for --selection tetris")
    dec.add_argument("--tree", metavar="D,W", default=None,
                     help="draft a tree of depth D, W children per expanded node; --k nodes verified per row "
                          "(or --selection tetris: the batch's --capacity best)")
    dec.add_argument("--capacity", type=int, default=None,
                     help="TETRIS drafts verified per step (default: batch * k)")
    dec.add_argument("--policy", default="fixed", choices=["fixed", "goodput"],
                     help="goodput: pick the draft length each step from a cost model and observed acceptance")
    dec.add_argument("--cost-model", metavar="FILE", help="cost model JSON for --policy goodput (jaxspec profile)")
    dec.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    dec.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    dec.add_argument("--top-p", type=float, default=1.0)
    dec.add_argument("--seed", type=int, default=0,
                     help="sampling seed; request i of the input file samples from stream i, so a resumed run "
                          "gives the same tokens as an uninterrupted one")
    dec.add_argument("--batch-size", type=int, default=8,
                     help="slots decoded at once; a finished slot takes the next request (default 8)")
    dec.add_argument("--eos", action=argparse.BooleanOptionalAction, default=True,
                     help="stop a request at the tokenizer's end-of-sequence token (default on)")


def merge(args) -> int:
    """`jaxspec merge`: a finished multi-process job's output, in input order, once the parts' settings
    agree (checked before anything is written)."""
    files = [Path(args.output), *multihost.parts(args.output)]
    record = settings_lib.merged(files, args.allow_mixed_settings, warn)
    print(table([multihost.merge(args.output, args.prompts, record)]))
    return 0


def _add_merge(sub) -> None:
    p = sub.add_parser("merge", help="gather a multi-process job's part files into OUT.jsonl, in input order")
    p.add_argument("output", metavar="OUT.jsonl", help="the job's --output")
    p.add_argument("--prompts", metavar="IN.jsonl", help="the job's input (default: named in OUT.jsonl.job.json)")
    p.add_argument("--allow-mixed-settings", action="store_true",
                   help="merge parts written with other settings (each part's are in OUT.part-I.settings.json)")
    p.set_defaults(run=merge)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxspec", description="Batch speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_merge(sub)
    add_profile(sub)
    add_bench(sub)
    add_distill(sub)
    add_train_eagle(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status.

    Library errors (bad input, bad values, missing files) print one line,
    `jaxspec: error: <message>`, and return 2; set JAXSPEC_TRACEBACK=1 to see the traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if args.command == "generate":
            print(f"\njaxspec: interrupted; finished requests are saved in {args.output}: rerun the same command to "
                  "resume", file=sys.stderr)
        return 130
    except (ValueError, OSError) as err:   # not TypeError & co: those are bugs, and need their traceback
        if os.environ.get("JAXSPEC_TRACEBACK"):
            raise
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in message:
            message = f"{message}: {err.filename}"
        print(f"jaxspec: error: {message}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) or isinstance(err, FileNotFoundError) else 1

