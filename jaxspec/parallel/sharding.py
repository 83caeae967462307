"""Logical axes -> mesh axes: the one table, and what it gives for params, caches and inputs.
Megatron-style: heads, MLP width and vocabulary split over `tensor`, batch rows over `data`, the
rest replicated (XLA inserts the collectives); a name missing from `RULES` is an error.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.models.eagle import EagleHead
from jaxspec.models.model import Model
from jaxspec.parallel.mesh import DATA, TENSOR

RULES: dict[str, str | None] = {
    "batch": DATA, "heads": TENSOR, "kv_heads": TENSOR, "mlp": TENSOR, "vocab": TENSOR,
    "embed": None, "head_dim": None, "cache_slots": None,
    "fused": None,      # a block's fused q/k/v or gate/up (behind kv_heads / mlp: shards stay contiguous)
    "features": None,   # an EAGLE-3 head's fused target features (jaxspec.models.eagle)
}

CACHE_AXES = ("batch", "cache_slots", "kv_heads", "head_dim")


def partition_spec(axes: tuple[str, ...]) -> PartitionSpec:
    """The PartitionSpec of an array whose dimensions carry these logical names."""
    unknown = [a for a in axes if a not in RULES]
    if unknown:
        raise ValueError(f"logical axes {unknown} have no rule in jaxspec.parallel.sharding.RULES")
    return PartitionSpec(*(RULES[a] for a in axes))


def param_shardings(model, mesh: Mesh) -> dict:
    """Pytree parallel to `model.params` (or to the logical axes of a config) of NamedShardings."""
    return jax.tree.map(lambda a: NamedSharding(mesh, partition_spec(a)), model.logical_axes,
                        is_leaf=lambda x: isinstance(x, tuple))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _place(params, shardings):
    def put(x, s):
        if getattr(x, "sharding", None) == s:
            return x
        # A mesh spanning processes: every process holds the same host value and sends its shards.
        return jax.device_put(x if s.is_fully_addressable else np.asarray(x), s)

    return jax.tree.map(put, params, shardings)


def place_params(model, mesh: Mesh):
    """`model` with its params on `mesh` by the rules (each device receives only its shard)."""
    params = _place(model.params, param_shardings(model, mesh))
    return Model(model.config, params, dtype=model.dtype, tokenizer=model.tokenizer, quantization=model.quantization)


def place_head(head, mesh: Mesh, target):
    """An EAGLE head's params on its (placed) target's mesh by the rules, bound to the target's
    embedding as placed there."""
    params = _place(head.params, param_shardings(head, mesh))
    return EagleHead(head.config, head.graphdef, params, head.draft_ids, target.params["embed_vd"])


def put(tree, sharding: NamedSharding):
    """Places host or device values on `sharding`, also when its mesh spans processes (every process
    then passes the same full value and contributes the shards its devices hold)."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)

    def one(x):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            data = jax.make_array_from_process_local_data(sharding, np.asarray(jax.random.key_data(x)))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.map(one, tree)


def constrain_cache(cache, mesh: Mesh):
    """Inside a trace: lay the KV cache out over (data, tensor) by CACHE_AXES, its lengths over data."""
    spec, rows = NamedSharding(mesh, partition_spec(CACHE_AXES)), NamedSharding(mesh, PartitionSpec(DATA))
    return cache.replace(k=tuple(jax.lax.with_sharding_constraint(x, spec) for x in cache.k),
                         v=tuple(jax.lax.with_sharding_constraint(x, spec) for x in cache.v),
                         lengths=jax.lax.with_sharding_constraint(cache.lengths, rows))
