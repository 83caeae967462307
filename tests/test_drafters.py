"""Drafters against brute-force references."""

import jax
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


def test_deferred_draft_state_catches_up_to_the_same_proposals_as_a_prefilled_one():
    """A ModelDrafter started without its prefill (`init_deferred`, for rows that begin with plain
    decoding) proposes what a prefilled one proposes, after any number of tokens it never saw."""
    from jaxspec.drafting import ModelDrafter

    cfg = jaxspec.ModelConfig.preset("tiny")
    drafter = ModelDrafter(jaxspec.Model.random(cfg.replace(num_layers=1, name="tiny-1L"), seed=2))
    rng = np.random.default_rng(4)
    seq_bl = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 64)), jnp.int32)
    prompt_len_b = jnp.asarray([5, 12, 9], jnp.int32)
    p = int(prompt_len_b.max())
    for pending_b in ([5, 12, 9], [30, 13, 41]):     # right after the prompt, and after plain steps
        pending_b = jnp.asarray(pending_b, jnp.int32)
        keys_b = jax.random.split(jax.random.key(0), 3)
        eager = drafter.init(drafter.params, seq_bl[:, :p], prompt_len_b, 64)
        deferred = drafter.init_deferred(drafter.params, seq_bl[:, :p], prompt_len_b, 64)
        assert int(jnp.max(deferred.cache.lengths)) == 0
        want, _ = drafter.propose(drafter.params, eager, seq_bl, pending_b, 3, keys_b, SamplingConfig())
        got, _ = drafter.propose(drafter.params, deferred, seq_bl, pending_b, 3, keys_b, SamplingConfig())
        np.testing.assert_array_equal(got.tokens_bk, want.tokens_bk)
        np.testing.assert_allclose(got.logprob_bk, want.logprob_bk, rtol=1e-5, atol=1e-5)
