"""XLA:CPU matrix kernels chosen per compiled program, by measurement on the machine that decodes.

XLA:CPU runs a product of a few rows with one of several kernels (YNN's dot fusion, its own dot
emitter), and the fastest depends on the machine and the shape. So before an engine program
compiles on a CPU, `Probed` times each distinct matrix product of the lowered program under every
candidate in `CANDIDATES`, and compiles it with the options (its own `compiler_options`) whose
products take least in all, when that beats XLA's default by more than `MARGIN` (the noise).
Timings are kept per machine and product in `$JAXSPEC_CACHE_DIR/kernels.json` (`~/.cache/jaxspec`).

`JAXSPEC_KERNELS`: unset or "probe", the above on a CPU; "xla", XLA's defaults and no probe; a
candidate's name, that candidate for every program. Other backends always get XLA's defaults.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import platform
import re
import time
from pathlib import Path

import jax
import jaxlib
import numpy as np

# Name -> compiler options, sorted (jit's in-memory cache keys on their order). oneDNN's dot
# fusion (`xla_cpu_use_onednn`) is left out: on an AMD EPYC it compiled a decode step to an
# instruction that CPU lacks, and the process died of SIGILL, which no probe can catch.
CANDIDATES: dict[str, tuple] = {
    "xla": (),
    "dot": (("xla_cpu_experimental_ynn_fusion_type",   # XLA's own dot instead of YNN's dot fusion
             "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION,LIBRARY_FUSION_TYPE_REDUCE"),),
}
MARGIN = 0.15
ROUNDS = 5
_DOT = re.compile(r"stablehlo\.dot_general [^,]+, [^,]+, (.*?)precision.*?: \(tensor<([^>]+)>, tensor<([^>]+)>\)")
_CHOICES: dict[tuple, tuple] = {}   # (Probed, static arguments and shapes) -> options
DECISIONS: list[dict] = []   # each probed program: its name, product rows, candidate totals, choice


def mode() -> str:
    """The `JAXSPEC_KERNELS` setting, checked."""
    value = os.environ.get("JAXSPEC_KERNELS", "probe")
    if value != "probe" and value not in CANDIDATES:
        raise ValueError(f"JAXSPEC_KERNELS must be 'probe' or one of {list(CANDIDATES)}, got {value!r}")
    return value


class Probed:
    """`jax.jit(fn, **jit_args)` whose programs, on a CPU, compile with the options `choose` picks
    for them (once per static arguments and shapes)."""

    def __init__(self, fn, **jit_args):
        self._fn, self._jit_args = fn, jit_args
        self._jits: dict[tuple, object] = {}
        functools.update_wrapper(self, fn)

    def _jitted(self, options: tuple):
        if options not in self._jits:
            self._jits[options] = jax.jit(self._fn, compiler_options=dict(options) or None, **self._jit_args)
        return self._jits[options]

    def options(self, *args) -> tuple:
        """The compiler options of the program these arguments call."""
        setting = mode()
        if setting != "probe" or jax.default_backend() != "cpu":
            return CANDIDATES.get(setting, ()) if jax.default_backend() == "cpu" else ()
        # The static arguments and the shapes of all but the params (argument 1), which the
        # program implies: a key that is cheap per call, and at worst less exact than jit's own.
        key = tuple(getattr(x, "shape", x) for x in jax.tree.leaves((args[0], *args[2:])))
        if (self, key) not in _CHOICES:   # probing is compiling, to `GenerationStats.compile_seconds`
            start = time.time()
            _CHOICES[self, key] = choose(self._jitted(()).lower(*args).as_text(), self.__name__)
            jax.monitoring.record_event_time_span("/jaxspec/compile/kernel_probe", start, time.time())
        return _CHOICES[self, key]

    def __call__(self, *args):
        return self._jitted(self.options(*args))(*args)

    def lower(self, *args):
        return self._jitted(self.options(*args)).lower(*args)


def products(program_text: str) -> collections.Counter:
    """How often each matrix product (dimension numbers, lhs type, rhs type) occurs in a lowered program's text."""
    return collections.Counter((dims.strip(" ,"), lhs, rhs) for dims, lhs, rhs in _DOT.findall(program_text))


def choose(program_text: str, name: str = "") -> tuple:
    """The options of the candidate whose products, timed on this machine, take least in all;
    XLA's defaults unless that saves more than `MARGIN`."""
    found = products(program_text)
    totals = collections.Counter()
    for product, count in found.items():
        for candidate, seconds in _timings(product).items():
            totals[candidate] += count * seconds
    best = min(totals, key=totals.get, default="xla")
    if best != "xla" and totals[best] >= (1 - MARGIN) * totals["xla"]:
        best = "xla"
    rows = sorted({_parse(product)[2] for product in found})
    DECISIONS.append(dict(program=name, rows=rows, seconds=dict(totals), kernels=best))
    return CANDIDATES[best]


def _parse(product: tuple):
    """(dimension numbers, the two operands' (shape, dtype), the lhs's free size: its rows)."""
    dims, *types = product
    groups = [[int(a) for a in part.split(",") if a.strip()] for part in re.findall(r"\[([^\]]*)\]", dims)]
    batch = (groups[0], groups[1]) if len(groups) == 4 else ([], [])
    operands = [((*map(int, t.split("x")[:-1]),), t.split("x")[-1]) for t in types]
    lhs = operands[0][0]
    rows = int(np.prod([n for i, n in enumerate(lhs) if i not in groups[-2] + batch[0]]))
    return ((groups[-2], groups[-1]), batch), operands, rows


def _timings(product: tuple) -> dict[str, float]:
    """Seconds of one product under each candidate, from the cache file or measured now (the best
    of interleaved runs; candidates that compile to the same program share one timing)."""
    key, store = " ".join(product), _store()
    if key not in store:
        numbers, types, _ = _parse(product)
        operands = [jax.numpy.full(shape, 0.5, _DTYPES[dtype]) for shape, dtype in types]   # speed ignores values
        fn = jax.jit(functools.partial(jax.lax.dot_general, dimension_numbers=numbers))
        compiled = {name: fn.lower(*operands).compile(dict(options) or None) for name, options in CANDIDATES.items()}
        first = {}   # program text -> the first candidate that compiles to it
        same = {name: first.setdefault(c.as_text().split("\n", 1)[-1], name) for name, c in compiled.items()}
        best = {name: min(_seconds(compiled[name], operands) for _ in range(ROUNDS)) for name in set(same.values())}
        store[key] = {name: best[same[name]] for name in compiled}
        _save()
    return store[key]


_DTYPES = {"f32": np.float32, "bf16": jax.numpy.bfloat16, "f16": np.float16}


def _seconds(compiled, operands) -> float:
    """Seconds per call, from enough calls to last a few milliseconds."""
    jax.block_until_ready(compiled(*operands))
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            out = compiled(*operands)
        jax.block_until_ready(out)
        if (elapsed := time.perf_counter() - start) >= 0.005:
            return elapsed / calls
        calls *= 4


def cache_path() -> Path:
    return Path(os.environ.get("JAXSPEC_CACHE_DIR", Path.home() / ".cache" / "jaxspec")) / "kernels.json"


def machine_key() -> str:
    try:
        model = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        model = platform.processor()
    return f"{model} | {os.cpu_count()} cores | jaxlib {jaxlib.__version__} | {os.environ.get('XLA_FLAGS', '')}"


_FILE: dict = {}   # the cache file's contents, every machine's, once read


def _store() -> dict:
    """This machine's product timings: key -> {candidate: seconds}."""
    if not _FILE:
        with contextlib.suppress(OSError, ValueError):
            _FILE.update(json.loads(cache_path().read_text()))
    return _FILE.setdefault(machine_key(), {})


def _save() -> None:
    path = cache_path()
    with contextlib.suppress(OSError):   # a read-only home: the timings live for this process only
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(_FILE, indent=1, sort_keys=True))
        scratch.replace(path)
