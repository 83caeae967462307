"""Decoding in segments (issue 58) against the `lax.while_loop` decode before it: tokens/s of every mode, CPU.

A driver checks out the revision before the rewrite (--rev) in a temporary `git worktree`, then runs workers
(this script, `PYTHONPATH=<tree>`, cwd that tree) on it and on the tree after it (--new-tree, default this
checkout) in turn for --rounds rounds; `--segments 1 4` adds the new tree at those S (SpecConfig(segment=S)). A
worker loads SmolLM2-135M-Instruct (float32) and, greedy, on bench_speculative's sonnet prompts, warms each mode
up (compiles), then times --repeats calls. Modes: plain (`jaxspec.generate`), ngram (n-gram lookup, k=3), tetris
(k=3, extra=1), tree (n-gram tree 3x2, k=4), goodput (k <= 4; bench_speculative_sonnet's cost model), chain (the
target drafting for itself through an n-gram level, k=2 in k=3), refill (k=3, 2 slots for 6 prompts) and, with
--qwen [DIR], model (Qwen2.5-Coder 1.5B <- 0.5B, batch 1, 32 tokens, k=3). tok/s: new tokens / wall seconds,
median over rounds and repeats; `same_*`: tokens equal plain decoding's; a mode that raises is an error row.
Writes docs/results/bench_segments.{json,md} (or into --out DIR).

    python scripts/bench_segments.py [--rev d9a51f2] [--new-tree PATH] [--rounds 2] [--segments 1 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from checkout import MODELS, QWEN, QWEN_DRAFT, REPO, RESULTS, add_out_argument, code_prompts, out_dir, sonnet

import jaxspec
from jaxspec.policy.cost import COEFFICIENTS
from jaxspec.tools.benchmarking import machine, table, write_results

MARK = "BENCH_SEGMENTS "   # a worker's result lines start with this
COST = RESULTS / "bench_speculative_sonnet_sonnet_cost_model.json"   # goodput's coefficients, for both trees
MODES = ["plain", "ngram", "tetris", "tree", "goodput", "chain", "refill"]   # and model, with --qwen
COLUMNS = ["mode", "after", "segment", "tok_s_before", "tok_s_after", "after_vs_before", "masked",
           "same_before", "same_after", "error"]


def modes(args, target):
    """name -> builder of (call(), target, prompts, new tokens) of each mode asked; bench_speculative's prompts."""
    asks = [f"Here is a sonnet:\n{sonnet()}\n\nRepeat lines {first + 1} to {first + 6} of the sonnet exactly, one "
            "per line." for first in range(8)]
    prompts = [target.tokenizer(target.tokenizer.apply_chat_template(
        [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True))["input_ids"] for ask in asks]
    ngram, batch = lambda: jaxspec.NgramDrafter(max_ngram=3), [prompts[i % len(prompts)] for i in range(args.batch)]
    cost = {name: v for name, v in json.loads(COST.read_text()).items() if name in COEFFICIENTS}

    def spec(**kw):   # segment= only where SpecConfig has that field (else the library's default applies)
        return jaxspec.SpecConfig(**kw, **({"segment": args.segment} if hasattr(jaxspec.SpecConfig, "segment") else {}))

    def spec_mode(draft, ids=batch, batch_size=None, **kw):
        decoder = jaxspec.SpeculativeDecoder(target, draft(), spec=spec(**kw))
        return (lambda: decoder.generate(ids, max_new_tokens=args.tokens, batch_size=batch_size),
                target, ids, args.tokens)

    def qwen_mode():   # the Qwen pair (a ModelDrafter), batch 1, 32 tokens
        big, small = (jaxspec.load(Path(args.qwen) / path.name) for path in (QWEN, QWEN_DRAFT))
        ids = code_prompts(big.tokenizer)[:1]
        decoder = jaxspec.SpeculativeDecoder(big, small, spec=spec(k=3))
        return lambda: decoder.generate(ids, max_new_tokens=32), big, ids, 32

    found = {"plain": lambda: (lambda: jaxspec.generate(target, batch, max_new_tokens=args.tokens), target, batch,
                               args.tokens),
             "ngram": lambda: spec_mode(ngram, k=3),
             "tetris": lambda: spec_mode(ngram, k=3, extra=1, selection="tetris"),
             "tree": lambda: spec_mode(ngram, k=4, tree=(3, 2)),
             "goodput": lambda: spec_mode(ngram, k=4, policy="goodput",
                                          cost_model=jaxspec.CostModel.from_coefficients(**cost)),
             "chain": lambda: spec_mode(lambda: jaxspec.SpeculativeDecoder(target, ngram(), spec=spec(k=2)), k=3),
             "refill": lambda: spec_mode(ngram, ids=[prompts[i % len(prompts)] for i in range(6)], batch_size=2, k=3),
             "model": qwen_mode}
    return {name: found[name] for name in args.modes + ["model"] * bool(args.qwen)}


def run_mode(name, build, args, references):
    """Prints one JSON row: tok/s of each timed call, same_output, the segment statistics; or the error."""
    row = {"mode": name, "jaxspec": str(Path(jaxspec.__file__).parent)}
    try:
        call, target, ids, new_tokens = build()
        result, tok_s = call(), []   # warm-up: compiles
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = call()
            tok_s.append(sum(map(len, result.tokens)) / (time.perf_counter() - start))
        key = (id(target), new_tokens, json.dumps(ids))
        if key not in references:   # plain decoding of these prompts (plain mode: its own output)
            references[key] = (result if name == "plain" else
                               jaxspec.generate(target, ids, max_new_tokens=new_tokens)).tokens
        row.update(tok_s=tok_s, same_output=result.tokens == references[key],
                   **{stat: (result.stats.extra or {}).get(stat) for stat in ("masked", "segment")})
    except Exception as e:   # noqa: BLE001 - the rewrite may still fail a mode: a row, not an abort
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    print(MARK + json.dumps(row), flush=True)


def run_worker(args, tree, segment, label):
    """This script as a worker on `tree`; its rows (a crash: an error row)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--batch", str(args.batch), "--tokens",
           str(args.tokens), "--repeats", str(args.repeats), "--modes", *args.modes]
    cmd += ["--segment", str(segment)] * (segment is not None) + ["--qwen", args.qwen] * bool(args.qwen)
    proc = subprocess.Popen(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rows, tail = [], []   # tail: the last lines, shown if it crashes
    for line in proc.stdout:
        if line.startswith(MARK):
            rows.append(json.loads(line[len(MARK):]))
            print(f"{label}: {line[len(MARK):].strip()}", flush=True)
        tail = (tail + [line])[-15:]
    if proc.wait():
        rows.append({"mode": "(worker)", "error": f"exit {proc.returncode}: {''.join(tail)[-600:]}"})
    return rows


def drive(args):
    """Every worker, round-robin (the order reversed every other round); the old tree removed at the end."""
    old, new = Path(tempfile.mkdtemp(prefix="bench_segments_")) / "old", Path(args.new_tree).resolve()
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), args.rev], check=True)
    engines = [("before", old, None), ("default", new, None)] + [(f"S={s}", new, s) for s in args.segments]
    samples = []
    try:
        for r in range(args.rounds):
            for label, tree, segment in engines[::-1] if r % 2 else engines:
                start = time.perf_counter()
                samples += [dict(row, engine=label, round=r) for row in run_worker(args, tree, segment, label)]
                print(f"round {r}, {label}: {time.perf_counter() - start:.0f} s", flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
        shutil.rmtree(old.parent, ignore_errors=True)
    return samples, [label for label, *_ in engines[1:]]


def summarize(samples, labels):
    """One row per mode and new engine: median tok/s before and after, their ratio, masked share."""
    def median(values):
        values = [v for v in values if v is not None]
        return float(np.median(values)) if values else None

    rows = []
    for mode in dict.fromkeys(s["mode"] for s in samples):
        old = [s for s in samples if s["engine"] == "before" and s["mode"] == mode]
        for label in labels:
            new = [s for s in samples if s["engine"] == label and s["mode"] == mode]
            before, after = (median([t for s in group for t in s.get("tok_s", [])]) for group in (old, new))
            same = [[s["same_output"] for s in group if "same_output" in s] for group in (old, new)]
            errors = "; ".join(f"{s['engine']}: {s['error']}" for s in old + new if "error" in s)
            rows.append({"mode": mode, "after": label, "segment": median([s.get("segment") for s in new]),
                         "tok_s_before": before, "tok_s_after": after, "after_vs_before": after / before
                         if before and after else None, "masked": median([s.get("masked") for s in new]),
                         "same_before": all(same[0]) if same[0] else None,
                         "same_after": all(same[1]) if same[1] else None, "error": errors[:200] or None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="d9a51f2", help="the revision before the rewrite")
    parser.add_argument("--new-tree", default=str(REPO), help="the tree after it (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per mode per worker")
    parser.add_argument("--segments", type=int, nargs="*", default=[], help="also the new tree at these S")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--qwen", nargs="?", const=str(MODELS), metavar="DIR", help="add the model mode (Qwen in DIR)")
    parser.add_argument("--name", default="bench_segments")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--segment", type=int, help=argparse.SUPPRESS)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.worker:   # one worker: every mode on the jaxspec of PYTHONPATH (the tree it runs in)
        if Path(jaxspec.__file__).resolve().parents[1] != Path.cwd().resolve():
            sys.exit(f"jaxspec was imported from {jaxspec.__file__}, not from {Path.cwd()}")
        target, references = jaxspec.load(jaxspec.example_model("smollm2-135m")), {}
        for name, build in modes(args, target).items():
            run_mode(name, build, args, references)
        return
    start = time.perf_counter()
    samples, labels = drive(args)
    rows, m = summarize(samples, labels), machine()
    cpu = m["cpu_model"]
    md = "\n".join([
        f"# {args.name}\n\n`python scripts/bench_segments.py {' '.join(sys.argv[1:])}`\n",
        " ".join(__doc__.split("\n\n")[1].split()),
        f"\nBefore: {args.rev}; after: {args.new_tree}. Batch {args.batch}, {args.tokens} new tokens, "
        f"{args.repeats} repeat(s), {args.rounds} round(s). `after`: the new tree at its default segment length, or "
        "at S; `segment`: the S it ran; `masked`: the share of its row-steps masked (a finished row waiting for its "
        f"segment's end or its refill). Machine: {cpu}, {m['cpu_count']} cores, jax {m['jax']}. "
        f"Total time {time.perf_counter() - start:.0f} s.", "", table(rows, COLUMNS)])
    print("\n" + md)
    write_results(out_dir(args) / args.name, {"args": vars(args), "cpu": cpu, "rows": rows, "samples": samples}, md)


if __name__ == "__main__":
    main()
