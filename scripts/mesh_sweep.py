"""Mesh-configuration sweep: target tensor parallelism, draft slice, pipelined two-batch drafting.

For each configuration on 8 virtual CPU devices: throughput, the draft and verify time of one
step (each call timed alone, blocking), the wall time per verification without blocking, and the
overlap = wall per verification / (draft + verify): 1.0 means the two halves ran one after the
other, max(draft, verify) / (draft + verify) is perfect pipelining. Greedy outputs are checked
identical to the target's own greedy output.

Two thread settings, each in its own process (XLA reads its flags once):
  multi   XLA's default: every device's program may use both cores, so two slices compete for
          them and the overlap the pipeline can show is small;
  single  each device's program runs on one thread (--xla_cpu_multi_thread_eigen=false), so the
          draft slice and the target slice each fit one of the two cores: the setting where the
          pipeline's step time can approach max(draft, verify).

A discrete-event simulation (`jaxspec.tools.mesh_sim.simulate`) driven by the measured draft and verify
times predicts each two-slice configuration's time per verification; the table compares it with
the measurement, and a what-if table extends it to larger tensor-parallel degrees.
Writes docs/results/<name>.{json,md,png} (or into --out DIR).

    python scripts/mesh_sweep.py [--threads multi single] [--batch 8] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
from checkout import add_out_argument, out_dir, pyplot

import jaxspec
from jaxspec.tools.benchmarking import layer_skip_pair, machine, table, timed, write_results
from jaxspec.tools.mesh_sim import simulate

FLAGS = {"multi": "--xla_force_host_platform_device_count=8",
         "single": "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false "
                   "intra_op_parallelism_threads=1"}

# (label, target_tp, target_dp, draft_tp, pipeline); draft_tp 0 = the draft shares the target's mesh.
CONFIGS = [
    ("single program", None, None, None, False),
    ("tp1, draft shares", 1, 1, 0, False),
    ("tp1 + draft slice", 1, 1, 1, False),
    ("tp1 + draft slice, pipelined", 1, 1, 1, True),
    ("tp2 + draft slice", 2, 1, 1, False),
    ("tp2 + draft slice, pipelined", 2, 1, 1, True),
    ("tp4 + draft slice", 4, 1, 1, False),
    ("tp4 + draft slice, pipelined", 4, 1, 1, True),
    ("dp2 x tp2 + draft slice 2, pipelined", 2, 2, 2, True),
]


def run_part(args) -> list[dict]:
    config = jaxspec.ModelConfig(vocab_size=4096, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                                 intermediate_size=768, max_position_embeddings=2048, tie_word_embeddings=False,
                                 name="sweep-8L")
    target, draft = layer_skip_pair(config, draft_layers=2, damping=0.06, sharpness=6.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, int(n)).tolist() for n in rng.integers(8, 40, args.batch)]
    reference = jaxspec.generate(target, prompts, max_new_tokens=args.new_tokens).tokens
    rows = []
    for label, tp, dp, dtp, pipeline in CONFIGS:
        mesh = None if tp is None else jaxspec.MeshConfig(target_tp=tp, target_dp=dp, draft_tp=dtp)
        decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=args.k, pipeline=pipeline),
                                             mesh=mesh)
        seconds, result = timed(lambda: decoder.generate(prompts, max_new_tokens=args.new_tokens),
                                repeats=args.repeats)
        s = result.stats
        row = {"threads": args.threads[0], "config": label, "tok_s": s.new_tokens / seconds,
               "wall_ms_per_verify": 1e3 * seconds / max(s.steps, 1), "steps": s.steps,
               "acceptance": s.acceptance_rate, "same_output": result.tokens == reference}
        if mesh is not None and (pipeline or dtp > 0):   # the two-slice engine (host-stepped)
            decoder.phase_timings = {"draft": [], "verify": []}
            decoder.generate(prompts, max_new_tokens=args.new_tokens)
            draft_s = float(np.median(decoder.phase_timings["draft"]))
            verify_s = float(np.median(decoder.phase_timings["verify"]))
            decoder.phase_timings = None
            row.update(draft_ms=1e3 * draft_s, verify_ms=1e3 * verify_s,
                       overlap=row["wall_ms_per_verify"] / (1e3 * (draft_s + verify_s)),
                       ideal_overlap=(max(draft_s, verify_s) / (draft_s + verify_s)) if pipeline else 1.0)
            sim = simulate([args.new_tokens] * args.batch, slots=args.batch, k=args.k, alpha=s.acceptance_rate,
                           draft_seconds=lambda b: draft_s, verify_seconds=lambda b: verify_s, pipeline=pipeline)
            row["sim_ms_per_verify"] = 1e3 * sim.seconds / sim.steps
        rows.append(row)
        print(row, flush=True)
    return rows


def what_if(rows: list[dict], k: int, batch: int, new_tokens: int) -> list[dict]:
    """Pipelined vs sequential when tensor parallelism shrinks the verification, by simulation.

    Draft and verify times are taken linear in a lane's rows through the two tp1 measurements
    (sequential: `batch` rows; pipelined: batch / 2 rows per lane). The what-if divides the
    verify time by target_tp (ideal scaling, as on GPUs with fast links; on this CPU it does not
    scale) while the draft slice keeps its time: an assumption, not a measurement.
    """
    seq = next(r for r in rows if r["config"] == "tp1 + draft slice")
    pipe = next(r for r in rows if r["config"] == "tp1 + draft slice, pipelined")

    def line(field):
        full, half = seq[field], pipe[field]
        slope = (full - half) / (batch - batch // 2)
        return lambda b: max(0.0, half + slope * (b - batch // 2))

    draft_ms, verify_ms = line("draft_ms"), line("verify_ms")
    out = []
    for tp in (1, 2, 4, 8):
        sims = {p: simulate([new_tokens] * batch, slots=batch, k=k, alpha=seq["acceptance"], draft_seconds=draft_ms,
                            verify_seconds=lambda b: verify_ms(b) / tp, pipeline=p) for p in (False, True)}
        out.append({"target_tp": tp, "draft_ms (batch, half)": f"{draft_ms(batch):.3g}, {draft_ms(batch // 2):.3g}",
                    "verify_ms (batch, half)": f"{verify_ms(batch) / tp:.3g}, {verify_ms(batch // 2) / tp:.3g}",
                    "sequential_tok_s": 1e3 * sims[False].tokens_per_second,
                    "pipelined_tok_s": 1e3 * sims[True].tokens_per_second,
                    "pipelined_vs_sequential": sims[True].tokens_per_second / sims[False].tokens_per_second})
    return out


COLUMNS = ["threads", "config", "tok_s", "wall_ms_per_verify", "draft_ms", "verify_ms", "overlap", "ideal_overlap",
           "sim_ms_per_verify", "steps", "acceptance", "same_output"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", default=["multi", "single"], choices=sorted(FLAGS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="mesh_sweep")
    add_out_argument(parser)
    parser.add_argument("--part-output", help=argparse.SUPPRESS)
    parser.add_argument("--from-json", help="rewrite the report from a saved <name>.json instead of measuring")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            report(json.load(f)["rows"], args)
        return
    if args.part_output:   # a child process: one thread setting, flags already in the environment
        rows = run_part(args)
        with open(args.part_output, "w") as f:
            json.dump(rows, f)
        return
    rows = []
    for threads in args.threads:
        out = f"/tmp/mesh_sweep_{threads}_{os.getpid()}.json"
        env = {**os.environ, "XLA_FLAGS": FLAGS[threads], "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, __file__, "--threads", threads, "--batch", str(args.batch), "--k", str(args.k),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--part-output", out]
        start = time.perf_counter()
        subprocess.run(cmd, env=env, check=True)
        print(f"{threads}: {time.perf_counter() - start:.0f} s", flush=True)
        with open(out) as f:
            rows += json.load(f)
    report(rows, args)


def report(rows, args) -> None:
    rows = [{key: v for key, v in r.items() if not (isinstance(v, float) and math.isnan(v))} for r in rows]
    for r in rows:
        if "verify_ms" not in r:
            r.pop("ideal_overlap", None)

    sims = {t: what_if([r for r in rows if r["threads"] == t], args.k, args.batch, args.new_tokens)
            for t in args.threads}
    m = machine()
    md = [f"Random layer-skip pair `sweep-8L` (8 layers, hidden 256; the draft is its first 2 layers), k={args.k}, "
          f"batch {args.batch}, greedy, {args.new_tokens} new tokens, median of {args.repeats} timed runs after "
          f"warm-up, 8 virtual CPU devices on {m['cpu_count']} cores ({m['processor']}, jax {m['jax']}). "
          "`wall_ms_per_verify`: wall time over verifications (a pipelined step verifies one of the two "
          "batches); `draft_ms` / `verify_ms`: one call of each, timed alone; `overlap` = wall / (draft + "
          "verify); `ideal_overlap` = max / sum for pipelined rows; `sim_ms_per_verify`: the discrete-event "
          "simulation fed with the measured draft and verify times.", "", table(rows, COLUMNS), ""]
    for threads, sim_rows in sims.items():
        md += [f"What-if by simulation ({threads} threads): draft and verify times linear in a lane's rows "
               "through the tp1 measurements, the verify time divided by target_tp (ideal scaling, which this "
               "CPU does not show), the draft slice unchanged. Assumptions, not measurements:", "",
               table(sim_rows), ""]
    md.append(f"![mesh sweep]({args.name}.png)")
    text = "\n".join(md)
    print("\n" + text)
    write_results(out_dir(args) / args.name, {"args": vars(args), "rows": rows, "what_if": sims}, text)
    plot(rows, out_dir(args) / f"{args.name}.png")


def plot(rows, path) -> None:
    plt = pyplot()
    sliced = [r for r in rows if "verify_ms" in r]
    labels = [f"{r['config']}\n({r['threads']})" for r in sliced]
    y = np.arange(len(sliced))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(sliced) + 1.5))
    ax.barh(y - 0.2, [r["draft_ms"] + r["verify_ms"] for r in sliced], 0.4, label="draft + verify (serial)",
            color="#bbbbbb")
    ax.barh(y + 0.2, [r["wall_ms_per_verify"] for r in sliced], 0.4, label="measured wall per verification",
            color="#1f77b4")
    ax.scatter([max(r["draft_ms"], r["verify_ms"]) for r in sliced], y + 0.2, marker="|", s=200, color="k",
               label="max(draft, verify)", zorder=3)
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.set_title("Two-slice configurations: step time vs the serial sum")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
