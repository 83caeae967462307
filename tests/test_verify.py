"""The acceptance rules in isolation, against direct implementations of their formulas."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from jaxspec.sampling import SamplingConfig
from jaxspec.verify import greedy_accept, rejection_accept


def test_greedy_accept_matches_a_python_loop():
    rng = np.random.default_rng(0)
    b, k, v = 64, 5, 4  # small vocabulary: many partial matches
    logits = rng.normal(size=(b, k + 1, v))
    drafts = rng.integers(0, v, (b, k))
    usable = rng.integers(0, k + 1, b)
    got_a, got_next = greedy_accept(jnp.asarray(drafts), jnp.asarray(logits), jnp.asarray(usable))
    for i in range(b):
        target = logits[i].argmax(-1)
        a = 0
        while a < usable[i] and drafts[i, a] == target[a]:
            a += 1
        assert int(got_a[i]) == a
        assert int(got_next[i]) == target[a]


def _run_rejection(p, q, drafts, n, usable=None):
    """n independent acceptance draws for one row (p: [k+1, v], q: [k, v])."""
    k = drafts.shape[0]
    logits = jnp.log(jnp.asarray(p))[None].repeat(n, 0)
    qs = jnp.asarray(q)[None].repeat(n, 0)
    ds = jnp.asarray(drafts)[None].repeat(n, 0)
    us = jnp.full((n,), k if usable is None else usable, jnp.int32)
    keys = jax.random.split(jax.random.key(0), n)
    a, nxt = rejection_accept(keys, ds, qs, logits, us, SamplingConfig(temperature=1.0))
    return np.asarray(a), np.asarray(nxt)


def test_rejection_accept_follows_the_formulas():
    rng = np.random.default_rng(1)
    v, k, n = 5, 2, 40000
    p = rng.dirichlet(np.ones(v), size=k + 1)
    q = rng.dirichlet(np.ones(v), size=k)
    drafts = np.array([int(np.argmax(q[0])), int(np.argmax(q[1]))])
    a, nxt = _run_rejection(p, q, drafts, n)
    # Acceptance of draft j: min(1, p_j(x_j) / q_j(x_j)), independently along the row.
    alpha = np.minimum(1.0, p[np.arange(k), drafts] / q[np.arange(k), drafts])
    expected_a = np.array([1 - alpha[0], alpha[0] * (1 - alpha[1]), alpha[0] * alpha[1]])
    observed_a = np.bincount(a, minlength=k + 1)
    assert stats.chisquare(observed_a, expected_a * n).pvalue > 1e-3
    # After a rejection at j the next token is normalize(max(0, p_j - q_j)); after a full accept, p_k.
    for j in range(k + 1):
        if j < k:
            residual = np.maximum(p[j] - q[j], 0)
            residual /= residual.sum()
        else:
            residual = p[k]
        picked = nxt[a == j]
        observed = np.bincount(picked, minlength=v)
        support = residual > 0
        assert observed[~support].sum() == 0
        expected = residual[support] * len(picked)
        assert stats.chisquare(observed[support], expected * observed[support].sum() / expected.sum()).pvalue > 1e-3


def test_first_emitted_token_follows_p_whatever_q():
    """The marginal of the first emitted token is exactly p_0 (drafts drawn from q)."""
    rng = np.random.default_rng(2)
    v, n = 6, 30000
    p = rng.dirichlet(np.ones(v) * 0.5, size=2)
    q = rng.dirichlet(np.ones(v) * 0.5, size=1)
    draws = rng.choice(v, size=n, p=q[0])
    logits = jnp.log(jnp.asarray(p))[None].repeat(n, 0)
    a, nxt = rejection_accept(jax.random.split(jax.random.key(3), n), jnp.asarray(draws)[:, None],
                              jnp.asarray(q)[None].repeat(n, 0), logits, jnp.ones((n,), jnp.int32),
                              SamplingConfig(temperature=1.0))
    first = np.where(np.asarray(a) == 1, draws, np.asarray(nxt))
    assert stats.chisquare(np.bincount(first, minlength=v), p[0] * n).pvalue > 1e-3


def test_unusable_drafts_are_never_accepted():
    v, n = 4, 2000
    p = np.full((3, v), 0.25)
    q = np.full((2, v), 0.25)  # p == q: every usable draft is accepted
    a, _ = _run_rejection(p, q, np.array([1, 2]), n, usable=1)
    assert (a == 1).all()
    a, _ = _run_rejection(p, q, np.array([1, 2]), n, usable=0)
    assert (a == 0).all()
