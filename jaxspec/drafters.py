"""Proposers of draft tokens: a draft model and n-gram prompt lookup (a speculative chain, a
decoder drafting for a larger target, is `jaxspec.engine.chain.ChainDrafter`).

Shape key: b rows, l sequence-buffer slots, p padded prompt length, k draft tokens, v vocabulary.

Every drafter answers the same two calls inside the compiled step:

- `init(params, tokens_bp, prompt_len_b, cache_len)` -> state, once after the prompts are known;
- `propose(params, state, seq_bl, pending_b, k, key_b, sampling)` -> (Proposal, state);

and `init_deferred`, the state for rows that may not draft for a while (plain decoding first).

`seq_bl` holds each row's whole sequence so far; `pending_b` is the position of the last emitted
token (the one the target has not processed yet), so the committed sequence of row b is
seq[b, :pending_b + 1]. A `Proposal` carries the tokens, the distribution each was drawn from (q,
after the same sampling transforms the target uses; one-hot for deterministic proposals), how many
leading proposals are real, and a confidence per token that TETRIS ranks.

Drafters decide what to propose, never how many tokens to verify (the engine and policy do).
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.models import eagle as eagle_lib
from jaxspec.models.cache import KVCache
from jaxspec.models.model import Model, forward, init_cache
from jaxspec.sampling import SamplingConfig, choose, probabilities

_F32 = jnp.float32


@struct.dataclass
class Proposal:
    """What a drafter proposes for every row.

    Attributes:
      tokens_bk: int [b, k] draft tokens (zeros past num_drafts_b).
      q_bkv: float [b, k, v] the distribution each token was drawn from; rejection sampling needs
        it to stay lossless.
      num_drafts_b: int [b] how many leading tokens are real proposals.
      logprob_bk: float [b, k] log of the estimated probability that draft j is accepted given
        drafts 1..j-1 (TETRIS ranks cumulative sums of it). It may depend on the drawn token only
        when the draw is deterministic given the prefix; for a random draw it is the expectation
        over the draw (see `draft_logprob`), which keeps TETRIS lossless under sampling.
    """

    tokens_bk: jax.Array
    q_bkv: jax.Array
    num_drafts_b: jax.Array
    logprob_bk: jax.Array


def draft_logprob(logits_bv, token_b, q_bv, sampling: SamplingConfig, deterministic: bool):
    """The default acceptance surrogate of one draft position (the paper's draft probability).

    A deterministic draw (greedy drafting, n-gram) may be scored by its own token: the draft model's
    probability of it (at temperature 1 when verification is greedy, else under the sampling
    transforms). A random draw must not be: if whether slot j is verified depended on the token
    drawn there, the verified tokens would be a biased sample and rejection sampling would no
    longer reproduce the target's distribution. It is scored by E_{x~q}[q(x)] = sum q^2, the
    expectation of the paper's score over the draw, which is a function of the prefix alone.
    """
    if not deterministic:
        return jnp.log(jnp.sum(q_bv * q_bv, axis=-1))
    dist_bv = jax.nn.softmax(logits_bv.astype(_F32), axis=-1) if sampling.greedy else probabilities(logits_bv, sampling)
    return jnp.log(jnp.take_along_axis(dist_bv, token_b[:, None], axis=-1)[:, 0])


class Drafter:
    """Base class: the interface the engine calls (see the module docstring)."""

    #: target layers whose inputs this drafter reads (EAGLE heads); the engine then hands it the
    #: target's features of every token the target keeps, through `absorb`, in the same step
    feature_layers: tuple[int, ...] = ()

    def absorb(self, params, state, features_bwf, next_bw, count_b):
        """Takes in the target's features of the first `count_b` tokens of a pass (the tokens
        the target kept, at positions lengths[b] + j) and the token after each (`next_bw`).
        Only drafters with `feature_layers` are called."""
        return state

    #: draft-model forwards per step for k proposals (statistics only)
    def forwards_per_step(self, k: int) -> int:
        return 0

    @property
    def params(self):
        return ()

    def static(self) -> Drafter:
        """This drafter as a compiled program's static argument: equal to it, holding no weights
        (a program's cache keeps its static arguments alive, and with them whatever they hold)."""
        return self

    @property
    def vocab_size(self) -> int | None:
        return None

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        return ()

    def init_deferred(self, params, tokens_bp, prompt_len_b, cache_len: int):
        """The state for rows that may not draft for a while (the goodput policy starts them with
        plain decoding): a drafter whose `propose` catches up on tokens it has not seen may skip
        its prefill here; by default the same as `init`. Same structure and shapes as `init`."""
        return self.init(params, tokens_bp, prompt_len_b, cache_len)

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        raise NotImplementedError

    def propose_tree(self, params, state, seq_bl, pending_b, shape, sampling: SamplingConfig):
        """A draft tree per row (`jaxspec.trees.Tree`, its root the pending token), and the state."""
        raise ValueError(f"{type(self).__name__} cannot draft trees yet; SpecConfig(tree=...) needs a draft "
                         "Model, an EAGLE head or n-gram lookup")


def prefill_cache(graphdef, params, tokens_bp, prompt_len_b, cache_len: int) -> KVCache:
    """A drafter model's cache after the prompts, committed to all but the last prompt token
    (each propose re-feeds the last two committed tokens)."""
    cache = init_cache(graphdef, params, tokens_bp.shape[0], cache_len)
    _, cache = forward(graphdef, params, tokens_bp, cache, jnp.zeros_like(tokens_bp[:, :1]), empty=True)
    return cache.commit(prompt_len_b - 1)


CATCH_UP_CHUNK = 8


def catch_up(graphdef, params, cache: KVCache, seq_bl, upto_b, chunk: int = CATCH_UP_CHUNK) -> KVCache:
    """Makes a drafter model's cache hold every position below `upto_b`, committed to it.

    The cache is trusted up to min(lengths, upto) (past that it may hold rejected drafts). Usually
    nothing is missing and the loop does not run; after steps that skipped drafting (the goodput
    policy's k = 0) each row feeds its missing tokens, `chunk` at a time, at its own position.
    """
    return feed_missing(graphdef, params, cache, seq_bl, upto_b, chunk)[0]


def feed_missing(graphdef, params, cache: KVCache, seq_bl, upto_b, chunk: int = CATCH_UP_CHUNK, reader=None):
    """`catch_up`, returning (cache, reader state); `reader` = (drafter, params, state) of a drafter
    reading this model's features (an EAGLE head under a chain level), which absorbs every token
    fed. Its state must hold exactly the rows of the trusted cache (`EagleDrafter.truncate`)."""
    cache = cache.commit(jnp.minimum(cache.lengths, upto_b))
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    drafter, drafter_params, drafter_state = reader if reader is not None else (None, None, ())
    features = drafter.feature_layers if reader is not None else ()

    def feed(carry):
        cache, drafter_state = carry
        n_b = jnp.maximum(jnp.minimum(upto_b - cache.lengths, chunk), 0)
        at_bc = jnp.minimum(cache.lengths[:, None] + offsets, seq_bl.shape[1] - 1)
        tokens_bc = jnp.take_along_axis(seq_bl, at_bc, axis=1)
        out = forward(graphdef, params, tokens_bc, cache, jnp.zeros_like(tokens_bc[:, :1]), features=features)
        if features:
            next_bc = jnp.take_along_axis(seq_bl, jnp.minimum(at_bc + 1, seq_bl.shape[1] - 1), axis=1)
            drafter_state = drafter.absorb(drafter_params, drafter_state, out[2], next_bc, n_b)
        # Rows already caught up wrote only past their committed length: harmless, never read.
        return out[1].commit(cache.lengths + n_b), drafter_state

    return jax.lax.while_loop(lambda c: jnp.any(c[0].lengths < upto_b), feed, (cache, drafter_state))


def draft_chain(graphdef, params, cache: KVCache, logits_bv, k: int, key_b, draw_one):
    """k autoregressive draws from a draft model: `draw_one(logits, keys)` -> (token, q, score)
    turns the logits after the last fed token into a draw; each draw but the last is fed back
    (committed). Returns the k draws stacked along axis 1, and the cache."""
    keys_bk = jax.vmap(lambda key: jax.random.split(key, k))(key_b)
    first = draw_one(logits_bv, keys_bk[:, 0])

    def step(carry, keys_b):
        cache, token_b = carry
        logits_b1v, cache = forward(graphdef, params, token_b[:, None], cache)
        drawn = draw_one(logits_b1v[:, 0], keys_b)
        return (cache.commit(cache.lengths + 1), drawn[0]), drawn

    (cache, _), rest = jax.lax.scan(step, (cache, first[0]), jnp.swapaxes(keys_bk[:, 1:], 0, 1))
    return tuple(jnp.concatenate([a[:, None], jnp.swapaxes(r, 0, 1)], axis=1) for a, r in zip(first, rest)), cache


@struct.dataclass
class _ModelDraftState:
    cache: KVCache


class ModelDrafter(Drafter):
    """Drafts autoregressively with a smaller model on its own KV cache.

    Catch-up rule: each step rolls the draft cache back to pending - 1 and feeds the last two
    committed tokens. After a drafting step the cache holds every token before that (after a
    partial accept its drafts up to the accepted one are already there; after a full accept only
    the last draft and the bonus token are missing), so two tokens suffice and the shapes stay
    static; after steps without drafting, `catch_up` first feeds what was missed.
    """

    def __init__(self, model: Model, *, greedy: bool = False):
        self.model = model
        self.greedy = greedy

    # Compiled programs are keyed on the drafter: equal structure, equal program.
    def __eq__(self, other):
        return (type(other) is ModelDrafter and other.model.graphdef == self.model.graphdef
                and other.greedy == self.greedy)

    def __hash__(self):
        return hash((ModelDrafter, self.model.graphdef, self.greedy))

    def forwards_per_step(self, k: int) -> int:
        return k

    @property
    def params(self):
        return self.model.params

    def static(self) -> ModelDrafter:
        twin = copy.copy(self)
        twin.model = abstract(self.model)
        return twin

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        return _ModelDraftState(cache=prefill_cache(self.model.graphdef, params, tokens_bp, prompt_len_b, cache_len))

    def init_deferred(self, params, tokens_bp, prompt_len_b, cache_len: int):
        # An empty cache: the first propose feeds the prompt through `catch_up`. Where speculation
        # never starts (large batches) this saves the draft's prefill, 3-4% of a 96-token run.
        return _ModelDraftState(cache=init_cache(self.model.graphdef, params, tokens_bp.shape[0], cache_len))

    def _fed(self, params, state, seq_bl, pending_b):
        """The cache through the pending token (committed to it) and the logits after it."""
        cache = catch_up(self.model.graphdef, params, state.cache, seq_bl, pending_b - 1)
        last_two_b2 = jnp.take_along_axis(seq_bl, pending_b[:, None] + jnp.array([[-1, 0]]), axis=1)
        logits_b1v, cache = forward(self.model.graphdef, params, last_two_b2, cache, jnp.ones_like(pending_b)[:, None])
        return logits_b1v[:, 0], cache.commit(pending_b + 1)

    def propose_tree(self, params, state, seq_bl, pending_b, shape, sampling: SamplingConfig):
        from jaxspec.trees import draft_tree
        logits_bv, cache = self._fed(params, state, seq_bl, pending_b)
        root_b = jnp.take_along_axis(seq_bl, pending_b[:, None], axis=1)[:, 0]
        tree, cache = draft_tree(self.model.graphdef, params, cache.commit(pending_b), root_b, logits_bv, shape,
                                 SamplingConfig() if self.greedy else sampling)
        # The tree's nodes sit past the pending token's slot: untrusted, as rejected drafts are.
        return tree, _ModelDraftState(cache=cache.commit(pending_b + 1))

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        graphdef = self.model.graphdef
        draw = SamplingConfig() if self.greedy else sampling
        logits_bv, cache = self._fed(params, state, seq_bl, pending_b)

        def draw_one(logits_bv, keys_b):
            token_b, q_bv = choose(keys_b, logits_bv, draw), probabilities(logits_bv, draw)
            return token_b, q_bv, draft_logprob(logits_bv, token_b, q_bv, sampling, draw.greedy)

        (tokens_bk, q_bkv, logprob_bk), cache = draft_chain(graphdef, params, cache, logits_bv, k, key_b, draw_one)
        proposal = Proposal(tokens_bk=tokens_bk, q_bkv=q_bkv, logprob_bk=logprob_bk,
                            num_drafts_b=jnp.full(pending_b.shape, k, jnp.int32))
        return proposal, _ModelDraftState(cache=cache)


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
        from jaxspec.trees import ngram_tree
        return ngram_tree(seq_bl, pending_b, shape, self.max_ngram, self.min_ngram), state


@struct.dataclass
class _EagleState:
    cache: KVCache          # the head's cache, committed to the positions the target has kept
    hidden_bd: jax.Array    # the head's pre-norm output at the last kept position
    logits_bw: jax.Array    # its draft-vocabulary logits: the first draft's


def abstract(obj, fields=("params",)):
    """A shallow copy of `obj` whose `fields` are pytrees of shapes and dtypes instead of arrays."""
    twin = copy.copy(obj)
    for field in fields:
        setattr(twin, field, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), getattr(obj, field)))
    return twin


class EagleDrafter(Drafter):
    """Drafts with an EAGLE-3 head (`jaxspec.models.eagle`) fed by the target's own features.

    After every target pass the head takes in the kept tokens (`absorb`): row t pairs the
    target's features at t with the token at t + 1, so the last kept row already scores the first
    draft. `propose` then drafts k tokens, each later step feeding the head's own output at the
    drafted token. Drafted rows are never committed: the next `absorb` rewrites those cache slots
    from the target's features (EAGLE's reference does the same).
    """

    def __init__(self, head: eagle_lib.EagleHead):
        if head.embed_vd is None:
            raise ValueError("EagleDrafter needs a head bound to its target (EagleHead.init(target) or "
                             "jaxspec.load(path, target=target))")
        self.head = head
        self.feature_layers = head.config.feature_layers

    def __eq__(self, other):
        return (type(other) is EagleDrafter and other.head.graphdef == self.head.graphdef
                and other.head.config == self.head.config and np.array_equal(other.head.draft_ids, self.head.draft_ids))

    def __hash__(self):
        return hash((EagleDrafter, self.head.graphdef, self.head.config, self.head.draft_ids.tobytes()))

    def forwards_per_step(self, k: int) -> int:
        return k

    @property
    def params(self):
        return {"head": self.head.params, "embed_vd": self.head.embed_vd}

    def static(self) -> EagleDrafter:
        twin, twin.head = copy.copy(self), abstract(self.head, ("params", "embed_vd"))
        return twin

    @property
    def vocab_size(self) -> int:
        return self.head.config.target_vocab_size

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        b, d = tokens_bp.shape[0], self.head.config.layer.hidden_size
        cache = KVCache.init(self.head.config.layer, b, cache_len, params["head"]["fc_fd"].dtype)
        return _EagleState(cache=cache, hidden_bd=jnp.zeros((b, d), cache.k[0].dtype),
                           logits_bw=jnp.zeros((b, self.head.config.layer.vocab_size), _F32))

    def absorb(self, params, state, features_bwf, next_bw, count_b):
        graphdef = self.head.graphdef
        hidden_bwd = eagle_lib.fuse(graphdef, params["head"], features_bwf)
        logits_bww, out_bwd, cache = eagle_lib.head_forward(graphdef, params["head"], params["embed_vd"], hidden_bwd,
                                                            next_bw, state.cache)
        last_b1 = jnp.maximum(count_b - 1, 0)[:, None]
        kept_b = count_b > 0
        hidden_bd = jnp.where(kept_b[:, None], jnp.take_along_axis(out_bwd, last_b1[:, :, None], axis=1)[:, 0],
                              state.hidden_bd)
        logits_bw = jnp.where(kept_b[:, None], jnp.take_along_axis(logits_bww, last_b1[:, :, None], axis=1)[:, 0],
                              state.logits_bw)
        return _EagleState(cache=cache.commit(state.cache.lengths + count_b), hidden_bd=hidden_bd, logits_bw=logits_bw)

    def truncate(self, state, length_b):
        """The state with the head's rows from `length_b` on dropped (they are absorbed again);
        its last output is stale until the next `absorb`."""
        return state.replace(cache=state.cache.commit(jnp.minimum(state.cache.lengths, length_b)))

    def propose_tree(self, params, state, seq_bl, pending_b, shape, sampling: SamplingConfig):
        from jaxspec.trees import eagle_tree
        root_b = jnp.take_along_axis(seq_bl, pending_b[:, None], axis=1)[:, 0]
        return eagle_tree(self.head.graphdef, params["head"], params["embed_vd"], self.head.draft_ids,
                          self.head.config.target_vocab_size, state.cache, state.hidden_bd, state.logits_bw, root_b,
                          shape, sampling), state

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        graphdef, vocab = self.head.graphdef, self.head.config.target_vocab_size
        keys_bk = jax.vmap(lambda key: jax.random.split(key, k))(key_b)

        def draw_one(logits_bw, keys_b):
            logits_bv = eagle_lib.to_target_logits(logits_bw, self.head.draft_ids, vocab)
            token_b, q_bv = choose(keys_b, logits_bv, sampling), probabilities(logits_bv, sampling)
            return token_b, q_bv, draft_logprob(logits_bv, token_b, q_bv, sampling, sampling.greedy)

        first = draw_one(state.logits_bw, keys_bk[:, 0])

        def step(carry, keys_b):
            cache, hidden_bd, token_b = carry
            logits_b1w, out_b1d, cache = eagle_lib.head_forward(graphdef, params["head"], params["embed_vd"],
                                                                hidden_bd[:, None], token_b[:, None], cache)
            drawn = draw_one(logits_b1w[:, 0], keys_b)
            return (cache.commit(cache.lengths + 1), out_b1d[:, 0], drawn[0]), drawn

        (cache, _, _), rest = jax.lax.scan(step, (state.cache, state.hidden_bd, first[0]),
                                           jnp.swapaxes(keys_bk[:, 1:], 0, 1))
        tokens_bk, q_bkv, logprob_bk = (jnp.concatenate([a[:, None], jnp.swapaxes(r, 0, 1)], axis=1)
                                        for a, r in zip(first, rest))
        proposal = Proposal(tokens_bk=tokens_bk, q_bkv=q_bkv, logprob_bk=logprob_bk,
                            num_drafts_b=jnp.full(pending_b.shape, k, jnp.int32))
        return proposal, state.replace(cache=cache.commit(state.cache.lengths))
