"""What the training loops (`distill`, `train_eagle`) share: the optimizer, the data order, orbax
checkpoints and the loop itself.

Everything a run depends on is a function of the seed and the step number: the data order is a
per-epoch permutation drawn from (seed, epoch), so batch s is known without replaying batches
0..s-1. A checkpoint therefore needs only the params, the optimizer state, the step and the
history, and a resumed run continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax


def make_optimizer(learning_rate: float, steps: int, warmup_steps: int = 0, weight_decay: float = 0.0,
                   clip_norm: float | None = 1.0):
    """AdamW with linear warm-up to `learning_rate`, cosine decay to 10% of it, and global-norm clipping.

    Returns:
      (optax.GradientTransformation, schedule): the schedule maps a step to its learning rate.
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup_steps else learning_rate, peak_value=learning_rate,
        warmup_steps=warmup_steps, decay_steps=max(steps, warmup_steps + 1), end_value=0.1 * learning_rate)
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    parts.append(optax.adamw(schedule, weight_decay=weight_decay))
    return optax.chain(*parts), schedule


def batch_indices(seed: int, step: int, batch_size: int, num_sequences: int) -> np.ndarray:
    """Rows of batch `step`: consecutive slices of per-epoch permutations drawn from (seed, epoch)."""
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, offsets = np.divmod(flat, num_sequences)
    rows = np.empty_like(flat)
    for epoch in np.unique(epochs):
        order = np.random.default_rng([seed, int(epoch)]).permutation(num_sequences)
        rows[epochs == epoch] = order[offsets[epochs == epoch]]
    return rows


def params_digest(params) -> str:
    """A cheap fingerprint of a parameter pytree (so data made by other weights is not reused)."""
    sums = jax.device_get(jax.tree.map(lambda x: jnp.sum(jnp.abs(x.astype(jnp.float32))), params))
    return hashlib.sha256(np.asarray(jax.tree.leaves(sums), np.float64).tobytes()).hexdigest()[:16]


def check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def check_optimizer_args(steps, learning_rate, batch_size, warmup_steps, weight_decay, clip_norm,
                         checkpoint_every, eval_every) -> None:
    """ValueError naming the first bad training argument."""
    for name, value in (("steps", steps), ("batch_size", batch_size), ("checkpoint_every", checkpoint_every)):
        check_int(name, value, 1)
    if warmup_steps is not None:
        check_int("warmup_steps", warmup_steps, 0)
    if eval_every is not None:
        check_int("eval_every", eval_every, 1)
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not learning_rate > 0:
        raise ValueError(f"learning_rate must be a number > 0, got {learning_rate!r}")
    if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if clip_norm is not None and (not isinstance(clip_norm, (int, float)) or clip_norm <= 0):
        raise ValueError(f"clip_norm must be None (no clipping) or > 0, got {clip_norm!r}")


class Checkpoints:
    """Orbax checkpoints of one run in `directory`: params, optimizer state, step and history,
    with the run's `settings` (a JSON dict); restoring refuses a run made with other settings."""

    def __init__(self, directory, settings: dict, every: int):
        import orbax.checkpoint as ocp

        self.directory, self.settings, self.every = Path(directory).absolute(), _json_roundtrip(settings), every
        # Saving is decided by `due` (every `every` steps and at the end), so orbax keeps every save asked for.
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True))

    def due(self, done: int, steps: int) -> bool:
        return done % self.every == 0 or done == steps

    def save(self, step: int, params, opt_state, history: dict) -> None:
        import orbax.checkpoint as ocp

        state = {"params": params, "opt_state": opt_state, "step": np.int64(step)}
        # A snapshot: orbax writes in the background while the loop goes on appending to `history`.
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        history=ocp.args.JsonSave(_json_roundtrip(history)),
                                                        settings=ocp.args.JsonSave(self.settings)), force=True)

    def restore(self, params, opt_state, history: dict):
        """(params, opt_state, step, history) of the latest checkpoint, or the arguments and step 0."""
        import orbax.checkpoint as ocp

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


def start_run(params, hparams: tuple, settings: dict, checkpoint_dir, checkpoint_every: int, history: dict):
    """A run's starting point: (schedule, float32 params, optimizer state, first step, history,
    Checkpoints or None), fresh or restored from the latest checkpoint in `checkpoint_dir`."""
    optimizer, schedule = make_optimizer(*hparams)
    # Train in float32 whatever the model's dtype: Adam's small updates vanish in bfloat16.
    params = jax.tree.map(lambda x: jnp.array(x, dtype=jnp.float32), params)
    opt_state, start, checkpoints = optimizer.init(params), 0, None
    if checkpoint_dir is not None:
        checkpoints = Checkpoints(checkpoint_dir, settings, checkpoint_every)
        params, opt_state, start, history = checkpoints.restore(params, opt_state, history)
    return schedule, params, opt_state, start, history, checkpoints


def run_steps(step_fn: Callable, params, opt_state, *, start: int, steps: int, history: dict,
              checkpoints: Checkpoints | None, evaluate: Callable | None, eval_every: int | None,
              progress: bool, desc: str, callback: Callable | None):
    """Optimizer steps `start` .. `steps - 1`, with held-out evaluations, checkpoints, a tqdm bar
    and the callback; returns the trained params.

    `step_fn(params, opt_state, step)` returns (params, opt_state, metrics): floats (or lists of
    floats) appended to `history[name]` with "step". `evaluate(done, params)` returns a dict of
    floats appended with "eval_step"; it runs before a fresh run, every `eval_every` steps and
    after the last.
    """
    from tqdm.auto import tqdm

    bar = tqdm(total=steps, initial=start, desc=desc, disable=not progress)
    shown = {}
    if evaluate is not None and start == 0:
        shown = evaluate(0, params)
        record_eval(history, 0, shown)
    try:
        for step in range(start, steps):
            params, opt_state, metrics = step_fn(params, opt_state, step)
            done = step + 1
            history.setdefault("step", []).append(done)
            for name, value in metrics.items():
                history.setdefault(name, []).append(value)
            if evaluate is not None and ((eval_every and done % eval_every == 0) or done == steps):
                shown = evaluate(done, params)
                record_eval(history, done, shown)
            if checkpoints is not None and checkpoints.due(done, steps):
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
    return params


def record_eval(history: dict, step: int, values: dict) -> None:
    history.setdefault("eval_step", []).append(step)
    for name, value in values.items():
        history.setdefault(name, []).append(value)


def _json_roundtrip(value):
    return json.loads(json.dumps(value))


__all__ = ["Checkpoints", "batch_indices", "check_int", "check_optimizer_args", "make_optimizer", "params_digest",
           "record_eval", "run_steps", "start_run"]
