"""What `jaxspec generate` says while it works and when it ends.

While it works: one line per stage on stderr (`Stages`), with the seconds since the first stage
(the target's loading) began, so a long model load is not silence. At the end: one summary row per process
(`summary`), with load time, compile and decode time, tokens per second over decoding, and the
requests' latency (median and 95th percentile of the seconds from handing the requests to the
decoder to each one's line being written: what a caller waiting on a request sees).
"""

from __future__ import annotations

import sys
import time

import numpy as np


class Stages:
    """Prints `jaxspec: [  12.3 s] loading target model.gguf` lines on stderr; `process`: this
    process's id in a multi-process job (named in each line), None in a single-process one."""

    def __init__(self, process: int | None = None):
        self.start = time.perf_counter()
        self.prefix = "jaxspec" if process is None else f"jaxspec[{process}]"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, what: str) -> None:
        print(f"{self.prefix}: [{self.elapsed():7.1f} s] {what}", file=sys.stderr, flush=True)


def compile_seconds(stats) -> float | None:
    """The engine's compile time of a call, where it reports it apart from decoding; None where it
    does not (then the summary shows compile and decode time together). The one place to change
    when `GenerationStats` reports it under another name."""
    value = getattr(stats, "compile_seconds", None)
    return None if value is None else float(value)


def latency(finished: list[float]) -> dict[str, float]:
    """Median and 95th percentile (linear interpolation) of the requests' finish times, in seconds."""
    if not finished:
        return {}
    p50, p95 = np.percentile(np.asarray(finished, np.float64), [50, 95])
    return {"latency_p50_s": float(p50), "latency_p95_s": float(p95)}


def summary(stats, load_s: float, run_s: float, finished: list[float]) -> dict:
    """One process's summary row: `stats` the decode call's GenerationStats, `load_s` the models'
    loading, `run_s` the decode call's wall time (compilation included), `finished` each request's
    finish time from the call's start."""
    compiled = compile_seconds(stats)
    row = {"new_tokens": stats.new_tokens, "load_s": load_s}
    if compiled is None:
        row["compile+decode_s"] = run_s
        decode = run_s
    else:
        decode = max(run_s - compiled, 1e-9)
        row.update(compile_s=compiled, decode_s=decode)
    row["tokens/s"] = stats.new_tokens / decode if decode > 0 else 0.0
    row.update(latency(finished))
    row.update({"acceptance": stats.acceptance_rate, "tokens/step": stats.mean_accepted_length})
    return row
