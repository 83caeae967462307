"""The suite's compile counter sees every jit cache miss, also those the persistent cache serves."""

import jax
import jax.numpy as jnp


def _new_step():
    # A new function object each call, as each decoder builds its own: jit's in-memory cache misses.
    def step(x):
        return jnp.sin(x) * 3.0 + 1.0

    return jax.jit(step)


def test_a_recompilation_served_by_the_persistent_cache_still_counts(compile_counter):
    x = jnp.arange(7.0)
    _new_step()(x).block_until_ready()  # compiled, and written to the session's cache
    assert jax.config.jax_compilation_cache_dir
    with compile_counter() as again:
        _new_step()(x).block_until_ready()  # traced again; the executable comes from the cache
    assert again.count == 1
    step, y = _new_step(), jnp.arange(9.0)
    with compile_counter() as other_shape:
        step(y).block_until_ready()  # a new shape: compiled
        step(y).block_until_ready()  # jit's own cache: nothing produced
    assert other_shape.count == 1
