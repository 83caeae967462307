"""The KV cache: a plain pytree of preallocated buffers plus per-row lengths.

Shape key: b batch rows, s cache slots (= positions), k kv heads, h head dim.

Per layer, one key and one value buffer [b, s, k, h]; slot j of row b holds the token at position j.
A forward pass writes new tokens at slots `lengths[b] + t` without moving `lengths`; the caller
commits how many to keep, so undoing rejected tokens is only lowering `lengths`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.models.config import ModelConfig


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [b, s, k, h]
    v: tuple[jax.Array, ...]  # per layer [b, s, k, h]
    lengths: jax.Array  # int32 [b]: number of committed tokens of each row

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, max_len, config.num_kv_heads, config.resolved_head_dim)
        layers = range(config.num_layers)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in layers), v=tuple(jnp.zeros(shape, dtype) for _ in layers),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def commit(self, lengths: jax.Array) -> KVCache:
        """Sets each row's committed length (advance after a forward, or roll back)."""
        return self.replace(lengths=lengths.astype(jnp.int32))

    def move(self, src_bd: jax.Array, count_b: jax.Array, dst_start_b: jax.Array) -> KVCache:
        """Copies, in every row b, the keys and values at slots src_bd[b, :count_b[b]] to the slots
        from dst_start_b[b] on (an accepted draft-tree path); all reads happen before any write."""
        rows_b1 = jnp.arange(self.batch)[:, None]
        step_d = jnp.arange(src_bd.shape[1])
        dst_bd = jnp.where(step_d < count_b[:, None], dst_start_b[:, None] + step_d, self.max_len)
        src_bd = jnp.clip(src_bd, 0, self.max_len - 1)

        def moved(x):
            return x.at[rows_b1, dst_bd].set(x[rows_b1, src_bd], mode="drop")

        return self.replace(k=tuple(map(moved, self.k)), v=tuple(map(moved, self.v)))
