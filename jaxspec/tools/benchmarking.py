"""Helpers shared by the benchmark scripts: machine description, timing, tables, JSON output, the
benchmarks' model pairs. Where results go is the caller's to say (`write_results`' path): the scripts
of a source checkout write into its docs/results."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.model import Model


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's `model name`, e.g. "AMD EPYC"); else the architecture."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor() or platform.machine())


def machine() -> dict[str, Any]:
    """Where a measurement was taken (written next to every result)."""
    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),   # e.g. XLA:CPU's thread settings
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


def finish_times(fn: Callable[[Callable | None], Any]) -> tuple[float, list[float], Any]:
    """Runs `fn(on_finish)` once; returns its wall time, each request's seconds from the call's
    start until it finished, and fn's GenerationResult.

    fn passes `on_finish` to `SpeculativeDecoder.generate`, which calls it on the host as each
    request finishes; requests it does not report (`jaxspec.generate` returns every row at once)
    finish at the end of the call.
    """
    finished: dict[int, float] = {}
    start = time.perf_counter()

    def on_finish(index, tokens, counters):
        finished[index] = time.perf_counter() - start

    result = fn(on_finish)
    seconds = time.perf_counter() - start
    return seconds, [finished.get(i, seconds) for i in range(len(result.tokens))], result


def round_robin(fns: dict[str, Callable[[Callable | None], Any]], rounds: int,
                before: Callable[[str], Any] | None = None):
    """Warms every configuration up (compiles), then times each once per round, in turn.

    This shared VM's speed drifts by tens of percent over minutes, so configurations are compared
    by ratios within a round (`np.median(seconds[a] / seconds[b])`), never across moments.
    `before(label)`, if given, runs before each call, untimed (e.g. `WeightParking.hold`).
    Returns (results, seconds, latencies): each configuration's last GenerationResult, its wall
    times, shape (rounds,), and its requests' finish times (`finish_times`), shape (rounds, requests).
    """
    def call(label):
        if before is not None:
            before(label)
        return finish_times(fns[label])

    results = {label: call(label)[2] for label in fns}
    seconds: dict[str, list[float]] = {label: [] for label in fns}
    latencies: dict[str, list[list[float]]] = {label: [] for label in fns}
    for _ in range(rounds):
        for label in fns:
            wall, finish, results[label] = call(label)
            seconds[label].append(wall)
            latencies[label].append(finish)
    return (results, {label: np.asarray(v) for label, v in seconds.items()},
            {label: np.asarray(v) for label, v in latencies.items()})


class WeightParking:
    """Keeps the weights of one group of models in memory at a time; the other groups' wait in
    files under `folder` (written on first parking, read back by `hold`). For timing two
    frameworks' copies of a pair in turn, in one process, on a machine that cannot hold both
    (Qwen2.5-Coder 1.5B + 0.5B in float32: 11 GB in jaxspec, 9 GB in torch, of 24 GB).

    A group (`add`) is a list of models, each a jaxspec `Model` (its `params` are dropped and
    restored; a decoder or drafter holding the model sees them again) or a torch module (its
    parameters' storage is dropped and restored). Call `hold` outside any timed region: it reads
    gigabytes.
    """

    def __init__(self, folder: str | os.PathLike, *, resident: bool = False):
        self.folder, self.resident = Path(folder), resident   # resident: never park (hold does nothing)
        self.groups: dict[str, list] = {}
        self.held: set[str] = set()
        self.treedefs: dict[str, Any] = {}
        self.swaps = 0   # groups restored from files

    def add(self, name: str, models: Sequence[Any]) -> None:
        """Registers a group of models, held in memory as they are."""
        self.groups[name] = list(models)
        self.held.add(name)

    def hold(self, name: str | None) -> None:
        """Makes group `name` the one in memory, parking the others (None: parks every group)."""
        if self.resident:
            return
        for other in sorted(self.held - {name}):
            for i, model in enumerate(self.groups[other]):
                self._park(f"{other}_{i}", model)
            self.held.discard(other)
        if name is not None and name not in self.held:
            for i, model in enumerate(self.groups[name]):
                self._restore(f"{name}_{i}", model)
            self.held.add(name)
            self.swaps += 1
        gc.collect()
        try:   # hand freed heap back to the system (glibc), so the next group has the room
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass

    def _park(self, key: str, model) -> None:
        folder = self.folder / key
        if isinstance(model, Model):
            leaves, self.treedefs[key] = jax.tree.flatten(model.params)
            if not folder.exists():
                folder.mkdir(parents=True)
                for j, leaf in enumerate(leaves):
                    np.save(folder / f"{j}.npy", np.asarray(leaf))
            del leaves
            model.params = None
            return
        import torch

        path = folder.with_suffix(".pt")
        if not path.exists():
            torch.save({n: p.detach() for n, p in model.named_parameters()}, path)
        for p in model.parameters():
            p.data = torch.empty(0, dtype=p.dtype)

    def _restore(self, key: str, model) -> None:
        if isinstance(model, Model):
            files = [self.folder / key / f"{j}.npy" for j in range(self.treedefs[key].num_leaves)]
            model.params = jax.tree.unflatten(self.treedefs[key], [jax.numpy.array(np.load(f)) for f in files])
            return
        import torch

        saved = torch.load(self.folder / f"{key}.pt", weights_only=True)
        for n, p in model.named_parameters():
            p.data = saved.pop(n)


def median_interval(samples, level: float = 0.9, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of `samples` (e.g. a configuration's ratio to
    another within each timed round): how far the reported median could move were the rounds
    drawn again, so a goal a few percent from the median can be read against the noise."""
    x = np.asarray(samples, np.float64).ravel()
    if x.size == 0 or not 0.0 < level < 1.0:
        raise ValueError(f"median_interval needs samples and a level in (0, 1), got {x.size} samples, {level!r}")
    draws = np.random.default_rng(seed).integers(0, x.size, (resamples, x.size))
    medians = np.median(x[draws], axis=1)
    tail = 100.0 * (1.0 - level) / 2.0
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100.0 - tail))


def heldout_best_ratios(seconds: dict[str, Sequence[float]], candidates: Sequence[str], label: str) -> np.ndarray:
    """Per round r: the time, in round r, of the candidate with the best median time over the
    other rounds, over `label`'s time in round r (leave-one-out).

    Picking the best of several configurations by their medians over the very rounds it is then
    compared on favours whichever drew fast noise: where several are within the noise, the pick's
    median is the maximum of noisy estimates, biased toward it by about one noise width, and every
    other method looks that much slower. Chosen without round r, the pick is what a user would
    have fixed in advance, and its ratio in round r is an unbiased sample of how `label` compares
    with it. `seconds`: each configuration's time per round (same rounds for all)."""
    if not candidates:
        raise ValueError("heldout_best_ratios needs at least one candidate")
    times = {name: np.asarray(seconds[name], np.float64) for name in (*candidates, label)}
    rounds = times[label].size
    if rounds < 2 or any(t.size != rounds for t in times.values()):
        raise ValueError(f"heldout_best_ratios needs at least 2 rounds, the same for every configuration; got "
                         f"{ {name: t.size for name, t in times.items()} }")
    ratios = np.empty(rounds)
    for r in range(rounds):
        others = np.arange(rounds) != r
        pick = min(candidates, key=lambda name: float(np.median(times[name][others])))
        ratios[r] = times[pick][r] / times[label][r]
    return ratios


def first_differences(reference: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]) -> list[int | None]:
    """Per row: None where `tokens` equals `reference`, else the first position where they part
    (the shorter length where one is a prefix of the other)."""
    return [None if list(r) == list(t) else
            next((j for j, (a, b) in enumerate(zip(r, t)) if a != b), min(len(r), len(t)))
            for r, t in zip(reference, tokens, strict=True)]


def transformers_gguf(path: str | os.PathLike, dtype: str = "float32"):
    """transformers' causal LM of a GGUF file (weights dequantised to `dtype`), in eval mode, with
    no eos token, so that its `generate` emits exactly max_new_tokens as jaxspec's does.
    Imports torch and transformers here: only the comparisons with transformers need them."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    return model.eval()


def transformers_step_seconds(model, context: Sequence[int], tokens: Sequence[int], repeats: int = 5) -> float:
    """Median seconds of one forward of `tokens` (one row) after `context` held in a KV cache: the
    cache is prefilled once and cropped back to the context after each timed forward, as a
    verification of len(tokens) tokens (or a plain decoding step, one token) would see it."""
    import torch

    times = []
    with torch.no_grad():
        cache = model(torch.tensor([list(context)]), use_cache=True).cache
        x = torch.tensor([list(tokens)])
        for _ in range(repeats + 1):   # the first: warm-up
            start = time.perf_counter()
            model(x, cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache.crop(-len(tokens))
        if cache.get_seq_length() != len(context):
            raise RuntimeError(f"the cache holds {cache.get_seq_length()} tokens after cropping, not {len(context)}")
    return statistics.median(times[1:])


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


def write_results(path: str | os.PathLike, payload: dict[str, Any], markdown: str | None = None) -> Path:
    """Writes `path`.json, the payload with the machine and the date (and `path`.md when given),
    creating the folder; returns the JSON path."""
    path = Path(f"{os.fspath(path)}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), **payload}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    if markdown is not None:
        path.with_suffix(".md").write_text(markdown + "\n")
    return path


def layer_skip_pair(config, *, draft_layers: int, damping: float, sharpness: float = 4.0, seed: int = 0):
    """A random target and a draft that is its own first `draft_layers` layers (a noisy copy).

    The target's deeper layers write into the residual stream scaled by `damping`, so they act as
    a perturbation the draft does not see: acceptance is high where the draft's choice is clear and
    low where its top tokens are close, and so varies across rows and positions as with trained
    pairs. `sharpness` scales the final norm so the output distributions are peaked rather than
    nearly flat (random weights). Returns (target, draft) sharing their weights.
    """
    base = Model.random(config, seed=seed)
    params = jax.tree.map(lambda x: x, base.params)
    params["final_norm"] = {"scale": params["final_norm"]["scale"] * sharpness}
    for i in range(draft_layers, config.num_layers):
        layer = dict(params["layers"][i])
        layer["o_dnh"] = layer["o_dnh"] * damping
        layer["down_df"] = layer["down_df"] * damping
        params["layers"][i] = layer
    draft_params = {**params, "layers": {i: params["layers"][i] for i in range(draft_layers)}}
    target = Model(config, params)
    draft = Model(config.replace(num_layers=draft_layers, name=f"{config.name}-first{draft_layers}"), draft_params)
    return target, draft


def skeleton_pair(target_config, draft_config, *, damping: float, sharpness: float = 4.0, seed: int = 0,
                  dtype="float32"):
    """A random target and draft of different shapes (e.g. the qwen2.5-1.5b and -0.5b presets)
    whose greedy choices agree where their layers are quiet, for timing a real pair's step shapes
    with a controlled acceptance.

    Both are untied (the head costs what a tied one does; only the embedding is stored twice). The
    draft's embedding and head are random; the target's are the draft's, zero-padded to its width,
    so with no layers both would compute the same random bigram map. Every layer of both writes
    into the residual stream scaled by `damping`, a context-dependent perturbation that flips the
    argmax where the bigram map's top logits are close: acceptance falls as `damping` grows.
    `sharpness` scales both final norms. Needs draft width <= target width and one vocabulary.
    """
    if draft_config.vocab_size != target_config.vocab_size or draft_config.hidden_size > target_config.hidden_size:
        raise ValueError("skeleton_pair needs one vocabulary and a draft no wider than the target, got "
                         f"vocab {draft_config.vocab_size} / {target_config.vocab_size}, width "
                         f"{draft_config.hidden_size} / {target_config.hidden_size}")
    target_config = target_config.replace(tie_word_embeddings=False)
    draft_config = draft_config.replace(tie_word_embeddings=False)

    def quiet(params):
        params = dict(params, final_norm={"scale": params["final_norm"]["scale"] * sharpness})
        params["layers"] = {i: dict(layer, o_dnh=layer["o_dnh"] * damping, down_df=layer["down_df"] * damping)
                            for i, layer in params["layers"].items()}
        return params

    draft_params = quiet(Model.random(draft_config, seed=seed, dtype=dtype).params)
    target_params = quiet(Model.random(target_config, seed=seed + 1, dtype=dtype).params)
    pad = target_config.hidden_size - draft_config.hidden_size
    target_params["embed_vd"] = jax.numpy.pad(draft_params["embed_vd"], ((0, 0), (0, pad)))
    target_params["lm_head_vd"] = jax.numpy.pad(draft_params["lm_head_vd"], ((0, 0), (0, pad)))
    return Model(target_config, target_params, dtype=dtype), Model(draft_config, draft_params, dtype=dtype)


PAIRS = {
    # name: (target config, draft config or None, draft layers, damping, sharpness). None: the
    # draft is the target's first layers (`layer_skip_pair`); else a pair of its own shape
    # (`skeleton_pair`), for the real pair's step shapes with a controlled acceptance.
    "tiny-8L": (ModelConfig(vocab_size=2048, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=2,
                            intermediate_size=768, max_position_embeddings=2048, tie_word_embeddings=True,
                            name="tiny-8L"), None, 2, 0.06, 6.0),
    "smollm2-shape": (ModelConfig.preset("smollm2-135m").replace(vocab_size=8192, name="smollm2-v8k"),
                      None, 4, 0.04, 6.0),
    # Acceptance 0.75-0.8 at damping 5e-4 and 0.6-0.75 at 1e-3 (float32 on CPU, argmax agreement
    # along the target's greedy path and on random contexts).
    "qwen2.5-shape": (ModelConfig.preset("qwen2.5-1.5b"), ModelConfig.preset("qwen2.5-0.5b"),
                      None, 7e-4, 6.0),
}


def build_pair(name: str, dtype: str = "float32"):
    """(target, draft, a sentence describing the pair) for PAIRS[name], the benchmarks' pairs."""
    config, draft_config, layers, damping, sharpness = PAIRS[name]
    if draft_config is None:
        if dtype != "float32":
            raise ValueError(f"--dtype {dtype} needs a pair with a draft of its own shape, not {name}")
        target, draft = layer_skip_pair(config, draft_layers=layers, damping=damping, sharpness=sharpness)
        return target, draft, (f"Pair `{name}` (random weights; the draft is the target's first {layers} layers, "
                                f"deeper layers damped by {damping})")
    target, draft = skeleton_pair(config, draft_config, damping=damping, sharpness=sharpness, dtype=dtype)
    return target, draft, (f"Pair `{name}`: a random {config.name}-shaped target and {draft_config.name}-shaped "
                           f"draft in {dtype} (untied heads; the target's embedding and head are the draft's, "
                           f"zero-padded; every layer of both damped by {damping}: `benchmarking.skeleton_pair`)")


def divergence(target, ids, reference, tokens):
    """True where every row of `tokens` equals `reference`'s; else where the first differing row
    parts from it, with the target's own logits (an uncached forward over the reference's prefix)
    of the two tokens chosen there: a near-tie, which low-precision rounding can break either way
    between a verify pass and an autoregressive step, or a real disagreement."""
    bad = [i for i, (r, t) in enumerate(zip(reference, tokens)) if r != t]
    if not bad:
        return True
    i = bad[0]
    j = next((j for j, (a, b) in enumerate(zip(reference[i], tokens[i])) if a != b), None)
    if j is None:
        return f"no: {len(bad)} of {len(reference)} rows; row {i} has {len(tokens[i])} tokens, not {len(reference[i])}"
    logits = np.asarray(target.logits(np.asarray([ids[i] + reference[i][:j]])))[0, -1]
    a, b = reference[i][j], tokens[i][j]
    return (f"no: {len(bad)} of {len(reference)} rows; row {i} from token {j}: target logits {logits[a]:.4f} "
            f"(reference's) vs {logits[b]:.4f}, top {np.max(logits):.4f}")


def prompt_sets(vocab_size: int, batch: int, count: int, seed: int = 0) -> list[list[list[int]]]:
    """`count` sets of `batch` random prompts. Every set has the first set's prompt lengths (8 to
    47 tokens), so all of them run at one compiled shape; only the tokens differ, and with them
    the text a pair generates and its acceptance. (The first set is the one prompt set the goodput
    benchmark used before it took several.)"""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 48, batch)
    return [[rng.integers(0, vocab_size, int(n)).tolist() for n in lengths] for _ in range(count)]

