"""Throughput of one `jaxspec generate` job run by 1, 2 and 4 local processes (jax.distributed on
CPU), each pinned to its share of the cores, and the cost of coordinating them.

Configurations, each timed from launch to the last process's exit (model loading and compilation
included: a job's wall time), round-robin over `--rounds`: one process without `jax.distributed`,
one process under it (`--num-processes 1`: what coordination alone costs), 2 and 4 processes. Per
process the job reports its setup seconds (reading the input and the parts, connecting, agreeing,
the barrier), the coordination a request pays is that over its requests. Every run's merged
output is checked against the single-process output token for token. Writes
docs/results/<name>.{json,md} (or --out DIR).

    python scripts/bench_multihost.py [--model preset:smollm2-135m] [--requests 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from checkout import add_out_argument, out_dir

from jaxspec.tools.benchmarking import table, write_results

ROW = re.compile(r"^\|\s*(\d+)\s*\|")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_job(processes: int | None, args, prompts: Path, out: Path) -> tuple[float, list[dict]]:
    """Seconds from launch to the last exit, and each process's summary row (process 0's table)."""
    cores = sorted(os.sched_getaffinity(0))
    base = [sys.executable, "-m", "jaxspec.cli", "generate", "--target", args.model, "--draft", "ngram",
            "--prompts", str(prompts), "--output", str(out), "--no-progress", "--k", "3",
            "--max-new-tokens", str(args.new_tokens), "--batch-size", str(args.batch_size)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    n, port = processes or 1, free_port()
    commands = []
    for i in range(n):
        mine = [str(c) for c in cores[i * len(cores) // n:(i + 1) * len(cores) // n] or [cores[i % len(cores)]]]
        dist = [] if processes is None else ["--coordinator", f"localhost:{port}", "--num-processes", str(n),
                                             "--process-id", str(i)]
        commands.append(["taskset", "-c", ",".join(mine)] + base + dist)
    start = time.perf_counter()
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in commands]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    seconds = time.perf_counter() - start
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(o[-3000:] for o in outs))
    header = next(line for line in outs[0].splitlines() if line.startswith("| ") and "requests" in line)
    names = [h.strip() for h in header.strip("|").split("|")]
    rows = [dict(zip(names, (c.strip() for c in line.strip("|").split("|")))) for line in outs[0].splitlines()
            if ROW.match(line)]
    return seconds, rows


def merged_tokens(out: Path, processes: int | None) -> dict:
    if processes is not None:
        subprocess.run([sys.executable, "-m", "jaxspec.cli", "merge", str(out)], check=True, capture_output=True)
    return {json.loads(line)["id"]: json.loads(line)["tokens"] for line in open(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:smollm2-135m")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="bench_multihost")
    add_out_argument(parser)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-multihost-"))
    rng = np.random.default_rng(0)
    prompts = folder / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": rng.integers(0, 250, int(rng.integers(8, 40))).tolist()})
                               + "\n" for i in range(args.requests)))
    configs = {"1 process": None, "1 process, jax.distributed": 1, "2 processes": 2, "4 processes": 4}
    seconds = {name: [] for name in configs}
    setup = {name: [] for name in configs}
    reference, same = None, {}
    for r in range(args.rounds):
        for name, processes in configs.items():
            out = folder / f"out-{r}-{processes}.jsonl"
            wall, rows = run_job(processes, args, prompts, out)
            tokens = merged_tokens(out, processes)
            reference = reference or tokens
            same[name] = same.get(name, True) and tokens == reference
            seconds[name].append(wall)
            setup[name].append(max(float(row["setup_s"]) for row in rows))
            print(f"round {r} {name}: {wall:.1f} s", flush=True)
    total_tokens = sum(len(t) for t in reference.values())
    base = np.median(seconds["1 process"])
    rows = [{"config": name, "processes": processes or 1, "wall_s": float(np.median(seconds[name])),
             "tok_s": total_tokens / float(np.median(seconds[name])),
             "vs_1_process": base / float(np.median(seconds[name])),
             "setup_s": float(np.median(setup[name])),
             "setup_ms_per_request": 1e3 * float(np.median(setup[name])) / args.requests,
             "same_tokens": same[name]} for name, processes in configs.items()]
    print(table(rows))
    cores = len(os.sched_getaffinity(0))
    note = (f"{args.requests} requests of {args.model} (random weights), n-gram drafts k = 3, {args.new_tokens} new "
            f"tokens, batch {args.batch_size} per process, {cores} cores split evenly between the processes "
            f"(taskset); wall time from launch to the last exit, loading and compiling included; medians of "
            f"{args.rounds} rounds, round-robin. setup_s: the slowest process's reading, connecting, agreeing "
            f"and barrier before decoding.")
    write_results(out_dir(args) / args.name, {"note": note, "rows": rows, "seconds": seconds, "args": vars(args)},
                  f"# {args.name}\n\n{note}\n\n`python scripts/bench_multihost.py {' '.join(sys.argv[1:])}`\n\n"
                  f"{table(rows)}")
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
