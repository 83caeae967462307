"""Draft distillation: train a draft model to match its target's next-token distributions.

Shape key: b batch rows, t sequence positions, v vocabulary, n training sequences.

The data are the target's own continuations of the prompts (speculative decoding only asks the
draft to predict the target's text). Each step computes the target's logits inside it, under
`stop_gradient`, so no [n, t, v] tensor is stored. The loop is `jaxspec.training.loop`'s.
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
from flax import nnx
from tqdm.auto import tqdm

from jaxspec import prompts as prompts_lib
from jaxspec.engine.generate import generate
from jaxspec.models.model import Model, _logits_uncached
from jaxspec.sampling import SamplingConfig
from jaxspec.training import loop as training

LOSSES = ("forward_kl", "reverse_kl", "tvd")
_DATA_FORMAT = 1


def distribution_loss(target_logits, draft_logits, loss: str = "tvd") -> jax.Array:
    """float32 [...]: the divergence at each position between the target's (p) and the draft's (q)
    next-token distributions, from logits [..., v]: "forward_kl" KL(p || q) (mass-covering),
    "reverse_kl" KL(q || p) (mode-seeking), or "tvd" 0.5 * sum |p - q| (speculative sampling accepts
    a draft token with probability exactly 1 - TVD, so "tvd" optimises acceptance directly)."""
    _check_loss(loss)
    logp = jax.nn.log_softmax(jnp.asarray(target_logits, jnp.float32), axis=-1)
    logq = jax.nn.log_softmax(jnp.asarray(draft_logits, jnp.float32), axis=-1)
    if loss == "forward_kl":
        return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
    if loss == "reverse_kl":
        return jnp.sum(jnp.exp(logq) * (logq - logp), axis=-1)
    return 0.5 * jnp.sum(jnp.abs(jnp.exp(logp) - jnp.exp(logq)), axis=-1)


def _check_loss(loss: str) -> None:
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")


@dataclasses.dataclass(frozen=True)
class _Distill(training.Trainer):
    """The jitted step's static argument: hyper-parameters, loss and both graphs."""
    loss_name: str
    graphdef: nnx.GraphDef          # the draft's
    target_graphdef: nnx.GraphDef

    def loss(self, params, target_params, batch):
        """The mean divergence over the batch's continuation positions (its "mask"); no metrics."""
        tokens_bt, mask_bt = batch["tokens"], batch["mask"]
        target_logits_btv = jax.lax.stop_gradient(_logits_uncached(self.target_graphdef, target_params, tokens_bt))
        draft_logits_btv = _logits_uncached(self.graphdef, params, tokens_bt)
        per_position_bt = distribution_loss(target_logits_btv, draft_logits_btv, self.loss_name)
        # max(.., 1) keeps an all-padding batch finite.
        return jnp.sum(per_position_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1.0), {}


def _pack(sequences, prompt_lens):
    """Right-pads sequences into int32 [n, t] plus the loss mask of positions predicting a new token
    (position j's logits predict token j + 1: the mask covers j in [prompt_len - 1, length - 1))."""
    width = -(-max(len(s) for s in sequences) // 8) * 8
    tokens_nt = np.zeros((len(sequences), width), np.int32)
    mask_nt = np.zeros((len(sequences), width), np.float32)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens)):
        tokens_nt[i, :len(seq)] = seq
        mask_nt[i, p - 1:len(seq) - 1] = 1.0
    return tokens_nt, mask_nt


def load_or_generate_data(target: Model, prompt_ids, *, max_new_tokens, temperatures, seed, eos_token_id,
                          max_len, data_cache=None, generate_batch_size=64, progress=True):
    """(tokens int32 [n, t], mask float32 [n, t], their digest): the target's continuations of
    `prompt_ids`, one set per temperature; read from `data_cache` when it holds data made the same way."""
    meta = {"format": _DATA_FORMAT, "target": target.config.to_dict(),
            "target_params": training.params_digest(target.params),
            "prompts": hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest(),
            "max_new_tokens": max_new_tokens, "temperatures": list(temperatures), "seed": seed,
            "eos_token_id": eos_token_id, "max_len": max_len}
    if data_cache is not None:
        folder = Path(data_cache)
        meta_path, data_path = folder / "meta.json", folder / "data.npz"
        if meta_path.exists() and data_path.exists() and json.loads(meta_path.read_text()).get("settings") == meta:
            with np.load(data_path) as data:
                tokens_nt, mask_nt = data["tokens"], data["mask"]
            return tokens_nt, mask_nt, training.digest(tokens_nt, mask_nt)
    sequences, prompt_lens = [], []
    chunks = [(temperature, start) for temperature in temperatures
              for start in range(0, len(prompt_ids), generate_batch_size)]
    for temperature, start in tqdm(chunks, desc="target continuations", disable=not progress, leave=False):
        chunk = prompt_ids[start:start + generate_batch_size]
        budgets = [max(1, min(max_new_tokens, max_len - len(p))) for p in chunk]
        result = generate(target, chunk, max_new_tokens=budgets, sampling=SamplingConfig(temperature=temperature),
                          seed=seed + start, eos_token_id=eos_token_id)
        for prompt, new in zip(chunk, result.tokens):
            sequences.append(list(prompt) + list(new))
            prompt_lens.append(len(prompt))
    tokens_nt, mask_nt = _pack(sequences, prompt_lens)
    if data_cache is not None:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / "data.tmp.npz"   # then renamed: a run killed mid-write leaves no cache that looks complete
        np.savez(tmp, tokens=tokens_nt, mask=mask_nt)
        os.replace(tmp, data_path)
        training.write_json(meta_path, {"settings": meta, "sequences": len(sequences)})
    return tokens_nt, mask_nt, training.digest(tokens_nt, mask_nt)


def answered(target: Model, prompt_ids, *, max_new_tokens: int, seed: int = 0, eos_token_id=None, max_len=None,
             data_cache=None, progress: bool = True) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation (within `max_len` tokens, default
    the context), as token ids (`load_or_generate_data`'s, cached in `data_cache`)."""
    tokens_nt, mask_nt, _ = load_or_generate_data(
        target, prompt_ids, max_new_tokens=max_new_tokens, temperatures=[0.0], seed=seed, eos_token_id=eos_token_id,
        max_len=max_len or target.config.max_position_embeddings, data_cache=data_cache, progress=progress)
    # The mask marks positions that predict a continuation token: the sequence ends one past the last.
    ends = [int(np.flatnonzero(m).max()) + 2 if m.any() else len(p) for p, m in zip(prompt_ids, mask_nt)]
    return [row[:end].tolist() for row, end in zip(tokens_nt, ends)]


def _training_data(target: Model, draft: Model, prompts, temperature, *, max_new_tokens, seed, eos_token_id,
                   data_cache, progress):
    """`load_or_generate_data` for `prompts` at `temperature` (a number or a list), each prompt
    leaving room for a continuation in both models' contexts; ValueErrors name the bad argument."""
    temperatures = list(temperature) if isinstance(temperature, (list, tuple)) else [temperature]
    if not temperatures:
        raise ValueError("temperature must be a number >= 0 or a non-empty list of them")
    for t in temperatures:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t!r}")
    prompt_ids = prompts_lib.encode_prompts(prompts, target.tokenizer, target.config.vocab_size)
    max_len = min(target.config.max_position_embeddings, draft.config.max_position_embeddings)
    prompts_lib.check_max_new_tokens(max_new_tokens, len(prompt_ids))
    for i, p in enumerate(prompt_ids):
        if len(p) >= max_len:
            raise ValueError(f"prompts[{i}] has {len(p)} tokens, leaving no room for a continuation within "
                             f"max_position_embeddings={max_len}")
    return load_or_generate_data(
        target, prompt_ids, max_new_tokens=max_new_tokens, temperatures=[float(t) for t in temperatures], seed=seed,
        eos_token_id=eos_token_id, max_len=max_len, data_cache=data_cache, progress=progress)


def _check_models(target, draft, loss: str) -> None:
    if not isinstance(target, Model):
        raise ValueError(f"target must be a jaxspec.Model, got {type(target).__name__}")
    if not isinstance(draft, Model):
        raise ValueError(f"draft must be a jaxspec.Model, got {type(draft).__name__}")
    if draft.quantization is not None:
        raise ValueError(f"draft is {draft.quantization}-quantized: distill the float draft, quantize it after")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft vocab_size ({draft.config.vocab_size}) must equal the target's "
                         f"({target.config.vocab_size}): distillation matches distributions over the same tokens")
    _check_loss(loss)


def distill(target: Model, draft: Model, prompts, steps: int, learning_rate: float, seed: int = 0, *,
            loss: str = "tvd", batch_size: int = 8, max_new_tokens: int = 64, temperature=0.0,
            eos_token_id: int | None = None, warmup_steps: int = 0, weight_decay: float = 0.0,
            clip_norm: float | None = 1.0, checkpoint_dir=None, checkpoint_every: int = 100,
            data_cache=None, heldout_prompts=None, eval_every: int | None = None, eval_k: int = 4,
            eval_max_new_tokens: int | None = None, progress: bool = True,
            callback: Callable[[int, dict], None] | None = None) -> tuple[Model, dict]:
    """Trains `draft` to match `target`'s next-token distributions on the target's own continuations.

    Args:
      draft: the starting draft (same vocabulary), e.g. from `draft_from_target`. Not modified.
      prompts: token-id lists (or strings, with a tokenizer) the target continues to make the data.
      steps, learning_rate, seed, batch_size, warmup_steps, weight_decay, clip_norm, checkpoint_every,
        eval_every: the run's `training.loop.HParams`; seed also seeds the target's sampling.
      loss: "tvd" (default), "forward_kl" or "reverse_kl"; see `distribution_loss`.
      max_new_tokens, eos_token_id: the length and stop token of the target's continuations.
      temperature: their sampling temperature (0 = greedy), or a list, one set of continuations each.
      data_cache: a folder for the continuations (`load_or_generate_data`), so a restart does not regenerate.
      heldout_prompts: prompts kept out of training on which greedy speculative acceptance
        (`training.loop.heldout_acceptance`, k=eval_k, eval_max_new_tokens per prompt, None:
        max_new_tokens) is measured before training, every `eval_every` steps and at the end.
        None: no evaluation.
      checkpoint_dir, progress, callback: `training.loop.train`'s; an existing run in
        checkpoint_dir resumes (it must have the same settings and data).

    Returns:
      (draft, history): the trained draft (the draft's config, dtype and tokenizer) and a dict of
      lists: "step", "loss", "learning_rate", "grad_norm" (one entry per step), and "eval_step",
      "acceptance_rate", "mean_accepted_length" (one entry per held-out evaluation).

    Raises:
      ValueError: naming the bad argument (a vocabulary mismatch, a checkpoint of other settings...).
    """
    _check_models(target, draft, loss)
    hparams = training.HParams(steps=steps, learning_rate=learning_rate, warmup_steps=warmup_steps,
                               weight_decay=weight_decay, clip_norm=clip_norm, seed=seed, batch_size=batch_size,
                               checkpoint_every=checkpoint_every, eval_every=eval_every)
    evaluate = None
    if heldout_prompts is not None:
        heldout_ids = prompts_lib.encode_prompts(heldout_prompts, target.tokenizer, target.config.vocab_size)
        evaluate = functools.partial(_evaluate, target, draft, heldout_ids, k=eval_k, seed=seed, max_new_tokens=(
            max_new_tokens if eval_max_new_tokens is None else eval_max_new_tokens))
    tokens_nt, mask_nt, data_digest = _training_data(
        target, draft, prompts, temperature, max_new_tokens=max_new_tokens, seed=seed, eos_token_id=eos_token_id,
        data_cache=data_cache, progress=progress)
    params, history = training.train(
        _Distill(hparams, loss, draft.graphdef, target.graphdef), target.params, {"tokens": tokens_nt, "mask": mask_nt},
        draft.params, settings={"loss": loss, "data": data_digest, "draft": draft.config.to_dict()},
        history={name: [] for name in ("step", "loss", "learning_rate", "grad_norm", "eval_step", "acceptance_rate",
                                       "mean_accepted_length")},
        checkpoint_dir=checkpoint_dir, evaluate=evaluate, progress=progress, desc="distill", callback=callback)
    return _as_draft(draft, params), history


def _evaluate(target: Model, draft: Model, heldout_ids, step: int, params, **kwargs) -> dict:
    return training.heldout_acceptance(target, _as_draft(draft, params), heldout_ids, **kwargs)


def _as_draft(draft: Model, params) -> Model:
    """The draft with trained float32 `params`, cast to the draft's own dtypes."""
    return Model(draft.config, training.cast_like(params, draft.params), dtype=draft.dtype, tokenizer=draft.tokenizer)
