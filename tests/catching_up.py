"""What the drafter tests share about the catch-up protocol (`Drafter.lag`, `Drafter.catch_up`) and
about static programs (no conditional, no loop whose trip count depends on data)."""

from __future__ import annotations

import re

import jax
import numpy as np

from jaxspec.models import attention
from jaxspec.sampling import SamplingConfig


def check_catch_up(drafter, state, reference, seq_bl, pending_b, width: int, k: int = 3):
    """Calls `catch_up(width)` on `state` until its lag is 0, checking that each call lowers it by
    exactly `width` (to 0 at least); then `state` proposes what `reference` (a state that took the
    same tokens in otherwise, e.g. as its prompt) proposes. Returns the caught-up state."""
    lag = jax.jit(drafter.lag)
    catch_up = jax.jit(drafter.catch_up, static_argnums=4)
    behind = np.asarray(lag(state, seq_bl, pending_b))
    assert behind.max() > 0 and not np.asarray(lag(reference, seq_bl, pending_b)).any()
    while behind.max() > 0:
        state = catch_up(drafter.params, state, seq_bl, pending_b, width)
        now = np.asarray(lag(state, seq_bl, pending_b))
        np.testing.assert_array_equal(now, np.maximum(behind - width, 0))
        behind = now
    propose = jax.jit(drafter.propose, static_argnums=(4, 6))
    keys_b = jax.random.split(jax.random.key(0), seq_bl.shape[0])
    want = propose(drafter.params, reference, seq_bl, pending_b, k, keys_b, SamplingConfig())[0]
    got = propose(drafter.params, state, seq_bl, pending_b, k, keys_b, SamplingConfig())[0]
    np.testing.assert_array_equal(got.num_drafts_b, want.num_drafts_b)
    assert np.asarray(got.num_drafts_b).all()
    np.testing.assert_array_equal(got.tokens_bk, want.tokens_bk)
    np.testing.assert_allclose(got.logprob_bk, want.logprob_bk, rtol=1e-4, atol=1e-4)
    return state


def assert_static(monkeypatch, fn, *args, static_argnums=()):
    """`fn` compiled for `args` has no conditional and only loops of a known trip count. Attention
    takes its plain path (the blocked one loops up to the longest row, not the drafters' doing)."""
    monkeypatch.setattr(attention, "ATTENTION", "plain")
    hlo = jax.jit(fn, static_argnums=static_argnums).lower(*args).compile().as_text()
    assert "conditional(" not in hlo
    loops = [line for line in hlo.splitlines() if re.search(r"\bwhile\(", line)]
    unknown = [line[:200] for line in loops if '"known_trip_count"' not in line]
    assert not unknown, unknown
