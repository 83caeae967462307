"""Proposers of draft tokens: a draft model and n-gram prompt lookup (a speculative chain, a
decoder drafting for a larger target, is `jaxspec.engine.chain.ChainDrafter`).

Shape key: b rows, l sequence-buffer slots, p padded prompt length, k draft tokens, v vocabulary.

Every drafter answers the same two calls inside the compiled step:

- `init(params, tokens_bp, prompt_len_b, cache_len)` -> state, once after the prompts are known;
- `propose(params, state, seq_bl, pending_b, k, key_b, sampling)` -> (Proposal, state);

and `init_deferred`, the state for rows that may not draft for a while (plain decoding first).

`seq_bl` holds each row's whole sequence so far; `pending_b` is the position of the last emitted
token (the one the target has not processed yet), so the committed sequence of row b is
seq[b, :pending_b + 1]. A `Proposal` carries the tokens, the distribution each was drawn from (q,
after the same sampling transforms the target uses; one-hot for deterministic proposals), how many
leading proposals are real, and a confidence per token that TETRIS ranks.

Drafters decide what to propose, never how many tokens to verify (the engine and policy do).
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.models.cache import KVCache
from jaxspec.models.model import forward, init_cache
from jaxspec.sampling import SamplingConfig, probabilities

_F32 = jnp.float32


@struct.dataclass
class Proposal:
    """What a drafter proposes for every row.

    Attributes:
      tokens_bk: int [b, k] draft tokens (zeros past num_drafts_b).
      q_bkv: float [b, k, v] the distribution each token was drawn from; rejection sampling needs
        it to stay lossless.
      num_drafts_b: int [b] how many leading tokens are real proposals.
      logprob_bk: float [b, k] log of the estimated probability that draft j is accepted given
        drafts 1..j-1 (TETRIS ranks cumulative sums of it). It may depend on the drawn token only
        when the draw is deterministic given the prefix; for a random draw it is the expectation
        over the draw (see `draft_logprob`), which keeps TETRIS lossless under sampling.
    """

    tokens_bk: jax.Array
    q_bkv: jax.Array
    num_drafts_b: jax.Array
    logprob_bk: jax.Array


def draft_logprob(logits_bv, token_b, q_bv, sampling: SamplingConfig, deterministic: bool):
    """The default acceptance surrogate of one draft position (the paper's draft probability).

    A deterministic draw (greedy drafting, n-gram) may be scored by its own token: the draft model's
    probability of it (at temperature 1 when verification is greedy, else under the sampling
    transforms). A random draw must not be: if whether slot j is verified depended on the token
    drawn there, the verified tokens would be a biased sample and rejection sampling would no
    longer reproduce the target's distribution. It is scored by E_{x~q}[q(x)] = sum q^2, the
    expectation of the paper's score over the draw, which is a function of the prefix alone.
    """
    if not deterministic:
        return jnp.log(jnp.sum(q_bv * q_bv, axis=-1))
    dist_bv = jax.nn.softmax(logits_bv.astype(_F32), axis=-1) if sampling.greedy else probabilities(logits_bv, sampling)
    return jnp.log(jnp.take_along_axis(dist_bv, token_b[:, None], axis=-1)[:, 0])


class Drafter:
    """Base class: the interface the engine calls (see the module docstring)."""

    #: target layers whose inputs this drafter reads (EAGLE heads); the engine then hands it the
    #: target's features of every token the target keeps, through `absorb`, in the same step
    feature_layers: tuple[int, ...] = ()

    def absorb(self, params, state, features_bwf, next_bw, count_b):
        """Takes in the target's features of the first `count_b` tokens of a pass (the tokens
        the target kept, at positions lengths[b] + j) and the token after each (`next_bw`).
        Only drafters with `feature_layers` are called."""
        return state

    #: draft-model forwards per step for k proposals (statistics only)
    def forwards_per_step(self, k: int) -> int:
        return 0

    @property
    def params(self):
        return ()

    def static(self) -> Drafter:
        """This drafter as a compiled program's static argument: equal to it, holding no weights
        (a program's cache keeps its static arguments alive, and with them whatever they hold)."""
        return self

    @property
    def vocab_size(self) -> int | None:
        return None

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        return ()

    def init_deferred(self, params, tokens_bp, prompt_len_b, cache_len: int):
        """The state for rows that may not draft for a while (the goodput policy starts them with
        plain decoding): a drafter whose `propose` catches up on tokens it has not seen may skip
        its prefill here; by default the same as `init`. Same structure and shapes as `init`."""
        return self.init(params, tokens_bp, prompt_len_b, cache_len)

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        raise NotImplementedError

    def propose_tree(self, params, state, seq_bl, pending_b, shape, sampling: SamplingConfig):
        """A draft tree per row (`jaxspec.drafting.trees.Tree`, its root the pending token), and the state."""
        raise ValueError(f"{type(self).__name__} cannot draft trees yet; SpecConfig(tree=...) needs a draft "
                         "Model, an EAGLE head or n-gram lookup")


def prefill_cache(graphdef, params, tokens_bp, prompt_len_b, cache_len: int) -> KVCache:
    """A drafter model's cache after the prompts, committed to all but the last prompt token
    (each propose re-feeds the last two committed tokens)."""
    cache = init_cache(graphdef, params, tokens_bp.shape[0], cache_len)
    _, cache = forward(graphdef, params, tokens_bp, cache, jnp.zeros_like(tokens_bp[:, :1]), empty=True)
    return cache.commit(prompt_len_b - 1)


CATCH_UP_CHUNK = 8


def catch_up(graphdef, params, cache: KVCache, seq_bl, upto_b, chunk: int = CATCH_UP_CHUNK) -> KVCache:
    """Makes a drafter model's cache hold every position below `upto_b`, committed to it.

    The cache is trusted up to min(lengths, upto) (past that it may hold rejected drafts). Usually
    nothing is missing and the loop does not run; after steps that skipped drafting (the goodput
    policy's k = 0) each row feeds its missing tokens, `chunk` at a time, at its own position.
    """
    return feed_missing(graphdef, params, cache, seq_bl, upto_b, chunk)[0]


def feed_missing(graphdef, params, cache: KVCache, seq_bl, upto_b, chunk: int = CATCH_UP_CHUNK, reader=None):
    """`catch_up`, returning (cache, reader state); `reader` = (drafter, params, state) of a drafter
    reading this model's features (an EAGLE head under a chain level), which absorbs every token
    fed. Its state must hold exactly the rows of the trusted cache (`EagleDrafter.truncate`)."""
    cache = cache.commit(jnp.minimum(cache.lengths, upto_b))
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    drafter, drafter_params, drafter_state = reader if reader is not None else (None, None, ())
    features = drafter.feature_layers if reader is not None else ()

    def feed(carry):
        cache, drafter_state = carry
        n_b = jnp.maximum(jnp.minimum(upto_b - cache.lengths, chunk), 0)
        at_bc = jnp.minimum(cache.lengths[:, None] + offsets, seq_bl.shape[1] - 1)
        tokens_bc = jnp.take_along_axis(seq_bl, at_bc, axis=1)
        out = forward(graphdef, params, tokens_bc, cache, jnp.zeros_like(tokens_bc[:, :1]), features=features)
        if features:
            next_bc = jnp.take_along_axis(seq_bl, jnp.minimum(at_bc + 1, seq_bl.shape[1] - 1), axis=1)
            drafter_state = drafter.absorb(drafter_params, drafter_state, out[2], next_bc, n_b)
        # Rows already caught up wrote only past their committed length: harmless, never read.
        return out[1].commit(cache.lengths + n_b), drafter_state

    return jax.lax.while_loop(lambda c: jnp.any(c[0].lengths < upto_b), feed, (cache, drafter_state))


def draft_chain(graphdef, params, cache: KVCache, logits_bv, k: int, key_b, draw_one):
    """k autoregressive draws from a draft model: `draw_one(logits, keys)` -> (token, q, score)
    turns the logits after the last fed token into a draw; each draw but the last is fed back
    (committed). Returns the k draws stacked along axis 1, and the cache."""
    keys_bk = jax.vmap(lambda key: jax.random.split(key, k))(key_b)
    first = draw_one(logits_bv, keys_bk[:, 0])

    def step(carry, keys_b):
        cache, token_b = carry
        logits_b1v, cache = forward(graphdef, params, token_b[:, None], cache)
        drawn = draw_one(logits_b1v[:, 0], keys_b)
        return (cache.commit(cache.lengths + 1), drawn[0]), drawn

    (cache, _), rest = jax.lax.scan(step, (cache, first[0]), jnp.swapaxes(keys_bk[:, 1:], 0, 1))
    return tuple(jnp.concatenate([a[:, None], jnp.swapaxes(r, 0, 1)], axis=1) for a, r in zip(first, rest)), cache


def abstract(obj, fields=("params",)):
    """A shallow copy of `obj` whose `fields` are pytrees of shapes and dtypes instead of arrays."""
    twin = copy.copy(obj)
    for field in fields:
        setattr(twin, field, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), getattr(obj, field)))
    return twin
