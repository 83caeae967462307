"""Batch jobs (data/jobs/) under every drafter: plain, n-gram, suffix, model draft, EAGLE, hybrid.

Each workload of data/jobs/ (scripts/make_jobs.py: records -> JSON, a code edit, a sonnet summary
that quotes it, one-off chat) runs as one job: its first --requests prompts, wrapped in the model's
chat template, decoded greedily at --batch slots with continuous refill (`batch_size=` of
`SpeculativeDecoder.generate`), up to --new-tokens each, stopping at the model's end-of-turn token. Per workload and
batch size: plain decoding, n-gram lookup (`NgramDrafter(max_ngram=3)`) and, where present, the
pair's draft model (Qwen: the 0.5B; SmolLM2: --draft) and an EAGLE head (--eagle, default
models/<pair>-eagle3), at k = --k; suffix decoding (`SuffixDrafter`) and the hybrid of it with each
model drafter (`HybridDrafter`) at k = --suffix-k. A suffix drafter's corpus starts empty for every
timed job (what a job sees; warm-up would otherwise leave the very answers in it). With
--cost-model, the suffix and hybrid rows also run under the goodput policy (its hybrid may then
run the suffix drafter alone). Every configuration is warmed up, then timed once per round,
round-robin (`round_robin`); `tok_s` uses the median job time, `vs_plain` is the median over rounds
of the time ratio to plain within a round (this VM's speed drifts). `tokens_per_pass` is
`mean_accepted_length` (tokens a row keeps per target forward, 1 for plain); outputs are checked
identical to plain decoding (`same_output`: rows equal; `first_diff`: where the others part).

    python scripts/bench_suffix.py [--pair smollm2|qwen] [--workloads records_json ...] [--requests 64]
        [--batch 8] [--new-tokens 128] [--k 4] [--suffix-k 8] [--rounds 2] [--deadline S] [--out DIR]

Writes docs/results/<name>.{json,md} (bench_suffix, bench_suffix_qwen; or into --out DIR) after
every workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from checkout import DATA, MODELS, add_out_argument, out_dir, qwen_files

import jaxspec
from jaxspec.cli.jobs import read_jobs
from jaxspec.cli.tools import chat_prompt
from jaxspec.tools import benchmarking as bench

WORKLOADS = ["records_json", "code_edit", "summary_quote", "chat_fresh"]
COLUMNS = ["workload", "batch", "method", "k", "tok_s", "vs_plain", "tokens_per_pass", "acceptance",
           "draft_len", "new_tokens", "job_s", "same_output", "first_diff"]
DEFAULTS = {"smollm2": dict(requests=64, batch=[8], new_tokens=128),
            "qwen": dict(requests=8, batch=[1, 4], new_tokens=96)}

SUFFIX_ARGS = dict(max_depth=24, corpus_tokens=262144, min_token_prob=0.1)


@dataclasses.dataclass
class Config:
    """One timed configuration: `make()` builds its drafter; `fresh`: rebuild the decoder before
    every call (untimed), so a drafter that keeps a corpus across calls starts each job empty."""
    method: str
    k: int
    make: Callable[[], jaxspec.Drafter | jaxspec.Model]
    fresh: bool = False
    goodput: bool = False


def model_drafters(args, target) -> dict[str, object]:
    """The pair's costly drafters by name: its draft model and an EAGLE head, where present."""
    found = {}
    if args.pair == "qwen":
        found["draft 0.5B"] = jaxspec.load(qwen_files(args.models)[1])
    elif args.draft:
        found["draft"] = jaxspec.load(args.draft)
    eagle = Path(args.eagle) if args.eagle else Path(args.models) / f"{args.pair}-eagle3"
    if eagle.exists():
        found["eagle"] = jaxspec.EagleDrafter(jaxspec.load(eagle, target=target))
    elif args.eagle:
        raise SystemExit(f"--eagle {eagle}: no such head")
    return found


def configurations(args, costly: dict[str, object]) -> list[Config]:
    plain = jaxspec.Drafter()   # k = 0: autoregressive decoding (as jaxspec.generate), here with refills
    configs = [Config("plain", 0, lambda: plain),
               Config("ngram", args.k, lambda: jaxspec.NgramDrafter(max_ngram=3))]
    configs += [Config(name, args.k, lambda d=d: d) for name, d in costly.items()]
    for goodput in (False, True) if args.cost_model else (False,):
        tag = " (goodput)" if goodput else ""
        configs.append(Config("suffix" + tag, args.suffix_k, lambda: jaxspec.SuffixDrafter(**SUFFIX_ARGS), fresh=True,
                              goodput=goodput))
        configs += [Config(f"hybrid suffix+{name}{tag}", args.suffix_k,
                           lambda d=d: jaxspec.HybridDrafter([jaxspec.SuffixDrafter(**SUFFIX_ARGS), d]), fresh=True,
                           goodput=goodput) for name, d in costly.items()]
    return configs


def decoder_for(config: Config, target, cost):
    spec = (jaxspec.SpecConfig(k=config.k, policy="goodput", cost_model=cost) if config.goodput
            else jaxspec.SpecConfig(k=config.k))
    return jaxspec.SpeculativeDecoder(target, config.make(), spec=spec)


def run_unit(workload: str, batch: int, prompts: list[str], configs: list[Config], target, args, cost) -> list[dict]:
    """Every configuration on one job (the prompts at `batch` slots), round-robin; its table rows."""
    eos = target.tokenizer.eos_token_id
    decoders = {c.method: decoder_for(c, target, cost) for c in configs}
    by_method = {c.method: c for c in configs}

    def before(method):   # untimed: a corpus-keeping drafter starts each job empty
        if by_method[method].fresh:
            decoders[method] = decoder_for(by_method[method], target, cost)

    def job(method):
        return lambda on_finish=None: decoders[method].generate(
            prompts, max_new_tokens=args.new_tokens, eos_token_id=eos, batch_size=batch, on_finish=on_finish)

    print(f"{workload}, batch {batch}: {len(configs)} configurations x {len(prompts)} requests, warm-up and "
          f"{args.rounds} round(s)", flush=True)
    results, seconds, _ = bench.round_robin({c.method: job(c.method) for c in configs}, args.rounds, before=before)
    reference = results["plain"].tokens
    rows = []
    for c in configs:
        res, stats = results[c.method], results[c.method].stats
        firsts = bench.first_differences(reference, res.tokens)
        new_tokens = sum(map(len, res.tokens))
        rows.append({"workload": workload, "batch": batch, "method": c.method,
                     "k": c.k, "tok_s": new_tokens / float(np.median(seconds[c.method])),
                     "vs_plain": float(np.median(seconds["plain"] / seconds[c.method])),
                     "tokens_per_pass": 1.0 if c.k == 0 else stats.mean_accepted_length,
                     "acceptance": None if c.k == 0 else stats.acceptance_rate,
                     "draft_len": None if c.k == 0 else stats.mean_draft_length,
                     "new_tokens": new_tokens, "job_s": float(np.median(seconds[c.method])),
                     "same_output": f"{firsts.count(None)}/{len(firsts)}",
                     "first_diff": ", ".join(f"row {i} @ {j}" for i, j in enumerate(firsts) if j is not None),
                     "seconds": seconds[c.method].tolist()})
        print(bench.table(rows[-1:], COLUMNS), flush=True)
    return rows


def load_target(args):
    if args.pair == "qwen":
        return jaxspec.load(qwen_files(args.models)[0]), "Qwen2.5-Coder 1.5B-Instruct (Q4_K_M GGUF, float32)"
    return jaxspec.load(jaxspec.example_model("smollm2-135m")), "SmolLM2-135M-Instruct (Q4_1 GGUF, float32)"


def job_prompts(workload: str, requests: int, tokenizer) -> list[str]:
    jobs = read_jobs(DATA / "jobs" / f"{workload}.jsonl")[:requests]
    return [chat_prompt(tokenizer, job.prompt) for job in jobs]


def report(args, title, rows, skipped, started) -> str:
    m = bench.machine()
    notes = []
    if skipped:
        notes.append(f"Not run (they would have ended past the {args.deadline:.0f} s deadline): "
                     + ", ".join(f"{w} at batch {b}" for w, b in skipped) + ".")
    return "\n".join([
        f"# {args.name}\n\n`python scripts/bench_suffix.py {' '.join(sys.argv[1:])}`\n",
        " ".join(__doc__.split("\n\n")[1].split()),
        f"\n{title}; {args.requests} request(s) per workload, up to {args.new_tokens} new tokens each, greedy, "
        f"{args.rounds} round(s). Machine: {m['cpu_model']}, {m['cpu_count']} cores; jax {m['jax']}. "
        f"Total time {time.perf_counter() - started:.0f} s.", "",
        bench.table(rows, COLUMNS) if rows else "(no rows)", "", *notes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2", choices=sorted(DEFAULTS))
    parser.add_argument("--models", default=str(MODELS), metavar="DIR",
                        help="folder of the Qwen GGUF files and of models/<pair>-eagle3")
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--requests", type=int, help="requests per workload (default: smollm2 64, qwen 8)")
    parser.add_argument("--batch", type=int, nargs="+", help="slots, one job per value (default: smollm2 8, qwen 1 4)")
    parser.add_argument("--new-tokens", type=int, help="most new tokens per request (default: smollm2 128, qwen 96)")
    parser.add_argument("--k", type=int, default=4, help="draft length of n-gram, draft model and EAGLE rows")
    parser.add_argument("--suffix-k", type=int, default=8, help="draft length of suffix and hybrid rows")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--draft", metavar="PATH", help="smollm2: a draft model (e.g. models/smollm2-draft)")
    parser.add_argument("--eagle", metavar="DIR", help="an EAGLE head for the target (default models/<pair>-eagle3 "
                                                       "where it exists)")
    parser.add_argument("--cost-model", metavar="FILE", help="a CostModel JSON: suffix and hybrid rows also under "
                                                             "the goodput policy")
    parser.add_argument("--deadline", type=float,
                        help="seconds to finish in: a job starts only if, at the pace of the slowest so far, it ends "
                             "by then (results are written after every job)")
    parser.add_argument("--name", help="default: bench_suffix (smollm2), bench_suffix_qwen")
    add_out_argument(parser)
    args = parser.parse_args()
    for key, value in DEFAULTS[args.pair].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.name = args.name or ("bench_suffix" if args.pair == "smollm2" else "bench_suffix_qwen")
    started = time.perf_counter()
    target, title = load_target(args)
    costly = model_drafters(args, target)
    cost = jaxspec.CostModel.load(args.cost_model) if args.cost_model else None
    configs = configurations(args, costly)
    if costly:
        title += ", model drafters: " + ", ".join(costly)
    print(f"loaded {title} in {time.perf_counter() - started:.0f} s; methods: "
          f"{', '.join(c.method for c in configs)}", flush=True)
    rows, skipped, unit_seconds = [], [], [0.0]
    for workload in args.workloads:
        prompts = job_prompts(workload, args.requests, target.tokenizer)
        for batch in args.batch:
            unit_start = time.perf_counter()
            if args.deadline is not None and unit_start - started + 1.1 * max(unit_seconds) > args.deadline:
                skipped.append((workload, batch))
                print(f"{workload} at batch {batch} skipped: it would end past the {args.deadline:.0f} s deadline",
                      flush=True)
                continue
            rows += run_unit(workload, batch, prompts, configs, target, args, cost)
            unit_seconds.append(time.perf_counter() - unit_start)
            jaxspec.clear_caches()   # the next job compiles other shapes; bounds XLA:CPU's memory
            bench.write_results(out_dir(args) / args.name, {"args": vars(args), "rows": rows, "skipped": skipped},
                                report(args, title, rows, skipped, started))
    md = report(args, title, rows, skipped, started)
    bench.write_results(out_dir(args) / args.name, {"args": vars(args), "rows": rows, "skipped": skipped}, md)
    print("\n" + md)


if __name__ == "__main__":
    main()
