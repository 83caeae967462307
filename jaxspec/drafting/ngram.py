"""`NgramDrafter`: prompt lookup in each row's own context (no model).

Shape key: b rows, l sequence-buffer slots, k draft tokens, v vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.drafting.base import Drafter, Proposal
from jaxspec.drafting.trees import ngram_tree
from jaxspec.sampling import SamplingConfig

_F32 = jnp.float32


class NgramDrafter(Drafter):
    """Prompt lookup: continue the latest earlier occurrence of the row's last n tokens.

    Tries n = max_ngram down to min_ngram and takes the longest suffix that occurred before in the
    row's own context (prompt and generated text). Proposals are deterministic (q one-hot); a row
    with no match, or a continuation that runs into the present, proposes fewer real tokens.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, vocab_size: int | None = None):
        if not isinstance(max_ngram, int) or not isinstance(min_ngram, int) or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramDrafter needs 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, "
                             f"max_ngram={max_ngram!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._vocab = vocab_size

    def __repr__(self):
        return f"NgramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

    def __eq__(self, other):
        return type(other) is NgramDrafter and other._key() == self._key()

    def __hash__(self):
        return hash(self._key())

    def _key(self):
        return (NgramDrafter, self.max_ngram, self.min_ngram, self._vocab)

    def bind_vocab(self, vocab_size: int) -> NgramDrafter:
        return NgramDrafter(self.max_ngram, self.min_ngram, vocab_size)

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        b, slots = seq_bl.shape
        start_i = jnp.arange(slots)
        best_start_b = jnp.full((b,), -1, jnp.int32)
        # Longest n first: a row keeps the first n that matched.
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            suffix_bn = jnp.take_along_axis(seq_bl, jnp.clip(pending_b[:, None] - n + 1 + jnp.arange(n), 0), axis=1)
            match_bl = jnp.ones((b, slots), bool)
            for j in range(n):
                shifted_bl = jnp.take(seq_bl, jnp.clip(start_i + j, 0, slots - 1), axis=1)
                match_bl &= shifted_bl == suffix_bn[:, j:j + 1]
            # An earlier occurrence ends before the suffix itself does, and the row is long enough.
            match_bl &= (start_i[None, :] + n <= pending_b[:, None]) & (pending_b[:, None] + 1 >= n)
            latest_b = jnp.max(jnp.where(match_bl, start_i[None, :], -1), axis=1)
            continuation_b = jnp.where(latest_b >= 0, latest_b + n, -1)
            best_start_b = jnp.where(best_start_b >= 0, best_start_b, continuation_b)
        found_b = best_start_b >= 0
        # Proposals may only copy tokens that exist: up to and including the pending one.
        num_drafts_b = jnp.where(found_b, jnp.clip(pending_b + 1 - best_start_b, 0, k), 0).astype(jnp.int32)
        index_bk = jnp.clip(best_start_b[:, None] + jnp.arange(k), 0, slots - 1)
        tokens_bk = jnp.take_along_axis(seq_bl, index_bk, axis=1)
        tokens_bk = jnp.where(jnp.arange(k)[None] < num_drafts_b[:, None], tokens_bk, 0)
        q_bkv = jax.nn.one_hot(tokens_bk, self._vocab, dtype=_F32)
        # No model, no confidence: equal scores, so TETRIS splits its budget evenly.
        proposal = Proposal(tokens_bk=tokens_bk, q_bkv=q_bkv, num_drafts_b=num_drafts_b,
                            logprob_bk=jnp.zeros(tokens_bk.shape, _F32))
        return proposal, state

    def propose_tree(self, params, state, seq_bl, pending_b, shape, sampling: SamplingConfig):
        return ngram_tree(seq_bl, pending_b, shape, self.max_ngram, self.min_ngram), state
