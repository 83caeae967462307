"""Step anatomy: the kernels one compiled decode step runs, their time, and the step's time against
reading its bytes at the device's measured bandwidth (`scripts/step_profile.py`).

The step is the engine's own: a plain (k = 0) or speculative step inside the device loop, timed
by `engine.timing`. A `jax.profiler` trace of a loop of such steps gives each kernel's time (trace
events name the HLO instruction they ran, `hlo_op`); the compiled program's text gives each
instruction's opcode, fusion kind and the JAX operation it came from, so kernel time is summed by
category and the costliest kernels are named by their source.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.drafting import NgramDrafter
from jaxspec.engine import timing
from jaxspec.models.model import Model

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_CONTROL = {"while", "conditional", "call", "parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def hlo_instructions(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """{instruction name: (category, the JAX source scope it came from, output shape)} of a
    compiled program. An instruction without source metadata (the body of a wrapped kernel) takes
    its caller's, where that has one."""
    parsed, computation, callers = {}, "", {}
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and "=" not in line.split("(")[0]:
            computation = header.group(1)
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, opcode, rest = match.groups()
        for called in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rest):
            callers[called] = name
        kind = re.search(r"kind=(k\w+)", rest)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        source = re.search(r'op_name="([^"]+)"', rest)
        scopes = [p for p in source.group(1).split("/") if not p.startswith(("jit(", "while", "body", "cond"))] \
            if source else []
        parsed[name] = (opcode, kind.group(1) if kind else "", target.group(1) if target else "",
                        "/".join(scopes), computation, re.sub(r"\{[^}]*\}", "", shape))
    with_dot = {comp for opcode, *_, comp, _ in parsed.values() if opcode in ("dot", "convolution")}
    out = {}
    for name, (opcode, kind, target, source, computation, shape) in parsed.items():
        caller = callers.get(computation)
        if not source and caller in parsed:
            source = parsed[caller][3]
        scopes = source.split("/")
        # A fusion around a dot (YNN's, a dot with its transpose) is a matmul.
        calls = [c for c, n in callers.items() if n == name]
        cat = "matmul" if opcode == "fusion" and with_dot.intersection(calls) else \
            category(opcode, kind, target, f"{name} {source}")
        out[name] = (cat, "/".join(scopes[-3:]), shape)
    return out


COMPONENTS = ("projections", "attention", "cache write", "LM head", "sampling / acceptance", "other")


def component(category: str, source: str, shape: str, vocab: int) -> str:
    """Which part of a decode step a kernel belongs to, from its category, JAX source scope and
    output shape: the layers' weight matrices, attention over the cache, the cache write, the LM
    head (also a product as wide as the vocabulary), sampling and acceptance, or the rest (norms,
    rotary embedding, gathers, the loop's bookkeeping)."""
    if "lm_head" in source or (category == "matmul" and re.search(rf"\b{vocab}\b", shape)):
        return "LM head"
    if "attention" in source:
        return "attention"
    if category == "matmul":
        return "projections"
    if category == "cache write / scatter":
        return "cache write"
    if re.search(r"accept|sampl|draw|greedy|verify|emit", source):
        return "sampling / acceptance"
    return "other"


def category(opcode: str, kind: str, target: str, name: str) -> str:
    """A kernel's kind in words: matmul, cache write, copy, a fusion's kind, or the opcode."""
    if opcode in _CONTROL:
        return "control"
    if opcode in ("dot", "convolution") or re.search(r"gemm|cublas|matmul|dot", target + name):
        return "matmul"
    if opcode in ("dynamic-update-slice", "scatter") or re.search(r"dynamic.update.slice|scatter", name):
        return "cache write / scatter"
    if opcode == "copy" or name.startswith("copy"):
        return "copy"
    if opcode == "fusion":
        return {"kLoop": "elementwise fusion", "kInput": "reduction fusion", "kOutput": "output fusion"}.get(
            kind, "fusion")
    return opcode


def trace_kernels(run, calls: int) -> dict[str, tuple[float, int]]:
    """{HLO instruction: (seconds, runs) per call} over a `jax.profiler` trace of `run()`, which
    runs the program `calls` times (or a loop of `calls` steps)."""
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
        if not files:
            return {}
        with gzip.open(files[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    for event in events:
        op = (event.get("args") or {}).get("hlo_op")
        if event.get("ph") == "X" and op:
            totals[op][0] += event.get("dur", 0.0) * 1e-6
            totals[op][1] += 1
    return {op: (seconds / calls, count / calls) for op, (seconds, count) in totals.items()}


def read_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> dict[str, float]:
    """Bytes per second the device moves: a copy (bytes read + written over the time) and a
    matrix-vector product over an `nbytes` float32 matrix (bytes read). A GPU copies at close to
    its peak; XLA's CPU backend copies on one thread, but reads a matrix on every core."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    w = x.reshape(-1, 4096)
    v = jnp.ones((1, w.shape[0]), jnp.float32)
    rates = {}
    for name, fn, args, moved in (("copy", lambda x: x * 2.0, (x,), 2 * x.nbytes),
                                  ("matvec", lambda v, w: v @ w, (v, w), w.nbytes)):
        fn = jax.jit(fn)
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        rates[name] = moved / float(np.median(times))
    return rates


def step_bytes(model: Model, batch: int, context: int) -> dict[str, int]:
    """Bytes a decode step must read: every weight but the embedding table (a step gathers `batch`
    rows of it, unless it is also the LM head) and the live part of the KV cache."""
    cfg = model.config
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    if not cfg.tie_word_embeddings:
        weights -= model.params["embed_vd"].nbytes
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.resolved_head_dim * model.dtype.itemsize
    return {"weights": int(weights), "kv_cache": int(batch * context * per_token)}


def profile_step(model: Model, batch: int, context: int, *, k: int = 0, drafter=None, steps: int = 8,
                 bandwidth: float | None = None, top: int = 8) -> dict:
    """The anatomy of one decode step over `batch` rows at about `context` tokens of context.

    Args:
      model: the target.
      batch, context: rows and prompt tokens per row.
      k: draft tokens per step (0: plain decoding); drafts come from `drafter` (n-gram lookup by
        default, which costs next to nothing).
      steps: steps per timed / traced loop.
      bandwidth: bytes/s to judge the step against (when None, the faster of `read_bandwidth`'s).
      top: how many of the costliest kernels to name.
    """
    drafter = drafter if drafter is not None else NgramDrafter().bind_vocab(model.config.vocab_size)
    cache_len = timing.cache_len_for(context, k, steps)
    run = timing.step_timer(model, drafter, k, batch, cache_len, iterations=steps, seed=0)
    run(steps)
    step_s = timing.time_steps(model, drafter, k, batch, cache_len, iterations=steps)
    kernels = trace_kernels(lambda: run(steps), steps)
    names = hlo_instructions(run.hlo_text(steps))
    by_category: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0])
    rows = []
    by_component = dict.fromkeys(COMPONENTS, 0.0)
    for op, (seconds, count) in kernels.items():
        cat, source, shape = names.get(op) or names.get(op.lower(), ("?", "", ""))
        if cat == "control" or op.lower().startswith("while"):   # a loop's event spans its body's
            continue
        by_category[cat][0] += seconds
        by_category[cat][1] += count
        by_component[component(cat, source, shape, model.config.vocab_size)] += seconds * 1e3
        rows.append({"kernel": op, "category": cat, "source": source, "shape": shape, "us": seconds * 1e6,
                     "runs": count})
    rows.sort(key=lambda r: -r["us"])
    nbytes = step_bytes(model, batch, context)
    bandwidth = max(read_bandwidth().values()) if bandwidth is None else bandwidth
    floor_s = sum(nbytes.values()) / bandwidth
    return {"model": model.config.name, "dtype": model.dtype.name, "quantization": model.quantization,
            "batch": batch, "context": context, "k": k, "step_ms": step_s * 1e3,
            "kernels_per_step": sum(c for _, c in by_category.values()),
            "kernel_ms": sum(s for s, _ in by_category.values()) * 1e3,
            "by_category": {c: {"ms": s * 1e3, "kernels": n} for c, (s, n) in
                            sorted(by_category.items(), key=lambda kv: -kv[1][0])},
            "by_component": by_component, "top_kernels": rows[:top], "bytes": nbytes, "bandwidth_gb_s": bandwidth / 1e9,
            "floor_ms": floor_s * 1e3, "bandwidth_fraction": floor_s / step_s}


def transformers_step_anatomy(model, batch: int, context: int, width: int = 1, repeats: int = 5) -> dict:
    """The same anatomy for a transformers causal LM: one forward of `width` tokens per row over a KV
    cache of `context` tokens in `batch` rows (a plain step: width 1; a verification: k + 1),
    timed alone (median of `repeats`), then its operators' self time under `torch.profiler` summed
    into `COMPONENTS`: matrix products (`aten::mm` / `addmm`, the LM head by its vocabulary-wide
    output), `scaled_dot_product_attention`, the cache's concatenation (`aten::cat`), argmax, and
    what is left of the profiled steps' time as other."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cache = model(torch.randint(0, vocab, (batch, context), generator=gen), use_cache=True).cache
        x = torch.randint(0, vocab, (batch, width), generator=gen)

        def step():
            out = model(x, cache=cache, use_cache=True).logits.argmax(-1)
            cache.crop(-width)
            return out

        step()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            start = time.perf_counter()
            for _ in range(repeats):
                step()
            profiled_ms = (time.perf_counter() - start) * 1e3 / repeats
    parts = dict.fromkeys(COMPONENTS, 0.0)
    for e in prof.key_averages(group_by_input_shape=True):
        ms = e.self_cpu_time_total / 1e3 / repeats
        if e.key in ("aten::mm", "aten::addmm"):
            out_dim = (e.input_shapes[-1] or [0, 0])[-1]
            parts["LM head" if out_dim == vocab else "projections"] += ms
        elif re.search(r"scaled_dot_product|flash_attention|aten::bmm|softmax", e.key):
            parts["attention"] += ms
        elif e.key == "aten::cat":
            parts["cache write"] += ms
        elif e.key in ("aten::argmax", "aten::max"):
            parts["sampling / acceptance"] += ms
    parts["other"] = max(profiled_ms - sum(parts.values()), 0.0)
    return {"batch": batch, "context": context, "width": width, "step_ms": float(np.median(times)) * 1e3,
            "profiled_step_ms": profiled_ms, "by_component": parts,
            "threads": torch.get_num_threads()}
