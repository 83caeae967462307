"""Drafters against brute-force references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catching_up import assert_static, check_catch_up

import jaxspec
from jaxspec.drafting import ModelDrafter
from jaxspec.drafting.trees import TreeShape
from jaxspec.engine.chain import ChainDrafter
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


def model_drafter_and_rows():
    """A tiny ModelDrafter, a sequence buffer of 3 rows, their prompt lengths and where they are
    after plain steps."""
    cfg = jaxspec.ModelConfig.preset("tiny")
    drafter = ModelDrafter(jaxspec.Model.random(cfg.replace(num_layers=1, name="tiny-1L"), seed=2))
    seq_bl = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (3, 64)), jnp.int32)
    return drafter, seq_bl, jnp.asarray([5, 12, 9], jnp.int32), jnp.asarray([30, 13, 41], jnp.int32)


def test_deferred_draft_state_catches_up_to_the_same_proposals_as_a_prefilled_one():
    """A ModelDrafter started without its prefill (`init_deferred`, for rows that begin with plain
    decoding) proposes, after one catch-up as wide as its lag, what a drafter prefilled with the
    same tokens proposes; partial catch-ups get there too, `width` tokens at a time."""
    drafter, seq_bl, prompt_len_b, later_b = model_drafter_and_rows()
    p = int(prompt_len_b.max())
    for pending_b in (prompt_len_b, later_b):     # right after the prompt, and after plain steps
        deferred = drafter.init_deferred(drafter.params, seq_bl[:, :p], prompt_len_b, 64)
        assert int(jnp.max(deferred.cache.lengths)) == 0
        prefilled = drafter.init(drafter.params, seq_bl[:, :int(pending_b.max())], pending_b, 64)
        width = int(jnp.max(drafter.lag(deferred, seq_bl, pending_b)))
        check_catch_up(drafter, deferred, prefilled, seq_bl, pending_b, width)
    check_catch_up(drafter, deferred, prefilled, seq_bl, pending_b, 7)


def chain_drafter(inner_k=2):
    """A chain level: a 2-layer middle model drafted for by a 1-layer one."""
    cfg = jaxspec.ModelConfig.preset("tiny")
    middle = jaxspec.Model.random(cfg.replace(num_layers=2, name="tiny-2L"), seed=5)
    smallest = ModelDrafter(jaxspec.Model.random(cfg.replace(num_layers=1, name="tiny-1L"), seed=2))
    return ChainDrafter(jaxspec.SpeculativeDecoder(middle, smallest, spec=jaxspec.SpecConfig(k=inner_k)))


def test_a_chain_level_catches_up_after_plain_steps():
    """A chain level that missed plain steps above it (its middle model and that model's drafter
    both behind) catches up `width` tokens a call, then proposes what a level prefilled with the
    same tokens proposes."""
    chain = chain_drafter()
    _, seq_bl, prompt_len_b, pending_b = model_drafter_and_rows()
    state = chain.init(chain.params, seq_bl[:, :int(prompt_len_b.max())], prompt_len_b, 64)
    reference = chain.init(chain.params, seq_bl[:, :int(pending_b.max())], pending_b, 64)
    np.testing.assert_array_equal(chain.lag(state, seq_bl, pending_b), pending_b - prompt_len_b)
    check_catch_up(chain, state, reference, seq_bl, pending_b, 8)


def test_propose_and_catch_up_compile_without_conditionals_or_data_dependent_loops(monkeypatch):
    drafter, seq_bl, prompt_len_b, pending_b = model_drafter_and_rows()
    keys_b = jax.random.split(jax.random.key(0), 3)
    for d in (drafter, chain_drafter()):
        state = d.init(d.params, seq_bl[:, :12], prompt_len_b, 64)
        assert_static(monkeypatch, d.propose, d.params, state, seq_bl, pending_b, 3, keys_b, SamplingConfig(),
                      static_argnums=(4, 6))
        assert_static(monkeypatch, d.catch_up, d.params, state, seq_bl, pending_b, 8, static_argnums=4)
    assert_static(monkeypatch, drafter.propose_tree, drafter.params, drafter.init(drafter.params, seq_bl[:, :12],
                  prompt_len_b, 64), seq_bl, pending_b, TreeShape(2, 2), SamplingConfig(), static_argnums=(4, 5))
