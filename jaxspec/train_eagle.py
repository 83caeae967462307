"""Training EAGLE-3 heads on the target's own features and distributions.

Shape key: b batch rows, t positions, f fused features, d head width, w draft vocabulary,
v target vocabulary, s training-time-test steps.

Each step runs the target once over a batch of sequences inside the compiled step (under
`stop_gradient`): its features of the chosen layers and its next-token distributions are the
head's inputs and labels, so no [n, t, v] tensor is stored. Labels are the target's distribution
renormalised over the draft vocabulary (soft targets), so any text teaches the head to predict the
target, not the text's author.

Training-time test (EAGLE-3): the head is unrolled over `ttt_steps` steps as it drafts. At step s,
row j feeds the head's own output of step s - 1 (the fused target features at step 0) with the
true token at j + 1 + s, at rotary position j + s; it attends to the step-0 keys of rows <= j and
to its own keys of steps 1..s (the rows drafting reads from the cache), and is scored against the
target's distribution of the token at j + 2 + s. The loss is the sum over steps of 0.8^s times the
cross-entropy, at positions where the target's own choice lies in the draft vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.distill import batch_indices, make_optimizer
from jaxspec.models.eagle import EagleHead
from jaxspec.models.model import Model

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


def _target_pass(target_graphdef, target_params, tokens_bt, features):
    decoder = nnx.merge(target_graphdef, target_params)
    hidden_btd, features_btf = decoder.hidden_uncached(tokens_bt, features)
    return features_btf, decoder.head(hidden_btd)


def eagle_loss(params, target_logits_btv, features_btf, tokens_bt, lengths_b, embed_vd, draft_ids, *, graphdef,
               steps: int):
    """EAGLE-3's training loss and each step's top-1 agreement with the target (module docstring)."""
    b, t, _ = features_btf.shape
    target_bTw = jnp.pad(target_logits_btv[..., draft_ids], ((0, 0), (0, steps + 1), (0, 0)))
    choice_bT = jnp.pad(jnp.argmax(target_logits_btv, axis=-1), ((0, 0), (0, steps + 1)))
    in_draft_v = jnp.zeros((target_logits_btv.shape[-1],), bool).at[draft_ids].set(True)
    total, agree = 0.0, []
    for s, logits_btw in enumerate(ttt_logits(graphdef, params, embed_vd, features_btf, tokens_bt, steps)):
        at = slice(1 + s, 1 + s + t)
        p_btw = jax.nn.softmax(target_bTw[:, at].astype(_F32), axis=-1)
        mask_bt = ((jnp.arange(t)[None, :] + 1 + s < lengths_b[:, None]) & in_draft_v[choice_bT[:, at]]).astype(_F32)
        xent_bt = -jnp.sum(p_btw * jax.nn.log_softmax(logits_btw.astype(_F32), axis=-1), axis=-1)
        count = jnp.maximum(jnp.sum(mask_bt), 1.0)
        total = total + STEP_WEIGHT ** s * jnp.sum(xent_bt * mask_bt) / count
        hit_bt = draft_ids[jnp.argmax(logits_btw, axis=-1)] == choice_bT[:, at]
        agree.append(jnp.sum(hit_bt * mask_bt) / count)
    return total, jnp.stack(agree)


@functools.partial(jax.jit, static_argnames=("graphdef", "target_graphdef", "features", "hparams", "steps"),
                   donate_argnums=(0, 1))
def _train_step(params, opt_state, target_params, tokens_bt, lengths_b, draft_ids, *, graphdef, target_graphdef,
                features, hparams: tuple, steps: int):
    optimizer, _ = make_optimizer(*hparams)
    features_btf, target_logits_btv = jax.lax.stop_gradient(
        _target_pass(target_graphdef, target_params, tokens_bt, features))
    loss_fn = functools.partial(eagle_loss, graphdef=graphdef, steps=steps)
    (value, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, target_logits_btv, features_btf, tokens_bt, lengths_b, target_params["embed_vd"], draft_ids)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": value, "agree": agree,
                                                             "grad_norm": optax.tree.norm(grads)}


def _sequences(target: Model, data, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences [n, seq_len] (cut, zero-padded) and their lengths; texts are encoded."""
    rows = []
    for item in data:
        if isinstance(item, str):
            if target.tokenizer is None:
                raise ValueError("data holds texts but the target has no tokenizer; pass token-id lists")
            item = target.tokenizer.encode(item)
        rows.append([int(x) for x in item][:seq_len])
    rows = [row for row in rows if len(row) >= 3]
    if not rows:
        raise ValueError("data must hold at least one sequence of 3 or more tokens")
    tokens = np.zeros((len(rows), seq_len), np.int32)
    for i, row in enumerate(rows):
        if max(row) >= target.config.vocab_size or min(row) < 0:
            raise ValueError(f"data token ids must lie in [0, {target.config.vocab_size})")
        tokens[i, :len(row)] = row
    return tokens, np.array([len(row) for row in rows], np.int32)


def train_eagle(target: Model, head: EagleHead, data, steps: int, learning_rate: float, seed: int = 0, *,
                batch_size: int = 8, seq_len: int = 128, ttt_steps: int = 3, warmup_steps: int | None = None,
                weight_decay: float = 0.0, clip_norm: float | None = 0.5, callback=None):
    """Trains `head` to draft for `target` on `data`; returns (trained head, history).

    Args:
      target: the model the head drafts for (frozen).
      head: an `EagleHead` for this target (`EagleHead.init(target)`).
      data: texts (the target's tokenizer encodes them) or token-id lists; each is cut to
        `seq_len` tokens.
      steps, learning_rate: optimizer steps; AdamW's peak rate (linear warm-up over
        `warmup_steps`, default 5% of the steps, then cosine decay to 10%).
      seed: the batch order (a function of seed and step, `distill.batch_indices`).
      ttt_steps: training-time-test unroll (module docstring).
      callback: called as `callback(step, metrics)` after each step.

    Returns:
      (EagleHead with the trained weights, history: one dict per step with loss, agree (per
      unrolled step: top-1 agreement with the target) and grad_norm).
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
    if not isinstance(ttt_steps, int) or ttt_steps < 1:
        raise ValueError(f"ttt_steps must be a positive int, got {ttt_steps!r}")
    if head.config.target_hidden_size != target.config.hidden_size or (
            head.config.target_vocab_size != target.config.vocab_size):
        raise ValueError("head does not fit target: its target_hidden_size / target_vocab_size are "
                         f"{head.config.target_hidden_size} / {head.config.target_vocab_size}, the target's "
                         f"{target.config.hidden_size} / {target.config.vocab_size}")
    tokens, lengths = _sequences(target, data, seq_len)
    warmup = max(1, steps // 20) if warmup_steps is None else warmup_steps
    hparams = (float(learning_rate), steps, warmup, float(weight_decay), clip_norm)
    optimizer, _ = make_optimizer(*hparams)
    params = jax.tree.map(jnp.array, head.params)   # a copy: the steps donate their inputs
    opt_state = optimizer.init(params)
    draft_ids = jnp.asarray(head.draft_ids)
    history = []
    for step in range(steps):
        rows = batch_indices(seed, step, batch_size, len(tokens))
        params, opt_state, metrics = _train_step(
            params, opt_state, target.params, jnp.asarray(tokens[rows]), jnp.asarray(lengths[rows]), draft_ids,
            graphdef=head.graphdef, target_graphdef=target.graphdef, features=head.config.feature_layers,
            hparams=hparams, steps=ttt_steps)
        metrics = {"step": step + 1, "loss": float(metrics["loss"]), "agree": [float(a) for a in metrics["agree"]],
                   "grad_norm": float(metrics["grad_norm"])}
        history.append(metrics)
        if callback is not None:
            callback(step + 1, metrics)
    trained = EagleHead(head.config, head.graphdef, params, head.draft_ids, head.embed_vd)
    return trained, history
