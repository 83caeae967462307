"""`NgramDrafter`: prompt lookup in each row's own context (no model), as a chain or a tree.

Shape key: b rows, l sequence-buffer slots, k draft tokens, v vocabulary, w tree columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.drafting.base import Drafter, Proposal
from jaxspec.drafting.trees import Tree, TreeShape
from jaxspec.sampling import SamplingConfig

_F32 = jnp.float32


class NgramDrafter(Drafter):
    """Prompt lookup: continue the latest earlier occurrence of the row's last n tokens.

    Tries n = max_ngram down to min_ngram and takes the longest suffix that occurred before in the
    row's own context (prompt and generated text). Proposals are deterministic (q one-hot); a row
    with no match, or a continuation that runs into the present, proposes fewer real tokens.
    """

    free = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, vocab_size: int | None = None):
        if not isinstance(max_ngram, int) or not isinstance(min_ngram, int) or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramDrafter needs 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, "
                             f"max_ngram={max_ngram!r}")
        self.max_ngram, self.min_ngram, self._vocab = max_ngram, min_ngram, vocab_size

    def __repr__(self):
        return f"NgramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

    def _key(self):
        return (self.max_ngram, self.min_ngram, self._vocab)

    def bind_vocab(self, vocab_size: int) -> NgramDrafter:
        return NgramDrafter(self.max_ngram, self.min_ngram, vocab_size)

    def _scores(self, seq_bl, pending_b):
        """int [b, l]: n * l + c at each slot c that continues an earlier occurrence of the row's last n
        tokens (the longest such n), -1 elsewhere. The largest is the pick: the longest match, then the latest."""
        b, slots = seq_bl.shape
        slot_l = jnp.arange(slots)
        score_bl = jnp.full((b, slots), -1, jnp.int32)
        for n in range(self.min_ngram, self.max_ngram + 1):
            suffix_bn = jnp.take_along_axis(seq_bl, jnp.clip(pending_b[:, None] - n + 1 + jnp.arange(n), 0), axis=1)
            # Occurrences start at slot s, end before the suffix itself does, in a row long enough.
            match_bl = (slot_l[None, :] + n <= pending_b[:, None]) & (pending_b[:, None] + 1 >= n)
            for j in range(n):
                match_bl &= jnp.take(seq_bl, jnp.clip(slot_l + j, 0, slots - 1), axis=1) == suffix_bn[:, j:j + 1]
            continues_bl = jnp.pad(match_bl, ((0, 0), (n, 0)))[:, :slots]   # slot s + n continues it
            score_bl = jnp.where(continues_bl, n * slots + slot_l[None, :], score_bl)
        return score_bl

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        score_bl = self._scores(seq_bl, pending_b)
        start_b = jnp.argmax(score_bl, axis=1)
        # Proposals may only copy tokens that exist: up to and including the pending one.
        num_drafts_b = jnp.where(jnp.max(score_bl, axis=1) >= 0, jnp.clip(pending_b + 1 - start_b, 0, k), 0)
        num_drafts_b = num_drafts_b.astype(jnp.int32)
        tokens_bk = jnp.take_along_axis(seq_bl, jnp.minimum(start_b[:, None] + jnp.arange(k), seq_bl.shape[1] - 1), 1)
        tokens_bk = jnp.where(jnp.arange(k)[None] < num_drafts_b[:, None], tokens_bk, 0)
        q_bkv = jax.nn.one_hot(tokens_bk, self._vocab, dtype=_F32)
        # No model, no confidence: equal scores, so TETRIS splits its budget evenly.
        proposal = Proposal(tokens_bk=tokens_bk, q_bkv=q_bkv, num_drafts_b=num_drafts_b,
                            logprob_bk=jnp.zeros(tokens_bk.shape, _F32))
        return proposal, state

    def propose_tree(self, params, state, seq_bl, pending_b, shape: TreeShape, sampling: SamplingConfig):
        """Up to W branches, each continuing one earlier occurrence of the row's last n tokens for
        D tokens (the longest n first, then the latest), with distinct first tokens. Branch i's
        node at depth d scores -(d + i) (no model, no probabilities: each token and each rank down
        counts as one unit of doubt); nodes past the present are unusable. Branch i sits in column
        1 + i at depth 1, below in the first child column of expanded node i (`TreeShape`'s layout)."""
        (b, slots), w = seq_bl.shape, shape.columns
        starts, cols_w, rows_b = shape.starts(), jnp.arange(w), jnp.arange(b)
        score_bl = self._scores(seq_bl, pending_b)
        tokens = jnp.zeros((b, w), jnp.int32).at[:, 0].set(seq_bl[rows_b, pending_b])
        parent = jnp.full((b, w), -1, jnp.int32)
        cum = jnp.full((b, w), -jnp.inf, _F32).at[:, 0].set(0.0)
        ancestor = jnp.broadcast_to(jnp.eye(w, dtype=bool), (b, w, w))
        for i in range(shape.width):
            start_b = jnp.argmax(score_bl, axis=1)
            found_b = jnp.max(score_bl, axis=1) >= 0
            score_bl = jnp.where(seq_bl == seq_bl[rows_b, start_b][:, None], -1, score_bl)   # distinct firsts
            above_b = jnp.zeros((b,), jnp.int32)
            for d in range(1, shape.depth + 1):
                col = 1 + i if d == 1 else starts[d - 1] + i * shape.width
                tokens = tokens.at[:, col].set(seq_bl[rows_b, jnp.minimum(start_b + d - 1, slots - 1)])
                parent = parent.at[:, col].set(above_b)
                cum = cum.at[:, col].set(jnp.where(found_b & (start_b + d - 1 <= pending_b), -float(d + i), -jnp.inf))
                ancestor = ancestor.at[:, col].set(ancestor[rows_b, above_b] | (cols_w == col)[None])
                above_b = jnp.full((b,), col, jnp.int32)
        return Tree(tokens_bw=tokens, parent_bw=parent, ancestor_bww=ancestor, cum_bw=cum), state
