"""`SuffixDrafter`: suffix decoding (SuffixDecoding, arXiv 2411.04975) from a corpus of earlier
requests and each row's own context, with no model.

Shape key: b rows, l sequence slots, k drafts, c candidates (a source and a match length each),
x points read at once, o occurrences, d match lengths, w tree columns.

Both sources are token strings in lexicographic order: those that begin with a pattern are a range
(a node of SuffixDecoding's suffix tree, depth max_depth; its count the range's size), those that
go on with a given token a sub-range, found by a fixed number of halvings. The corpus: every
position of a buffer of earlier requests (each followed by -1), sorted on the host by its next
max_depth tokens. The row's own context: the continuations of the `_OCCURRENCES` earlier ends of
its last tokens that match the most of them, sorted in the step. A node's children are read at
s = ceil(1 / min_token_prob) <= 16 evenly spaced strings of its range: a child holding >= 1/s of
it covers one, so every child above min_token_prob is found and counted exactly.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.drafting.base import Drafter, Proposal
from jaxspec.drafting.trees import TreeShape, grow_tree_from
from jaxspec.prompts import check_int
from jaxspec.sampling import SamplingConfig

_F32 = jnp.float32
_OCCURRENCES = 16   # earlier occurrences of the row's last tokens in its own context that are counted


class SuffixDrafter(Drafter):
    """Suffix decoding: continue the row's last tokens the way they went on most often before.

    For each match length m = 1..max_depth and each source (the row's own prompt and output, and
    the corpus of earlier requests), the path follows the most frequent next token while the
    running product of the count ratios (child count / node count) stays >= min_token_prob, for
    at most min(k, floor(max_spec_factor * m), max_depth - m) tokens; the row proposes the path
    with the largest sum of running products (ties: the corpus's, then the longer match). The
    proposal is deterministic (q one-hot); each token's log-probability is its log count ratio.

    Args:
      max_depth: the longest suffix matched (the suffix tree's depth).
      corpus_tokens: slots of the device corpus (a request takes its length plus one); when full,
        the oldest requests are evicted first. Memory: 8 bytes per slot.
      min_token_prob: a path stops where its running product falls below this.
      max_spec_factor: tokens drafted per matched token (SuffixDecoding's alpha).

    `SpeculativeDecoder.generate` adds finished requests (prompt and output) to the corpus at
    refills (see `remember`) and when the call ends, so later requests and calls draft from them;
    `forget()` empties it.
    """

    def __init__(self, max_depth: int = 24, corpus_tokens: int = 262144, min_token_prob: float = 0.1,
                 max_spec_factor: float = 1.0, vocab_size: int | None = None, corpus=None):
        check_int("max_depth", max_depth, 1)
        check_int("corpus_tokens", corpus_tokens, 1)
        if not (_number(min_token_prob) and 0 <= min_token_prob < 1):
            raise ValueError(f"min_token_prob must be in [0, 1), got {min_token_prob!r}")
        if not (_number(max_spec_factor) and max_spec_factor > 0):
            raise ValueError(f"max_spec_factor must be a number > 0, got {max_spec_factor!r}")
        self.max_depth, self.corpus_tokens, self._vocab = max_depth, corpus_tokens, vocab_size
        self.min_token_prob, self.max_spec_factor = float(min_token_prob), float(max_spec_factor)
        self.samples = 16 if min_token_prob < 1 / 16 else math.ceil(1 / min_token_prob - 1e-9)
        self.corpus = corpus if corpus is not None else _Corpus(corpus_tokens, max_depth)

    weights = {"text": "corpus.text", "order": "corpus.order"}
    free = True

    def __repr__(self):
        return (f"SuffixDrafter(max_depth={self.max_depth}, corpus_tokens={self.corpus_tokens}, "
                f"min_token_prob={self.min_token_prob}, max_spec_factor={self.max_spec_factor})")

    def _key(self):
        return (self.max_depth, self.corpus_tokens, self.min_token_prob, self.max_spec_factor, self._vocab)

    def bind_vocab(self, vocab_size: int) -> SuffixDrafter:
        """This drafter for a target vocabulary, sharing its corpus."""
        return SuffixDrafter(self.max_depth, self.corpus_tokens, self.min_token_prob, self.max_spec_factor,
                             vocab_size, self.corpus)

    def remember(self, sequences, final: bool = True) -> None:
        """Adds requests (token-id lists, each a prompt and its output) to the corpus, evicting the oldest
        past `corpus_tokens`. The device index is sorted again when `final`, or once the requests not in it
        hold as many tokens as those in it (a sort costs O(corpus): doubling bounds the cost per token)."""
        self.corpus.add(sequences, final)

    def forget(self) -> None:
        """Empties the corpus."""
        self.corpus.clear()

    def _paths(self, params, seq_bl, pending_b, steps: int):
        """Every candidate's path (`_walk`) and the reader of its strings: sources x match lengths."""
        sources = _candidates(params, seq_bl, pending_b, self.max_depth, steps)
        m_d = jnp.arange(1, self.max_depth + 1)
        budget_d = jnp.minimum(jnp.floor(self.max_spec_factor * m_d + 1e-6).astype(jnp.int32), self.max_depth - m_d)
        c_bd = jnp.broadcast_to(jnp.arange(self.max_depth), sources[0][1].shape)
        paths = [_walk(read, c_bd, lo, hi, budget_d, steps, self.samples, self.min_token_prob)
                 for read, lo, hi in sources]
        read = _either(sources[0][0], sources[1][0], self.max_depth)
        lo_bc, hi_bc = (jnp.concatenate([source[i] for source in sources], axis=1) for i in (1, 2))
        budget_bc = jnp.broadcast_to(jnp.tile(budget_d, 2), lo_bc.shape)
        path = tuple(jnp.concatenate(x, axis=1) for x in zip(*paths))
        return read, lo_bc, hi_bc, budget_bc, path

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        steps = max(1, min(k, self.max_depth - 1))
        _, _, _, _, (tokens, logq, est) = self._paths(params, seq_bl, pending_b, steps)
        tokens_bk, logq_bk, est_bk = (_take(x, _best(est)[:, None, None], 1)[:, 0] for x in (tokens, logq, est))
        used_bk = est_bk > 0
        pad = ((0, 0), (0, k - steps))
        tokens_bk, logq_bk = (jnp.pad(jnp.where(used_bk, x, 0), pad) for x in (tokens_bk, logq_bk))
        proposal = Proposal(tokens_bk=tokens_bk, q_bkv=jax.nn.one_hot(tokens_bk, self._vocab, dtype=_F32),
                            num_drafts_b=jnp.sum(used_bk, axis=1).astype(jnp.int32), logprob_bk=logq_bk)
        return proposal, state

    def propose_tree(self, params, state, seq_bl, pending_b, shape: TreeShape, sampling: SamplingConfig):
        """The tree of the candidate `propose` would take (its best path scored over the tree's
        depth), grown best-first on the running products of count ratios: depth 1 the W most
        frequent continuations, every later depth those of the W most probable nodes above (ties:
        the smaller token). Nodes below min_token_prob or past the candidate's budget are unusable."""
        b, rows_b1, width = seq_bl.shape[0], jnp.arange(seq_bl.shape[0])[:, None], shape.width
        steps = max(1, min(shape.depth, self.max_depth - 1))
        read, lo_bc, hi_bc, budget_bc, (_, _, est) = self._paths(params, seq_bl, pending_b, steps)
        best_b1, starts = _best(est)[:, None], shape.starts()

        def children(carry, d, expand_be, *_):
            lo_bw, hi_bw = carry
            lo_be, hi_be = _take(lo_bw, expand_be, 1), _take(hi_bw, expand_be, 1)
            token, first, last, count = _children(read, jnp.broadcast_to(best_b1, lo_be.shape), lo_be, hi_be, d,
                                                  self.samples)
            # the W most frequent distinct children (ties: the smaller token)
            distinct = jnp.concatenate([jnp.ones_like(token[..., :1], bool), token[..., 1:] != token[..., :-1]], -1)
            top, pick = jax.lax.top_k(jnp.where(distinct & (count > 0), count, -1), width)
            logq = jnp.where(top > 0, jnp.log(top / jnp.maximum(hi_be - lo_be, 1)[..., None]), -jnp.inf)
            token, first, last = (_take(x, pick) for x in (token, first, last))
            cols = starts[d] + jnp.arange(lo_be.shape[1] * width)
            carry = (lo_bw.at[:, cols].set(first.reshape(b, -1)), hi_bw.at[:, cols].set(last.reshape(b, -1)))
            return token, logq, carry

        lo_bw, hi_bw = (jnp.zeros((b, shape.columns), jnp.int32).at[:, :1].set(_take(x, best_b1, 1))
                        for x in (lo_bc, hi_bc))
        token, logq, carry = children((lo_bw, hi_bw), 0, jnp.zeros((b, 1), jnp.int32))
        root_b = seq_bl[rows_b1[:, 0], pending_b]
        tree, _ = grow_tree_from(root_b, (token, logq), shape, children, carry)
        unusable = ((tree.cum_bw < math.log(max(self.min_token_prob, 1e-30)))
                    | (jnp.asarray(shape.depth_w()) > _take(budget_bc, best_b1, 1)))
        cum_bw = jnp.where(unusable, -jnp.inf, tree.cum_bw)
        return tree.replace(tokens_bw=jnp.maximum(tree.tokens_bw, 0), cum_bw=cum_bw), state   # no -1 (an end) fed


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _take(x, index, axis=-1):
    return jnp.take_along_axis(x, index, axis)


def _best(est_bck):
    """Each row's candidate with the largest score, the sum of its running products (the last of
    equal ones: the corpus's, then the longer match)."""
    score_bc = jnp.sum(est_bck, axis=-1)
    return score_bc.shape[1] - 1 - jnp.argmax(score_bc[:, ::-1], axis=1)


class _Corpus:
    """The corpus on the host (requests, oldest first) and its device index: `text` (tokens with -1 after
    each request, and -1 padding) and `order` (text positions sorted by their next `depth` tokens)."""

    def __init__(self, slots: int, depth: int):
        self.slots, self.depth = slots, depth
        self.clear()

    def clear(self) -> None:
        self.requests, self.used, self.fresh = collections.deque(), 0, 0
        self._index()

    def add(self, sequences, final: bool = True) -> None:
        for seq in sequences:
            seq = np.asarray(seq, np.int64).reshape(-1)
            if seq.size and (seq.min() < 0 or seq.max() >= 2 ** 31 - 1):
                raise ValueError("corpus sequences must hold token ids >= 0")
            seq = seq[max(0, seq.size - (self.slots - 1)):]   # longer than the corpus: its end
            if seq.size:
                self.requests.append(seq)
                self.used, self.fresh = self.used + seq.size + 1, self.fresh + seq.size + 1
        while self.used > self.slots:
            self.used -= self.requests.popleft().size + 1
        if final or 2 * self.fresh >= self.used:
            self._index()

    def _index(self) -> None:
        text = np.full((self.slots + 2 * self.depth,), -1, np.int64)
        if self.requests:
            text[:self.used] = np.concatenate([np.r_[r, -1] for r in self.requests])
        end = self.used + self.depth
        order = np.concatenate([np.arange(end, self.slots + self.depth), _suffix_order(text[:end], self.depth)])
        self.text, self.order, self.fresh = jnp.asarray(text, jnp.int32), jnp.asarray(order, jnp.int32), 0


def _suffix_order(text: np.ndarray, depth: int) -> np.ndarray:
    """The positions of `text` sorted by their next `depth` tokens (-1 first; reads past the end
    count as -1), by prefix doubling: ranks of the first h tokens, then of pairs of ranks."""
    rank, h = text + 1, 1
    while h < depth and rank.size:
        shifted = np.concatenate([rank[h:], np.zeros(min(h, rank.size), np.int64)])
        rank = np.unique(rank * (rank.max() + 1) + shifted, return_inverse=True)[1].reshape(-1).astype(np.int64) + 1
        h *= 2
    return np.argsort(rank, kind="stable")


def _search(before, lo, hi, size: int):
    """The first index of [lo, hi) where the monotone `before(index)` turns false, by a fixed
    number of halvings (enough for ranges of `size`)."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        go = before(mid) & (lo < hi)
        return jnp.where(go, mid + 1, lo), jnp.where(go | (lo >= hi), hi, mid)

    return jax.lax.fori_loop(0, int(size).bit_length(), halve, (lo, hi))[0]


def _candidates(params, seq_bl, pending_b, depth: int, steps: int):
    """Both sources, the row's own context and the corpus, each as (read, lo, hi): `read(c_bc, i_bcx,
    j)` is the token at offset j after the match of string i of candidate c (match length c + 1;
    -1 past a string's end), [lo, hi) [b, depth] the candidates' nodes."""
    text, order = params["text"], params["order"]
    b, slots = seq_bl.shape
    rows_b1, m_d = jnp.arange(b)[:, None], jnp.arange(1, depth + 1)
    back_bj = jnp.clip(pending_b[:, None] - jnp.arange(depth), 0)
    # Own context: run[e] = length of the common suffix of seq[:e + 1] and seq[:pending + 1].
    e_l, same, run = jnp.arange(slots), jnp.ones((b, slots), bool), jnp.zeros((b, slots), jnp.int32)
    for j in range(depth):
        same &= (e_l >= j) & (jnp.take(seq_bl, jnp.clip(e_l - j, 0), axis=1) == seq_bl[rows_b1, back_bj[:, j:j + 1]])
        run += same
    # The O earlier ends matching the most of them (ties: the latest), their continuations sorted;
    # for match length m, those matching >= m tokens, after the others.
    run = jnp.where(e_l < pending_b[:, None], run, 0)
    key_bo = jax.lax.top_k(run * slots + e_l, min(_OCCURRENCES, slots))[0]
    at_boj = key_bo[..., None] % slots + 1 + jnp.arange(steps)
    cont = seq_bl[rows_b1[:, :, None], jnp.minimum(at_boj, slots - 1)]
    cont = jnp.where(at_boj <= pending_b[:, None, None], cont, -1)
    by_cont = jnp.lexsort(jnp.moveaxis(cont, -1, 0)[::-1], axis=-1)
    matched_bdo = jnp.take_along_axis(key_bo // slots, by_cont, 1)[:, None] >= m_d[:, None]
    own_bdo = jnp.take_along_axis(by_cont[:, None], jnp.argsort(matched_bdo, axis=-1, stable=True), 2)
    cont = jnp.take_along_axis(cont[:, None], own_bdo[..., None], 2)
    own_lo = jnp.sum(~matched_bdo, axis=-1).astype(jnp.int32)
    # Corpus: the range of strings whose first m tokens are the row's last m.
    pattern_bdj = jnp.where(jnp.arange(depth) < m_d[:, None], seq_bl[rows_b1[:, :, None], jnp.clip(
        pending_b[:, None, None] - m_d[:, None] + 1 + jnp.arange(depth), 0, slots - 1)], 0)

    def compare(mid_bdx):   # sign of (string mid's first m tokens) - pattern
        diff = text[order[mid_bdx][..., None] + jnp.arange(depth)] - pattern_bdj[:, :, None]
        diff = jnp.where(jnp.arange(depth) < m_d[:, None, None], diff, 0)
        return jnp.sign(jnp.take_along_axis(diff, jnp.argmax(diff != 0, axis=-1)[..., None], -1)[..., 0])

    n = order.shape[0]
    bound_bdx = _search(lambda mid: compare(mid) < jnp.array([0, 1]), jnp.zeros((b, depth, 2), jnp.int32),
                        jnp.full((b, depth, 2), n, jnp.int32), n)

    def own(c_bc, i_bcx, j):
        return cont[rows_b1[:, :, None], c_bc[..., None], jnp.clip(i_bcx, 0, cont.shape[2] - 1), min(j, steps - 1)]

    def corpus(c_bc, i_bcx, j):
        return text[jnp.clip(order[jnp.clip(i_bcx, 0, n - 1)] + c_bc[..., None] + 1 + j, 0, text.shape[0] - 1)]

    own.size, corpus.size = cont.shape[2], n   # the longest ranges: the number of halvings
    short_bd = pending_b[:, None] + 1 < m_d   # rows shorter than m
    return ((own, own_lo, jnp.where(short_bd, own_lo, cont.shape[2])),
            (corpus, bound_bdx[..., 0], jnp.where(short_bd, bound_bdx[..., 0], bound_bdx[..., 1])))


def _either(own, corpus, depth: int):
    """One reader of both sources' candidates, the row's own context's first."""
    def read(c_bc, i_bcx, j):
        return jnp.where((c_bc < depth)[..., None], own(jnp.minimum(c_bc, depth - 1), i_bcx, j),
                         corpus(jnp.maximum(c_bc - depth, 0), i_bcx, j))

    read.size = max(own.size, corpus.size)
    return read


def _children(read, c_bc, lo_bc, hi_bc, j: int, samples: int):
    """The tokens at offset j of `samples` evenly spaced strings of each node's range (ascending),
    and each one's sub-range [first, last) and count (0 for a string's end)."""
    n_bc = hi_bc - lo_bc
    token_bcs = read(c_bc, lo_bc[..., None] + n_bc[..., None] * jnp.arange(samples) // samples, j)
    target = jnp.concatenate([token_bcs, token_bcs + 1], axis=-1)
    bound = _search(lambda mid: read(c_bc, mid, j) < target, jnp.broadcast_to(lo_bc[..., None], target.shape),
                    jnp.broadcast_to(hi_bc[..., None], target.shape), read.size)
    first, last = bound[..., :samples], bound[..., samples:]
    return token_bcs, first, last, jnp.where((token_bcs >= 0) & (n_bc[..., None] > 0), last - first, 0)


def _walk(read, c_bc, lo_bc, hi_bc, budget_bc, steps: int, samples: int, min_prob: float):
    """Each candidate's most frequent path of `steps` tokens: tokens, log count ratios and the
    running products [b, c, steps], the products 0 from the first token that is not drafted."""
    est, alive, out = jnp.ones(lo_bc.shape, _F32), jnp.ones(lo_bc.shape, bool), []
    for j in range(steps):
        token, first, last, count = _children(read, c_bc, lo_bc, hi_bc, j, samples)
        best = jnp.argmax(count, axis=-1)[..., None]       # the first of equal counts: the smaller token
        token, first, last, count = (_take(x, best)[..., 0] for x in (token, first, last, count))
        ratio = count / jnp.maximum(hi_bc - lo_bc, 1)
        est = est * ratio
        alive &= (count > 0) & (est >= min_prob) & (j < budget_bc)
        out.append((token, jnp.log(ratio), jnp.where(alive, est, 0.0)))
        lo_bc, hi_bc = first, last
    return tuple(jnp.stack(x, axis=-1) for x in zip(*out))
