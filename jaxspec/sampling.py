"""Logits -> probabilities -> tokens, in float32, identical for draft and target models.

Speculative decoding is lossless only if q and p go through exactly the same transforms, so one
function, `probabilities`, applies them (as transformers' warpers): temperature, top-k, top-p.
Shape key: v vocabulary; leading axes are arbitrary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How tokens are chosen from logits. Attributes:
      temperature: 0 means greedy (argmax); otherwise logits are divided by it.
      top_k: keep only the k most likely tokens (0 = no limit). Tokens tied with the k-th are kept.
      top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits_v: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """The float32 distribution tokens are drawn from; one-hot of the argmax when greedy."""
    logits_v = logits_v.astype(jnp.float32)
    vocab = logits_v.shape[-1]
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits_v, axis=-1), vocab, dtype=jnp.float32)
    logits_v = logits_v / sampling.temperature
    if 0 < sampling.top_k < vocab:
        kth = jax.lax.top_k(logits_v, sampling.top_k)[0][..., -1:]
        logits_v = jnp.where(logits_v >= kth, logits_v, -jnp.inf)
    probs_v = jax.nn.softmax(logits_v, axis=-1)
    if sampling.top_p < 1.0:
        sorted_v = jnp.sort(probs_v, axis=-1)[..., ::-1]
        mass_before_v = jnp.cumsum(sorted_v, axis=-1) - sorted_v
        # The kept set is every token whose preceding mass is still short of top_p; the most
        # likely token is always kept. Ties with the smallest kept probability are kept too.
        kept = jnp.sum(mass_before_v < sampling.top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_v, kept - 1, axis=-1)
        probs_v = jnp.where(probs_v >= threshold, probs_v, 0.0)
        probs_v = probs_v / jnp.sum(probs_v, axis=-1, keepdims=True)
    return probs_v


def sample(key: jax.Array, probs_v: jax.Array) -> jax.Array:
    """One token id per distribution (leading axes batched under one key)."""
    return jax.random.categorical(key, jnp.log(probs_v), axis=-1).astype(jnp.int32)


def choose(keys_b: jax.Array, logits_bv: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Next token of each row: argmax when greedy, else a draw with that row's own key."""
    if sampling.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return jax.vmap(sample)(keys_b, probabilities(logits_bv, sampling))


def row_keys(request_keys_b: jax.Array, token_index_b: jax.Array) -> jax.Array:
    """The key for token j of request i: fold_in(request key i, j), never depending on the batch
    or the step count, so a request samples the same tokens alone or in any batch."""
    return jax.vmap(jax.random.fold_in)(request_keys_b, token_index_b)


def request_keys(seed: int, request_ids_b: np.ndarray) -> jax.Array:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return _fold_keys(_base_key(int(seed)), np.asarray(request_ids_b))


@functools.lru_cache(maxsize=64)
def _base_key(seed: int) -> jax.Array:
    # Made once per seed: building a key eagerly costs host time on every call.
    return jax.random.key(seed)


def clear_keys() -> None:
    """Forgets the keys of seeds seen (`jaxspec.clear_caches`)."""
    _base_key.cache_clear()


@jax.jit
def _fold_keys(base, request_ids_b):
    # Compiled: folding in eagerly, op by op, costs milliseconds of host time per call.
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(request_ids_b)
