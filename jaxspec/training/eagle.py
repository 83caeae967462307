"""Training EAGLE-3 heads on the target's own features and distributions.

Shape key: n sequences, b batch rows, t positions, f fused features, d widths, w draft
vocabulary, v target vocabulary, s training-time-test steps.

The labels are the target's distribution over the draft vocabulary, its LM head applied to the
stored final hidden state (`feature_cache`): soft labels teach the head to predict the target.

Training-time test (EAGLE-3): the head is unrolled over `ttt_steps` steps as it drafts. At step s,
row j feeds the head's own output of step s - 1 (the fused target features at step 0) with the
true token at j + 1 + s, at rotary position j + s; it attends to the step-0 keys of rows <= j and
to its own keys of steps 1..s (the rows drafting reads from the cache), and is scored against the
target's distribution of the token at j + 2 + s. The loss is the sum over steps of 0.8^s times the
cross-entropy, at positions where the target's own choice lies in the draft vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.drafting import EagleDrafter
from jaxspec.models.eagle import EagleHead
from jaxspec.models.model import Model
from jaxspec.prompts import check_int
from jaxspec.training import loop as training
from jaxspec.training.feature_cache import feature_cache, stored

STEP_WEIGHT = 0.8   # EAGLE-3's per-step loss decay
_F32 = jnp.float32


def _ttt_attend(q_btnh, keys, values):
    """Attention of step s's queries to the step-0 keys of rows <= j and to the keys of steps
    1..s at row j itself (`keys`, `values`: per step [b, t, k, h]; the last is step s)."""
    b, t, n, h = q_btnh.shape
    g = n // keys[0].shape[2]
    q = q_btnh.reshape(b, t, -1, g, h).astype(_F32) * h ** -0.5          # [b, t, k, g, h]
    causal = jnp.einsum("bjkgh,bikh->bkgji", q, keys[0].astype(_F32))
    causal = jnp.where(jnp.tril(jnp.ones((t, t), bool)), causal, jnp.finfo(_F32).min)
    diagonal = [jnp.einsum("bjkgh,bjkh->bkgj", q, k.astype(_F32))[..., None] for k in keys[1:]]
    probs = jax.nn.softmax(jnp.concatenate([causal, *diagonal], axis=-1), axis=-1)
    out = jnp.einsum("bkgji,bikh->bjkgh", probs[..., :t], values[0].astype(_F32))
    for i, v in enumerate(values[1:]):
        out = out + probs[..., t + i].transpose(0, 3, 1, 2)[..., None] * v.astype(_F32)[:, :, :, None, :]
    return out.reshape(b, t, n, h).astype(q_btnh.dtype)


def ttt_logits(graphdef, params, embed_vd, features_btf, tokens_bt, steps: int) -> list[jax.Array]:
    """The head unrolled `steps` times over whole sequences (module docstring): per step, the
    draft-vocabulary logits [b, t, w] of the token at j + 2 + step."""
    module = nnx.merge(graphdef, params)
    b, t, _ = features_btf.shape
    hidden_md = module.fuse(features_btf.reshape(b * t, -1)).astype(embed_vd.dtype)
    padded_bt = jnp.pad(tokens_bt, ((0, 0), (0, steps + 1)))
    keys, values, logits = [], [], []
    for s in range(steps):
        tokens = padded_bt[:, 1 + s:1 + s + t].reshape(-1)
        pos_m = jnp.tile(jnp.arange(t, dtype=jnp.int32) + s, b)
        q, k, v = (a.reshape(b, t, *a.shape[1:]) for a in
                   module.qkv(hidden_md, jnp.take(embed_vd, tokens, axis=0), pos_m))
        keys.append(k)
        values.append(v)
        attn = _ttt_attend(q, keys, values)
        hidden_md = module.finish(hidden_md, attn.reshape(b * t, *attn.shape[2:]))
        logits.append(module.head(hidden_md).reshape(b, t, -1))
    return logits


def eagle_loss(params, labels_btw, choice_bt, features_btf, tokens_bt, lengths_b, embed_vd, draft_ids, *, graphdef,
               steps: int):
    """EAGLE-3's training loss and each step's top-1 agreement with the target (module docstring);
    labels_btw: the target's logits at the draft ids; choice_bt: the target's own next token."""
    t = features_btf.shape[1]
    labels_bTw = jnp.pad(labels_btw, ((0, 0), (0, steps + 1), (0, 0)))
    choice_bT = jnp.pad(choice_bt, ((0, 0), (0, steps + 1)))
    in_draft = jnp.zeros((embed_vd.shape[0],), bool).at[draft_ids].set(True)[choice_bT]
    total, agree = 0.0, []
    for s, logits_btw in enumerate(ttt_logits(graphdef, params, embed_vd, features_btf, tokens_bt, steps)):
        at = slice(1 + s, 1 + s + t)
        p_btw = jax.nn.softmax(labels_bTw[:, at].astype(_F32), axis=-1)
        mask_bt = ((jnp.arange(t)[None, :] + 1 + s < lengths_b[:, None]) & in_draft[:, at]).astype(_F32)
        xent_bt = -jnp.sum(p_btw * jax.nn.log_softmax(logits_btw.astype(_F32), axis=-1), axis=-1)
        count = jnp.maximum(jnp.sum(mask_bt), 1.0)
        total = total + STEP_WEIGHT ** s * jnp.sum(xent_bt * mask_bt) / count
        hit_bt = draft_ids[jnp.argmax(logits_btw, axis=-1)] == choice_bT[:, at]
        agree.append(jnp.sum(hit_bt * mask_bt) / count)
    return total, jnp.stack(agree)


@dataclasses.dataclass(frozen=True)
class _Eagle(training.Trainer):
    """The jitted steps' static argument: hyper-parameters (None to evaluate only), graphs and unroll."""
    graphdef: nnx.GraphDef          # the head's
    target_graphdef: nnx.GraphDef
    ttt_steps: int

    def loss(self, params, frozen, batch):
        """`eagle_loss` of a batch of the feature cache; frozen: (the target's params, the draft ids)."""
        target_params, draft_ids = frozen
        labels_btw = nnx.merge(self.target_graphdef, target_params).head(stored(batch["hidden"]), ids=draft_ids)
        loss, agree = eagle_loss(params, jax.lax.stop_gradient(labels_btw), batch["choice"], stored(batch["features"]),
                                 batch["tokens"], batch["lengths"], target_params["embed_vd"], draft_ids,
                                 graphdef=self.graphdef, steps=self.ttt_steps)
        return loss, {"agree": agree}

    eval_loss = jax.jit(loss, static_argnums=0)


def sequences(target: Model, data, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows [n, seq_len] (zero-padded) and their lengths: each item of `data` (a text or a
    token-id list) cut into consecutive pieces of `seq_len`; pieces under 3 tokens are dropped."""
    rows = []
    for item in data:
        if isinstance(item, str):
            if target.tokenizer is None:
                raise ValueError("data holds texts but the target has no tokenizer; pass token-id lists")
            item = target.tokenizer.encode(item)
        item = np.asarray(item, np.int64).reshape(-1)
        if item.size and (item.max() >= target.config.vocab_size or item.min() < 0):
            raise ValueError(f"data token ids must lie in [0, {target.config.vocab_size})")
        rows += [item[i:i + seq_len] for i in range(0, len(item), seq_len) if len(item) - i >= 3]
    if not rows:
        raise ValueError("data must hold at least one sequence of 3 or more tokens")
    return (np.stack([np.pad(row, (0, seq_len - len(row))) for row in rows]).astype(np.int32),
            np.array([len(row) for row in rows], np.int32))


def heldout_loss(target: Model, head: EagleHead, data, *, seq_len: int = 128, ttt_steps: int = 3,
                 batch_size: int = 8) -> float:
    """The training loss (module docstring) of `head` on `data`, which it was not trained on."""
    tokens, lengths = sequences(target, data, seq_len)
    cache = feature_cache(target, head.config.feature_layers, tokens, lengths, None, batch_size=batch_size,
                          progress=False)
    trainer = _Eagle(None, head.graphdef, target.graphdef, ttt_steps)
    frozen = (target.params, jnp.asarray(head.draft_ids))
    total, weight = 0.0, 0
    for start in range(0, len(tokens), batch_size):
        rows = np.arange(start, min(start + batch_size, len(tokens)))
        value, _ = trainer.eval_loss(head.params, frozen, training.take(cache, np.resize(rows, batch_size)))
        total, weight = total + float(value) * len(rows), weight + len(rows)
    return total / weight


def _check(target, head, seq_len, ttt_steps) -> None:
    check_int("ttt_steps", ttt_steps, 1)
    check_int("seq_len", seq_len, 3)
    if not isinstance(head, EagleHead):
        raise ValueError(f"head must be a jaxspec.EagleHead, got {type(head).__name__}")
    if head.config.target_hidden_size != target.config.hidden_size or (
            head.config.target_vocab_size != target.config.vocab_size):
        raise ValueError("head does not fit target: its target_hidden_size / target_vocab_size are "
                         f"{head.config.target_hidden_size} / {head.config.target_vocab_size}, the target's "
                         f"{target.config.hidden_size} / {target.config.vocab_size}")


def train_eagle(target: Model, head: EagleHead, data, steps: int, learning_rate: float, seed: int = 0, *,
                batch_size: int = 8, seq_len: int = 128, ttt_steps: int = 3, warmup_steps: int | None = None,
                weight_decay: float = 0.0, clip_norm: float | None = 0.5, feature_cache_dir=None,
                checkpoint_dir=None, checkpoint_every: int = 100, heldout=None, eval_every: int | None = None,
                eval_k: int = 4, eval_max_new_tokens: int = 32, progress: bool = True, callback=None):
    """Trains `head` to draft for `target` on `data`; returns (trained head, history).

    Args:
      head: an `EagleHead` for this target (`EagleHead.init(target)`); not modified.
      data: texts or token-id lists, cut into pieces of `seq_len` tokens (`sequences`).
      steps, learning_rate, seed, batch_size, warmup_steps, weight_decay, clip_norm, checkpoint_every,
        eval_every: the run's `training.loop.HParams`.
      ttt_steps: training-time-test unroll (module docstring).
      feature_cache_dir: folder for the target's features (`feature_cache`); reused when made
        from the same target, layers and data, resumed when incomplete. None: in memory.
      heldout: data kept out of training (texts or token-id lists, cut like `data`): before
        training, every `eval_every` steps and at the end, the training loss on them and greedy
        speculative decoding with the head (k = eval_k) of each piece's first half as a prompt,
        eval_max_new_tokens tokens each.
      checkpoint_dir, progress, callback: `training.loop.train`'s; an existing run in
        checkpoint_dir resumes (with the same settings and data); progress also shows the feature pass.

    Returns:
      (the head with trained weights in its dtype, history: per step lists "step", "loss", "agree"
      (each unrolled step's top-1 agreement with the target), "grad_norm", "learning_rate"; per
      evaluation "eval_step", "heldout_loss", "heldout_acceptance_rate", "heldout_accepted_length").
    """
    hparams = training.HParams(steps=steps, learning_rate=learning_rate, warmup_steps=warmup_steps,
                               weight_decay=weight_decay, clip_norm=clip_norm, seed=seed, batch_size=batch_size,
                               checkpoint_every=checkpoint_every, eval_every=eval_every)
    _check(target, head, seq_len, ttt_steps)
    tokens, lengths = sequences(target, data, seq_len)
    cache = feature_cache(target, head.config.feature_layers, tokens, lengths, feature_cache_dir, progress=progress)
    evaluate = None if heldout is None else functools.partial(
        _evaluate, target, head, heldout, seq_len=seq_len, ttt_steps=ttt_steps, batch_size=batch_size, k=eval_k,
        max_new_tokens=eval_max_new_tokens, seed=seed)
    params, history = training.train(
        _Eagle(hparams, head.graphdef, target.graphdef, ttt_steps), (target.params, jnp.asarray(head.draft_ids)),
        cache, head.params,
        settings={"ttt_steps": ttt_steps, "data": training.digest(tokens, lengths), "head": repr(head.config),
                  "draft_ids": training.digest(head.draft_ids)},
        history={}, checkpoint_dir=checkpoint_dir, evaluate=evaluate, progress=progress, desc="train-eagle",
        callback=callback)
    return _with_params(head, params), history


def _with_params(head: EagleHead, params) -> EagleHead:
    return EagleHead(head.config, head.graphdef, training.cast_like(params, head.params), head.draft_ids, head.embed_vd)


def _evaluate(target, head, heldout, step: int, params, *, seq_len, ttt_steps, batch_size, k, max_new_tokens,
              seed) -> dict:
    head = _with_params(head, params)
    tokens, lengths = sequences(target, heldout, seq_len)
    prompts = [row[:max(1, n // 2)].tolist() for row, n in zip(tokens, lengths)]
    accepted = training.heldout_acceptance(target, EagleDrafter(head), prompts, k=k, max_new_tokens=max_new_tokens,
                                           seed=seed)
    return {"heldout_loss": heldout_loss(target, head, heldout, seq_len=seq_len, ttt_steps=ttt_steps,
                                         batch_size=batch_size),
            "heldout_acceptance_rate": accepted["acceptance_rate"],
            "heldout_accepted_length": accepted["mean_accepted_length"]}
