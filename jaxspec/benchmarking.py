"""Helpers shared by the benchmark scripts: machine description, timing, tables, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

RESULTS_DIR = Path(__file__).resolve().parents[1] / "docs" / "results"


def machine() -> dict[str, Any]:
    """Where a measurement was taken (written next to every result)."""
    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def timed(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> tuple[float, Any]:
    """Median wall time of fn() after warm-up; fn must block on its own results."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub-markdown table of dict rows (floats to 3 significant digits)."""
    columns = list(columns or rows[0].keys())

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def write_results(name: str, payload: dict[str, Any], markdown: str | None = None) -> Path:
    """Writes docs/results/<name>.json (and <name>.md when given); returns the JSON path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), **payload}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    if markdown is not None:
        (RESULTS_DIR / f"{name}.md").write_text(markdown + "\n")
    return path
