"""Drafters against brute-force references."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.sampling import SamplingConfig


def brute_force_ngram(seq, pending, k, max_n, min_n):
    """Latest earlier occurrence of the longest suffix (n = max_n..min_n), continuation <= pending."""
    context = list(seq[:pending + 1])
    for n in range(max_n, min_n - 1, -1):
        if len(context) < n:
            continue
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                follow = context[start + n:start + n + k]
                return follow + [0] * (k - len(follow)), len(follow)
    return [0] * k, 0


@pytest.mark.parametrize("max_n, min_n", [(3, 1), (2, 2), (4, 2)])
def test_ngram_proposals_match_brute_force(max_n, min_n):
    rng = np.random.default_rng(max_n * 10 + min_n)
    b, slots, k = 48, 40, 4
    seq = rng.integers(0, 5, (b, slots))  # tiny alphabet: plenty of repeats
    pending = rng.integers(0, slots - 1, b)
    drafter = jaxspec.NgramDrafter(max_ngram=max_n, min_ngram=min_n).bind_vocab(5)
    proposal, _ = drafter.propose((), (), jnp.asarray(seq), jnp.asarray(pending), k, None, SamplingConfig())
    tokens, q, num = proposal.tokens_bk, proposal.q_bkv, proposal.num_drafts_b
    for i in range(b):
        want, want_num = brute_force_ngram(seq[i].tolist(), int(pending[i]), k, max_n, min_n)
        assert int(num[i]) == want_num, i
        assert np.asarray(tokens[i]).tolist()[:want_num] == want[:want_num], i
    np.testing.assert_array_equal(np.asarray(q).argmax(-1), np.asarray(tokens))


def test_ngram_config_is_checked():
    with pytest.raises(ValueError, match="min_ngram"):
        jaxspec.NgramDrafter(max_ngram=1, min_ngram=2)
