"""The device check: what a short GPU lease should measure, in order, each section only if it can
end before the deadline, results written after every section (`scripts/device_check.sh` runs it).

Sections, in this order, at the qwen2.5-1.5b shape in bfloat16 with random weights (`--cpu-smoke`:
a tiny shape):
  engine        the segment engine (S decode steps per device program) under each XLA flag set of
                ENGINE_FLAGS, each in its own process (`--engine-worker`: XLA_FLAGS is read once):
                plain, the speculative section's pair at k = 1, 2, 4 with S = 2 (and S = 1, 4 at k = 2,
                batch 1) and a random EAGLE-3 head at k = 2 (its step cost), batch 1 and 16; under 4
                minutes in all (the previous loop, the baseline, is no longer in the code).
  step_profile  the decode step's anatomy and bandwidth fraction (`jaxspec.tools.profiling`) at batch
                1 / 8 / 32, bfloat16 and int8 weights; a 4-token verification against one token.
  attention     the attention paths (`attention.ATTENTION`: plain, blocked, XLA's SDPA, cuDNN) in a
                4-layer model of that shape at batch 8, with 256 and 3,800 of 4,096 cache slots live
                (which path "auto" should pick on a GPU).
  speculative   plain against speculative decoding (draft model k = 1, 2, 4) at batch 1 and 16,
                greedy, with the qwen2.5-0.5b-shaped draft of `benchmarking.skeleton_pair`: every
                layer of both damped so the draft agrees with the target about 3 times in 4
                (acceptance is reported; outputs checked token for token).
  xla_options   XLA settings for the decode loop at batch 1 (command buffers over the whole loop,
                no dot merging, autotuning off), each compiled once: compile seconds and step time;
                and the loop's compile time at 1/4, 1/2 and all of the layers (unrolled blocks).
  eagle_head    one EAGLE-3 head draft step against a one-token target step (batch 1).
  tetris        `tetris.select` at N = 64, K = 8; packed against padded verification at batch 64.
  trees         draft trees against chains with the speculative section's pair at batch 1 and 16:
                at 4 and at 8 verified drafts per row, the chain, the TETRIS chain (+2 drafted, the
                batch's N * k best verified) and a tree per row and with the batch's N * k best
                nodes (4x2, 6x2 at 8); tokens per pass and tokens/s.

    python scripts/device_check.py [--cpu-smoke] [--out docs/results/gpu] [--deadline 420]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from bench_attention import attention_rows
from bench_eagle import head_step_fraction
from bench_tetris import packed_rows, select_seconds
from checkout import RESULTS

import jaxspec
from jaxspec.drafting import NgramDrafter
from jaxspec.engine import timing
from jaxspec.tools import profiling
from jaxspec.tools.benchmarking import machine, prompt_sets, round_robin, skeleton_pair, table, write_results

# In order of importance: a short lease runs the first ones.
SECTIONS = ("engine", "step_profile", "attention", "speculative", "trees", "xla_options", "eagle_head", "tetris")
STEPS = 8   # decode steps per timed / traced loop
_GRAPHS = "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,CONDITIONAL,DYNAMIC_SLICE_FUSION"   # XLA's default set
OPTIONS = {"gpu": {"default": {},
                   "graphs_over_while": {"xla_gpu_enable_command_buffer": _GRAPHS + ",WHILE",
                                         "xla_gpu_graph_min_graph_size": 1},
                   "no_dot_merger": {"xla_gpu_dot_merger_threshold_mb": 0},
                   "autotune_0": {"xla_gpu_autotune_level": 0}},
           "cpu": {"default": {}, "opt_level_1": {"xla_backend_optimization_level": 1}}}
# The engine section's XLA_FLAGS sets (added to the environment's). The CPU jaxlib accepts these
# GPU flags (an unknown one would abort at import), so the smoke run uses the same three.
_WHILE_GRAPHS = "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_graph_min_graph_size=1"
ENGINE_FLAGS = {"default": "", "graphs": _WHILE_GRAPHS,
                "graphs_unrolled": _WHILE_GRAPHS + " --xla_gpu_command_buffer_unroll_loops=true"}


def shapes(smoke: bool) -> dict:
    if smoke:
        tiny = jaxspec.ModelConfig.preset("tiny")
        return {"target": tiny, "draft": tiny.replace(num_layers=1, name="tiny-1L"), "batches": [2],
                "context": 32, "select": (16, 8), "packed": [8], "spec_batches": [2], "ks": [2],
                "trees": [(2, 2, 2)], "tree_chains": False, "new_tokens": 16, "rounds": 1, "bandwidth_bytes": 1 << 24,
                "int8_verify": False, "attention": (2, 2, 128, [16, 96]), "smoke": True, "engine_s": 600,
                "engine_all_rows": ("default",)}   # the other flag sets: plain and k = 2 (S = 2) alone
    return {"target": jaxspec.ModelConfig.preset("qwen2.5-1.5b"), "draft": jaxspec.ModelConfig.preset("qwen2.5-0.5b"),
            "batches": [1, 8, 32], "context": 256, "select": (64, 8), "packed": [64], "spec_batches": [1, 16],
            "ks": [1, 2, 4], "trees": [(4, 2, 4), (6, 2, 8)], "tree_chains": True, "new_tokens": 64, "rounds": 3,
            "bandwidth_bytes": 1 << 30, "int8_verify": True,
            "attention": (4, 8, 4096, [256, 3800]),   # layers, batch, slots, live
            "smoke": False, "engine_s": 210, "engine_all_rows": tuple(ENGINE_FLAGS)}   # (seconds: all flag sets)


def step_profile(target, s, out: dict, before_deadline) -> None:
    bandwidth = profiling.read_bandwidth(nbytes=s["bandwidth_bytes"])
    out["bandwidth_gb_s"] = {k: v / 1e9 for k, v in bandwidth.items()}
    rows = out.setdefault("rows", [])
    for model in (target, target.quantize("int8")):
        configs = [(b, 0) for b in s["batches"]] + ([(1, 3)] if s["int8_verify"] or not model.quantization else [])
        # Every configuration's programs compile side by side first (about 18 s each at this shape).
        drafter = NgramDrafter().bind_vocab(model.config.vocab_size)
        timing.side_by_side([functools.partial(timing.step_timer, model, drafter, k, b,
                                               timing.cache_len_for(s["context"], k, STEPS), iterations=STEPS, seed=0)
                             for b, k in configs])
        for batch, k in configs:
            if not before_deadline():
                out.setdefault("skipped", []).append(f"{model.quantization or 'bf16'} b{batch} k{k}")
                continue
            r = profiling.profile_step(model, batch, s["context"], k=k, steps=STEPS, bandwidth=max(bandwidth.values()))
            plain = next((x["step_ms"] for x in rows if x["batch"] == batch and x["k"] == 0
                          and x["quantization"] == model.quantization), None)
            r["vs_k0"] = 1.0 if k == 0 else r["step_ms"] / plain if plain else None
            rows.append(r)
            print(f"{model.quantization or model.dtype.name} batch {batch} k {k}: {r['step_ms']:.3f} ms, "
                  f"{r['kernels_per_step']:.0f} kernels, bandwidth fraction {r['bandwidth_fraction']:.2f}", flush=True)
        jax.clear_caches()


def attention(target, s, out: dict, before_deadline) -> None:
    layers, batch, slots, contexts = s["attention"]
    model = jaxspec.Model.random(s["target"].replace(num_layers=layers), seed=0, dtype="bfloat16")
    out["rows"] = attention_rows(model, batch, slots, contexts, s["rounds"], before_deadline)
    print(table(out["rows"]), flush=True)


def _compiled(run) -> float:
    """Seconds to compile `run`'s program (its first call, less a call's run time)."""
    began = time.perf_counter()
    run(1)
    return time.perf_counter() - began - run(1)


def xla_options(target, s, out: dict, before_deadline) -> None:
    drafter = NgramDrafter().bind_vocab(target.config.vocab_size)
    cache_len = timing.cache_len_for(s["context"], 0, STEPS)
    timers, rows = {}, out.setdefault("rows", [])
    for name, options in OPTIONS["gpu" if jax.default_backend() == "gpu" else "cpu"].items():
        if not before_deadline():
            out.setdefault("skipped", []).append(name)
            continue
        run = timing.step_timer(target, drafter, 0, 1, cache_len, iterations=STEPS, seed=0,
                                 compiler_options=options)
        try:
            rows.append({"options": name, "compile_s": round(_compiled(run), 2)})
            timers[name] = run
        except Exception as e:   # a flag this XLA does not know: recorded, not fatal
            rows.append({"options": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
    seconds = {name: [] for name in timers}
    for _ in range(s["rounds"]):
        for name, run in timers.items():
            seconds[name].append((run(1 + STEPS) - run(1)) / STEPS)
    for row in rows:
        if row["options"] in seconds:
            row["step_ms"] = round(1e3 * float(np.median(seconds[row["options"]])), 3)
            row["vs_default"] = round(float(np.median(seconds[row["options"]])) / np.median(seconds["default"]), 3)
    layers = target.config.num_layers
    out["compile_s_by_layers"] = {layers: rows[0].get("compile_s")}
    for n in sorted({max(1, layers // 4), max(1, layers // 2)} - {layers}):
        if before_deadline():
            model = jaxspec.Model.random(target.config.replace(num_layers=n), seed=0, dtype="bfloat16")
            timer = timing.step_timer(model, drafter, 0, 1, cache_len, iterations=STEPS, seed=0)
            out["compile_s_by_layers"][n] = round(_compiled(timer), 2)
    print(table(rows), out["compile_s_by_layers"], flush=True)


def eagle_head(target, s, out: dict, before_deadline) -> None:
    head = jaxspec.EagleHead.init(target, seed=0)
    out["head_step_over_target_step"] = head_step_fraction(target, head)


def tetris_section(target, s, out: dict, before_deadline) -> None:
    n, k = s["select"]
    out["select_us"] = {f"N={n} K={k} C={n * c}": 1e6 * select_seconds(n, k, n * c) for c in (1, 2, 4)}
    out["packed"] = packed_rows(target, s["packed"], repeats=3, capacities=(0.5, 1, 2))


def speculative(target, s, out: dict, before_deadline, trees: bool = False) -> None:
    target, draft = skeleton_pair(s["target"], s["draft"], damping=7e-4, sharpness=6.0, dtype="bfloat16")
    rows = out.setdefault("rows", [])
    specs = {f"k={k}": jaxspec.SpecConfig(k=k) for k in s["ks"]}
    if trees:
        specs = {}
        for d, w, k in s["trees"]:
            if s["tree_chains"]:   # (the smoke run leaves the chains to the speculative section)
                specs |= {f"k={k}": jaxspec.SpecConfig(k=k),
                          f"k={k} TETRIS +2": jaxspec.SpecConfig(k=k, extra=2, selection="tetris")}
            specs |= {f"tree {d}x{w} k={k}": jaxspec.SpecConfig(k=k, tree=(d, w)),
                      f"tree {d}x{w} k={k} TETRIS": jaxspec.SpecConfig(k=k, tree=(d, w), selection="tetris")}
    for batch in s["spec_batches"]:
        if not before_deadline():
            out.setdefault("skipped", []).append(f"batch {batch}")
            continue
        prompts = prompt_sets(s["target"].vocab_size, batch, 1)[0]
        fns = {"autoregressive": lambda on_finish: jaxspec.generate(target, prompts, max_new_tokens=s["new_tokens"])}
        for label, spec in specs.items():
            decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec)
            fns[label] = lambda on_finish, d=decoder: d.generate(prompts, max_new_tokens=s["new_tokens"],
                                                                 on_finish=on_finish)
        timing.side_by_side([functools.partial(fn, None) for fn in fns.values()])   # compiles side by side
        results, seconds, _ = round_robin(fns, s["rounds"])
        for label, res in results.items():
            rows.append({"batch": batch, "method": label,
                         "tok_s": batch * s["new_tokens"] / float(np.median(seconds[label])),
                         "vs_ar": float(np.median(seconds["autoregressive"] / seconds[label])),
                         "tokens_per_pass": None if label == "autoregressive" else res.stats.mean_accepted_length,
                         "acceptance": None if label == "autoregressive" else res.stats.acceptance_rate,
                         "same_output": res.tokens == results["autoregressive"].tokens})
        print(table(rows[-len(fns):]), flush=True)
        jax.clear_caches()


def engine(target, s, out: dict, before_deadline, ends_at: float = float("inf")) -> None:
    """Each flag set of ENGINE_FLAGS in a worker process of this script, given an equal share of
    the time left; its rows (or why it has none) merged here."""
    out["note"] = "The previous loop (a data-dependent while) is gone from this engine: no baseline."
    rows, skipped = out.setdefault("rows", []), out.setdefault("skipped", [])
    ends_at = min(ends_at, time.time() + s["engine_s"])
    for i, (name, flags) in enumerate(ENGINE_FLAGS.items()):
        share = (ends_at - time.time()) / (len(ENGINE_FLAGS) - i)
        if share < 10:
            skipped.append(f"{name}: past the deadline")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "engine.json"   # written after compiling and after timing
            env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip(),
                   "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2"}   # this process holds 75% of a GPU's memory
            cmd = [sys.executable, str(Path(__file__).resolve()), "--engine-worker", name, "--out", str(path),
                   "--deadline", str(share)] + ["--cpu-smoke"] * s["smoke"]
            try:   # the worker's stdout goes to this one's
                proc = subprocess.run(cmd, env=env, timeout=share + 20, stderr=subprocess.PIPE, text=True)
                last_line = (proc.stderr.strip() or "?").splitlines()[-1][:300]
                error = proc.returncode and f"exit {proc.returncode}: {last_line}"
            except subprocess.TimeoutExpired:
                error = f"killed after {share + 20:.0f} s"
            got = json.loads(path.read_text()) if path.exists() else {}
        rows += got.get("rows", [])
        skipped += got.get("skipped", [])
        if error:
            print(f"engine {name}: {error}", flush=True)
            rows.append({"flags": name, "error": error})


def _engine_fns(target, draft, s, all_rows: bool) -> dict:
    """(batch, method, S) -> fn(on_finish), the most telling first (a deadline cuts the tail): plain
    and k = 2 with the GPU's default S = 2 at each batch; then (`all_rows`) k = 2 with S = 1 and 4 at
    the first batch, the EAGLE head at k = 2 and the other k. Plain's S is the default; decoders are
    built on first use."""
    batches, n = s["spec_batches"], s["new_tokens"]
    prompts = {b: prompt_sets(s["target"].vocab_size, b, 1)[0] for b in batches}
    head = functools.cache(lambda: jaxspec.EagleHead.init(target, seed=0))   # random: acceptance ~0

    def spec(k, steps, eagle=False):
        return lambda: jaxspec.SpeculativeDecoder(target, jaxspec.EagleDrafter(head()) if eagle else draft,
                                                  jaxspec.SpecConfig(k=k, segment=steps))
    plan = [(b, "k=2", 2, spec(2, 2)) for b in batches]
    if all_rows:
        plan += [(batches[0], "k=2", steps, spec(2, steps)) for steps in (1, 4)]
        plan += [(b, "eagle k=2", 2, spec(2, 2, True)) for b in batches]
        plan += [(b, f"k={k}", 2, spec(k, 2)) for k in s["ks"] if k != 2 for b in batches]
    fns = {(b, "autoregressive", jaxspec.SpecConfig().segment_steps()):
           lambda on_finish, b=b: jaxspec.generate(target, prompts[b], max_new_tokens=n) for b in batches}
    for b, method, steps, make in plan:
        def fn(on_finish, b=b, make=make, built={}):
            if not built:   # built when first run, so that an error there is the row's
                built["decoder"] = make()
            return built["decoder"].generate(prompts[b], max_new_tokens=n, on_finish=on_finish)
        fns[b, method, steps] = fn
    return fns


def engine_worker(name: str, s, seconds: float, path: str) -> None:
    """One flag set's rows (this process's XLA_FLAGS) into `path`: each configuration compiled (run
    once) while twice the last one's time still fits in `seconds`, then all timed round-robin."""
    ends_at, last, errors, skipped = time.time() + seconds, [0.0], {}, []
    target, draft = skeleton_pair(s["target"], s["draft"], damping=7e-4, sharpness=6.0, dtype="bfloat16")
    fns = _engine_fns(target, draft, s, all_rows=name in s["engine_all_rows"])

    def warm(key):
        if time.time() + 2 * last[0] > ends_at:
            return skipped.append(key)
        began = time.time()
        try:
            fns[key](None)
        except Exception as e:   # an engine mid-rewrite, or a flag set's failure: a row, not fatal
            errors[key] = f"{type(e).__name__}: {str(e)[:200]}"
        last[0] = time.time() - began
    timing.side_by_side([functools.partial(warm, key) for key in fns])   # in turn on a GPU
    out = {"rows": [{"flags": name, "batch": b, "method": m, "S": st, "error": e} for (b, m, st), e in errors.items()],
           "skipped": [f"{name}: batch {b} {m} S={st}" for b, m, st in skipped]}
    Path(path).write_text(json.dumps(out))
    fns = {key: fn for key, fn in fns.items() if key not in errors and key not in skipped}
    results, seconds_by, _ = round_robin(fns, s["rounds"]) if fns else ({}, {}, None)
    for (b, method, steps), res in sorted(results.items(), key=lambda kv: kv[0][0]):
        plain = next((key for key in results if key[:2] == (b, "autoregressive")), None)
        spec = method != "autoregressive"
        out["rows"].append({"flags": name, "batch": b, "method": method, "S": steps,
                            "tok_s": b * s["new_tokens"] / float(np.median(seconds_by[b, method, steps])),
                            "vs_ar": plain and float(np.median(seconds_by[plain] / seconds_by[b, method, steps])),
                            "tokens_per_pass": res.stats.mean_accepted_length if spec else None,
                            "acceptance": res.stats.acceptance_rate if spec else None,
                            "masked": res.stats.extra.get("masked"),
                            "same_output": plain and res.tokens == results[plain].tokens})
    Path(path).write_text(json.dumps(out))
    if out["rows"]:
        print(table(out["rows"], list({k: 0 for r in out["rows"] for k in r})), flush=True)

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes: the whole script in about a minute on CPU")
    p.add_argument("--out", default=str(RESULTS / "gpu"))
    p.add_argument("--deadline", type=float, default=420.0, help="seconds: start nothing after this")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--engine-worker", metavar="FLAGS", help="(the engine section's worker: --out is its JSON file)")
    args = p.parse_args()
    start = time.time()
    s = shapes(args.cpu_smoke)
    if args.engine_worker:
        return engine_worker(args.engine_worker, s, args.deadline, args.out)
    device = re.sub(r"\W+", "_", jax.devices()[0].device_kind.lower()).strip("_")
    name = str(Path(args.out).resolve() / f"device_check_{device}")
    target = jaxspec.Model.random(s["target"], seed=0, dtype="bfloat16")
    report = {"args": vars(args), "shapes": {k: str(v) for k, v in s.items()}, "sections": {}, "seconds": {}}
    runs = {"engine": functools.partial(engine, ends_at=start + args.deadline), "step_profile": step_profile,
            "attention": attention, "xla_options": xla_options,
            "eagle_head": eagle_head, "tetris": tetris_section,
            "speculative": speculative, "trees": functools.partial(speculative, trees=True)}
    for section in args.sections:
        if time.time() - start > args.deadline:
            report["sections"][section] = "not run: past the deadline"
            continue
        began, out = time.time(), {}
        report["sections"][section] = out
        runs[section](target, s, out, lambda: time.time() - start < args.deadline)
        report["seconds"][section] = time.time() - began
        write_results(name, report, markdown(report))
        print(f"{section} done in {report['seconds'][section]:.0f} s", flush=True)
    print(markdown(report))


def markdown(report: dict) -> str:
    m, sec = machine(), report["sections"]
    parts = [f"Device check on {m['device_kind']} ({m['platform']}, jax {m['jax']}), shapes "
             f"{report['shapes']['target']}; random weights, bfloat16 (`scripts/device_check.py`). Section times (s): "
             + ", ".join(f"{k} {v:.0f}" for k, v in report["seconds"].items()) + "."]
    eng = sec.get("engine")
    if isinstance(eng, dict) and eng.get("rows"):
        parts += ["", f"Segment engine under each XLA flag set ({ENGINE_FLAGS}; skeleton pair and a random EAGLE-3 "
                  f"head, greedy; vs_ar within a flag set). {eng['note']}", "",
                  table(eng["rows"], list({k: 0 for r in eng["rows"] for k in r}))]
    prof = sec.get("step_profile")
    if isinstance(prof, dict) and prof.get("rows"):
        parts += ["", f"Step anatomy (copy / matvec bandwidth {prof['bandwidth_gb_s']}):", "", table([
            {"weights": r["quantization"] or r["dtype"], "batch": r["batch"], "k": r["k"],
             "step_ms": round(r["step_ms"], 3), "vs_k0": r["vs_k0"] and round(r["vs_k0"], 2),
             "kernels": round(r["kernels_per_step"]), "floor_ms": round(r["floor_ms"], 3),
             "bw_frac": round(r["bandwidth_fraction"], 3),
             "weight_MB": round(r["bytes"]["weights"] / 1e6, 3)} for r in prof["rows"]])]
    if isinstance(sec.get("attention"), dict) and sec["attention"].get("rows"):
        parts += ["", "Attention paths (decode step, bfloat16):", "", table(sec["attention"]["rows"])]
    xla = sec.get("xla_options")
    if isinstance(xla, dict) and xla.get("rows"):
        parts += ["", f"XLA options (batch 1; compile seconds by layers {xla.get('compile_s_by_layers')}):", "",
                  table(xla["rows"])]
    if isinstance(sec.get("eagle_head"), dict) and sec["eagle_head"]:
        fraction = sec["eagle_head"]["head_step_over_target_step"]
        parts += ["", f"EAGLE-3 head step / target step (batch 1): {fraction:.3f}"]
    tet = sec.get("tetris")
    if isinstance(tet, dict) and tet:
        parts += ["", f"tetris.select (µs): {tet['select_us']}", "", table(tet["packed"])]
    spec = sec.get("speculative")
    if isinstance(spec, dict) and spec.get("rows"):
        parts += ["", "Plain against speculative decoding (skeleton pair, greedy):", "", table(spec["rows"])]
    trees = sec.get("trees")
    if isinstance(trees, dict) and trees.get("rows"):
        parts += ["", "Draft trees against a chain (skeleton pair, greedy):", "", table(trees["rows"])]
    skipped = {k: v for k, v in sec.items() if isinstance(v, str) or (isinstance(v, dict) and v.get("skipped"))}
    if skipped:
        parts += ["", f"Not run (deadline): {skipped}"]
    return "\n".join(parts)


if __name__ == "__main__":
    main()
