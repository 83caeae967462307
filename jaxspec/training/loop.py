"""What the trainers (`distill`, `train_eagle`) share: settings (`HParams`), orbax checkpoints, the
loop (`train`) and held-out acceptance. The data order is a per-epoch permutation drawn from (seed,
epoch), so a checkpoint needs no data state and a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from jaxspec.engine import SpeculativeDecoder
from jaxspec.prompts import check_int
from jaxspec.spec import SpecConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class HParams:
    """A training run's settings, checked when made (a ValueError names a bad one). AdamW's peak
    `learning_rate` is reached by linear warm-up over `warmup_steps` (None: 5% of the steps), then
    decays (cosine) to 10% of it at `steps`; `clip_norm`: global-norm gradient clipping (None: none);
    `seed`: the data order; `eval_every`: None evaluates before and after training only. Only the
    optimizer's fields are compared, so runs differing in the others share a compiled step.
    """
    steps: int
    learning_rate: float
    warmup_steps: int | None
    weight_decay: float
    clip_norm: float | None
    seed: int = dataclasses.field(compare=False)
    batch_size: int = dataclasses.field(compare=False)
    checkpoint_every: int = dataclasses.field(compare=False)
    eval_every: int | None = dataclasses.field(compare=False)

    def __post_init__(self):
        check_int("steps", self.steps, 1)
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", max(1, self.steps // 20))
        for name, low in (("warmup_steps", 0), ("batch_size", 1), ("checkpoint_every", 1)):
            check_int(name, getattr(self, name), low)
        if self.eval_every is not None:
            check_int("eval_every", self.eval_every, 1)
        lr = self.learning_rate
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"learning_rate must be a number > 0, got {lr!r}")
        if not isinstance(self.weight_decay, (int, float)) or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.clip_norm is not None and (not isinstance(self.clip_norm, (int, float)) or self.clip_norm <= 0):
            raise ValueError(f"clip_norm must be None (no clipping) or > 0, got {self.clip_norm!r}")

    def optimizer(self):
        """(optax.GradientTransformation, schedule: step -> learning rate), built from floats:
        settings given as 1 and 1.0 are equal, share one program, and must trace alike."""
        lr, warmup = float(self.learning_rate), self.warmup_steps
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup else lr, peak_value=lr, warmup_steps=warmup,
            decay_steps=max(self.steps, warmup + 1), end_value=0.1 * lr)
        parts = [optax.clip_by_global_norm(float(self.clip_norm))] if self.clip_norm else []
        parts.append(optax.adamw(schedule, weight_decay=float(self.weight_decay)))
        return optax.chain(*parts), schedule


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A trainer's static half, jit's static `self`: `hparams`, and in subclasses what
    `loss(params, frozen, batch) -> (loss, metrics)` needs (`frozen`: traced inputs not trained)."""
    hparams: HParams | None

    def loss(self, params, frozen, batch):
        raise NotImplementedError

    # Donating the old params and optimizer state lets XLA update them in place (halves their memory).
    @functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
    def step(self, params, opt_state, frozen, batch):
        """One optimizer step; returns (params, opt_state, {"loss", **metrics, "grad_norm"})."""
        (loss, metrics), grads = jax.value_and_grad(self.loss, has_aux=True)(params, frozen, batch)
        updates, opt_state = self.hparams.optimizer()[0].update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state,
                {"loss": loss, **metrics, "grad_norm": optax.tree.norm(grads)})


def batch_indices(seed: int, step: int, batch_size: int, num_sequences: int) -> np.ndarray:
    """Rows of batch `step`: consecutive slices of per-epoch permutations drawn from (seed, epoch)."""
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, offsets = np.divmod(flat, num_sequences)
    rows = np.empty_like(flat)
    for epoch in np.unique(epochs):
        order = np.random.default_rng([seed, int(epoch)]).permutation(num_sequences)
        rows[epochs == epoch] = order[offsets[epochs == epoch]]
    return rows


def take(data: dict, rows) -> dict:
    return {name: jnp.asarray(array[rows]) for name, array in data.items()}


def write_json(path: Path, value) -> None:
    """Writes then renames, so a run killed mid-write never leaves a file that looks complete."""
    tmp = path.with_suffix(".tmp.json")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def digest(*arrays) -> str:
    """A short fingerprint of numpy arrays (so data made otherwise is not taken for them)."""
    return hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in arrays)).hexdigest()[:16]


def params_digest(params) -> str:
    """A cheap fingerprint of a parameter pytree (so data made by other weights is not reused)."""
    sums = jax.device_get(jax.tree.map(lambda x: jnp.sum(jnp.abs(x.astype(jnp.float32))), params))
    return digest(np.asarray(jax.tree.leaves(sums), np.float64))


def cast_like(params, reference):
    return jax.tree.map(lambda x, ref: x.astype(ref.dtype), params, reference)


def heldout_acceptance(target, draft, prompts, *, k: int = 4, max_new_tokens: int = 32, seed: int = 0) -> dict:
    """Greedy speculative decoding of `prompts` with `draft` (a Model or a drafter): acceptance rate
    and accepted length."""
    stats = SpeculativeDecoder(target, draft, spec=SpecConfig(k=k)).generate(
        prompts, max_new_tokens=max_new_tokens, seed=seed).stats
    return {"acceptance_rate": float(stats.acceptance_rate),
            "mean_accepted_length": float(stats.mean_accepted_length)}


class Checkpoints:
    """Orbax checkpoints of one run in `directory`: params, optimizer state, step and history,
    with the run's `settings` (a JSON dict); restoring refuses a run made with other settings."""

    def __init__(self, directory, settings: dict):
        self.directory, self.settings = Path(directory).absolute(), _json_roundtrip(settings)
        # `train` decides when to save, so orbax keeps every save asked for.
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True))

    def save(self, step: int, params, opt_state, history: dict) -> None:
        state = {"params": params, "opt_state": opt_state, "step": np.int64(step)}
        # A snapshot: orbax writes in the background while the loop goes on appending to `history`.
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        history=ocp.args.JsonSave(_json_roundtrip(history)),
                                                        settings=ocp.args.JsonSave(self.settings)), force=True)

    def restore(self, params, opt_state, history: dict):
        """(params, opt_state, step, history) of the latest checkpoint, or the arguments and step 0."""
        step = self.manager.latest_step()
        if step is None:
            return params, opt_state, 0, history
        saved = self.manager.restore(step, args=ocp.args.Composite(settings=ocp.args.JsonRestore()))["settings"]
        different = sorted(k for k in self.settings if saved.get(k) != self.settings[k])
        if different:
            raise ValueError(f"checkpoint_dir {str(self.directory)!r} holds a run with different "
                             f"{', '.join(different)}; use a new checkpoint_dir or the same settings")
        abstract = {"params": params, "opt_state": opt_state, "step": np.int64(0)}
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), abstract)
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                      history=ocp.args.JsonRestore()))
        state = restored["state"]
        return state["params"], state["opt_state"], int(state["step"]), restored["history"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def train(trainer: Trainer, frozen, data: dict, params, *, settings: dict, history: dict, checkpoint_dir,
          evaluate: Callable | None, progress: bool, desc: str, callback: Callable | None):
    """Trains a float32 copy of `params` (Adam's small updates vanish in bfloat16) with
    `trainer.step`, step s on rows `batch_indices(seed, s, batch_size, n)` of each array of `data`;
    returns (params, history). Each step's metrics are appended to `history` with "step" and
    "learning_rate"; `evaluate(step, params)`'s, with "eval_step", before a fresh run, every
    `eval_every` steps and after the last. An existing run in `checkpoint_dir` resumes if made with
    the same hparams and `settings` (the trainer's data, model, loss ...), else is refused.
    `callback(step, metrics)` runs after each step; raising from it stops the run (resumable).
    """
    hparams, steps = trainer.hparams, trainer.hparams.steps
    optimizer, schedule = hparams.optimizer()
    params = jax.tree.map(lambda x: jnp.array(x, dtype=jnp.float32), params)
    opt_state, start, checkpoints = optimizer.init(params), 0, None
    if checkpoint_dir is not None:
        # The cadence of checkpoints and evaluations may change when a run resumes; nothing else.
        settings = {**{f"hparams.{name}": value for name, value in dataclasses.asdict(hparams).items()
                       if name not in ("checkpoint_every", "eval_every")}, **settings}
        checkpoints = Checkpoints(checkpoint_dir, settings)
        params, opt_state, start, history = checkpoints.restore(params, opt_state, history)
    bar = tqdm(total=steps, initial=start, desc=desc, disable=not progress)
    shown = {}
    if evaluate is not None and start == 0:
        shown = evaluate(0, params)
        _append(history, {"eval_step": 0, **shown})
    try:
        for step in range(start, steps):
            rows = batch_indices(hparams.seed, step, hparams.batch_size, len(next(iter(data.values()))))
            params, opt_state, metrics = trainer.step(params, opt_state, frozen, take(data, rows))
            metrics = {name: np.asarray(value).tolist() for name, value in jax.device_get(metrics).items()}
            metrics["learning_rate"] = float(schedule(step))
            done = step + 1
            _append(history, {"step": done, **metrics})
            if evaluate is not None and ((hparams.eval_every and done % hparams.eval_every == 0) or done == steps):
                shown = evaluate(done, params)
                _append(history, {"eval_step": done, **shown})
            if checkpoints is not None and (done % hparams.checkpoint_every == 0 or done == steps):
                checkpoints.save(done, params, opt_state, history)
            bar.set_postfix({"loss": f"{metrics['loss']:.4f}", **{k: f"{v:.3f}" for k, v in shown.items()}},
                            refresh=False)
            bar.update(1)
            if callback is not None:
                callback(done, metrics)
    finally:
        bar.close()
        if checkpoints is not None:
            checkpoints.close()
    return params, history


def _append(history: dict, values: dict) -> None:
    for name, value in values.items():
        history.setdefault(name, []).append(value)


def _json_roundtrip(value):
    return json.loads(json.dumps(value))
