"""The drafter protocol (`Drafter`, `Proposal`) and the helpers the model drafters share: prefill,
catch-up, feeding the last committed tokens, and chains of draws.

Shape key: b rows, l sequence-buffer slots, p padded prompt length, k draft tokens, v vocabulary.

Inside the compiled step every drafter answers `init` (once the prompts are known) and `propose`
(a `Proposal` of k tokens per row), and the rest of `Drafter`'s calls where it has them. `seq_bl`
holds each row's whole sequence so far; `pending_b` is the position of the last emitted token (the
one the target has not processed yet), so row b's committed sequence is seq[b, :pending_b + 1].
Drafters decide what to propose, never how many tokens to verify (the engine and policy do).
"""

from __future__ import annotations

import copy
import operator

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.models.cache import KVCache
from jaxspec.models.model import forward, init_cache
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

    def reach_bk(self, deterministic: bool = True) -> jax.Array:
        """The drafter's own chance that drafts 1..j are all accepted, 0 past num_drafts_b: the running
        product of exp(logprob_bk) for draws fixed by the prefix; for random ones the first draft's
        E[q]^j, which no draw sways (a hybrid's choice and the goodput forecast read it)."""
        j_k = jnp.arange(self.tokens_bk.shape[1])
        log_bk = jnp.cumsum(self.logprob_bk, axis=1) if deterministic else self.logprob_bk[:, :1] * (j_k + 1)
        return jnp.where(j_k[None, :] < self.num_drafts_b[:, None], jnp.exp(log_bk), 0.0)


def draft_logprob(logits_bv, token_b, q_bv, sampling: SamplingConfig, deterministic: bool):
    """The default acceptance surrogate of one draft position (the paper's draft probability).

    A deterministic draw (greedy drafting, n-gram) may be scored by its own token: the draft
    model's probability of it (`scoring_probs`). A random draw must not be: if whether slot j is
    verified depended on the token drawn there, the verified tokens would be a biased sample and
    rejection sampling would no longer reproduce the target's distribution. It is scored by
    E_{x~q}[q(x)] = sum q^2, the expectation of the paper's score over the draw, which is a
    function of the prefix alone.
    """
    if not deterministic:
        return jnp.log(jnp.sum(q_bv * q_bv, axis=-1))
    return jnp.log(jnp.take_along_axis(scoring_probs(logits_bv, sampling), token_b[:, None], axis=-1)[:, 0])


def scoring_probs(logits_bv, sampling: SamplingConfig):
    """The draft's distribution that scores deterministic drafts: at temperature 1 when
    verification is greedy, else under the sampling transforms."""
    return jax.nn.softmax(logits_bv.astype(_F32), axis=-1) if sampling.greedy else probabilities(logits_bv, sampling)


class Drafter:
    """Base class: the interface the engine calls (see the module docstring).

    A drafter is a static argument of the compiled programs, so subclasses say what sets the
    program apart (`_key`) and where their weights live (`weights`); equality, hashing, `params`
    and `static` follow from those.
    """

    #: target layers whose inputs this drafter reads (EAGLE heads); the engine then hands it the
    #: target's features of every token the target keeps, through `absorb`, in the same step
    feature_layers: tuple[int, ...] = ()

    #: the weights by name: each name's dotted attribute path (a Drafter there stands for its own
    #: weights); `params` is this dict of weights, which the compiled programs take as an argument
    weights: dict[str, str] = {}

    def _key(self) -> tuple:
        """What tells this drafter's compiled programs from those of another of its class: drafters
        with equal keys share them. By default a drafter is equal only to itself."""
        return (id(self),)

    def __eq__(self, other):
        return type(other) is type(self) and other._key() == self._key()

    def __hash__(self):
        return hash((type(self), self._key()))

    @property
    def params(self) -> dict:
        found = {name: operator.attrgetter(path)(self) for name, path in self.weights.items()}
        return {name: value.params if isinstance(value, Drafter) else value for name, value in found.items()}

    def static(self) -> Drafter:
        """This drafter as a compiled program's static argument: equal to it, holding no weights
        (a program's cache keeps its static arguments alive, and with them whatever they hold)."""
        return abstract(self, tuple(self.weights.values())) if self.weights else self

    def absorb(self, params, state, features_bwf, next_bw, count_b):
        """Takes in the target's features of the first `count_b` tokens of a pass (the tokens
        the target kept, at positions lengths[b] + j) and the token after each (`next_bw`).
        Only drafters with `feature_layers` are called."""
        return state

    def remember(self, sequences, final: bool = True) -> None:
        """Takes in finished requests (token-id lists, each a prompt and its output): at refills
        (final=False) and when a call ends; by default nothing."""

    def discard(self, state, keep_b):
        """The state holding at most each row's first keep_b sequence positions (a hybrid verified
        another drafter's proposal: what this one took in past them may be wrong); by default unchanged."""
        return state

    #: drafts cost nothing and are fixed by the prefix (n-gram and suffix lookup)
    free: bool = False

    def forecast(self, params, seq_bl, pending_b, k: int):
        """A `free` drafter's own estimate that the next step's drafts 1..j of each row are all accepted
        (float [b, k]: the running product of exp(logprob_bk) over the drafts it would propose, 0 past
        them), which the goodput policy reads before it chooses; None for others."""
        if not self.free:
            return None
        return self.propose(params, None, seq_bl, pending_b, k, None, SamplingConfig())[0].reach_bk()

    #: draft-model forwards per draft token (statistics only)
    forwards_per_draft: int = 0

    def forwards_per_step(self, k: int) -> int:
        return self.forwards_per_draft * k

    @property
    def vocab_size(self) -> int | None:
        return None

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        return ()

    def init_deferred(self, params, tokens_bp, prompt_len_b, cache_len: int):
        """The state for rows that may not draft for a while (the goodput policy starts them with
        plain decoding): a drafter may skip its prefill here and take the prompt in through
        `catch_up`; by default the same as `init`. Same structure and shapes as `init`."""
        return self.init(params, tokens_bp, prompt_len_b, cache_len)

    def lag(self, state, seq_bl, pending_b):
        """int32 [b]: each row's committed tokens (below pending_b - 1) the state has not taken in,
        which `catch_up` must feed before `propose` (after plain steps); by default none."""
        return jnp.zeros_like(pending_b)

    def catch_up(self, params, state, seq_bl, pending_b, width: int):
        """The state with up to `width` (static) of each row's missing tokens fed, in one forward;
        a row missing more keeps the rest (`lag` drops by `width`), so another call continues."""
        return state

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        raise NotImplementedError

    def propose_tree(self, params, state, seq_bl, pending_b, shape, sampling: SamplingConfig):
        """A draft tree per row (`jaxspec.drafting.trees.Tree`, its root the pending token), and the state."""
        raise NotImplementedError


def abstract(obj, fields=("params",)):
    """A shallow copy of `obj` whose `fields` (dotted attribute paths) hold shapes and dtypes
    instead of arrays; a Drafter in a field becomes its `static()` twin."""
    twin = copy.copy(obj)
    for path in fields:
        field, _, rest = path.partition(".")
        value = getattr(twin, field)
        if rest:
            value = abstract(value, (rest,))
        elif isinstance(value, Drafter):
            value = value.static()
        else:
            value = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), value)
        setattr(twin, field, value)
    return twin


def prefilled(graphdef, params, tokens_bp, prompt_len_b, cache_len: int) -> KVCache:
    """A drafter model's cache after the prompts, committed to all but the last prompt token
    (each propose re-feeds the last two committed tokens)."""
    cache = init_cache(graphdef, params, tokens_bp.shape[0], cache_len)
    _, cache = forward(graphdef, params, tokens_bp, cache, jnp.zeros_like(tokens_bp[:, :1]), empty=True)
    return cache.commit(prompt_len_b - 1)


def feed_missing(graphdef, params, cache: KVCache, seq_bl, upto_b, chunk: int, reader=None):
    """Catch-up in one forward: feeds each row's next `chunk` (static) positions below `upto_b`, at
    its own position (rows caught up write past their length: harmless); a row missing more keeps
    the rest missing. The cache is trusted up to min(lengths, upto) (past that it may hold rejected
    drafts). Returns the cache, `reader`'s state and the logits after each row's last token fed;
    `reader` = (drafter, params, state) of a drafter reading this model's features (an EAGLE head
    under a chain level) absorbs every token fed, its state holding exactly the rows of the trusted
    cache (`EagleDrafter.truncate`)."""
    cache = cache.commit(jnp.minimum(cache.lengths, upto_b))
    drafter, drafter_params, drafter_state = reader if reader is not None else (Drafter(), None, ())
    n_b = jnp.maximum(jnp.minimum(upto_b - cache.lengths, chunk), 0)
    at_bc = jnp.minimum(cache.lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32), seq_bl.shape[1] - 1)
    out = forward(graphdef, params, jnp.take_along_axis(seq_bl, at_bc, axis=1), cache,
                  jnp.maximum(n_b - 1, 0)[:, None], features=drafter.feature_layers)
    if drafter.feature_layers:
        next_bc = jnp.take_along_axis(seq_bl, jnp.minimum(at_bc + 1, seq_bl.shape[1] - 1), axis=1)
        drafter_state = drafter.absorb(drafter_params, drafter_state, out[2], next_bc, n_b)
    return out[1].commit(cache.lengths + n_b), drafter_state, out[0][:, 0]


def feed_last_two(graphdef, params, cache: KVCache, seq_bl, last_b, extra: int = 0):
    """The draft model's logits after seq[b, last_b], its cache committed to `last_b` (commit
    last_b + 1 to keep the last token's keys and values), and the rows for which that holds: those
    missing at most 2 + `extra` (static) tokens from last_b - 1 on. After a drafting step the cache
    holds every token before the last two (after a partial accept its drafts up to the accepted one;
    after a full accept all but the last draft); `extra` covers a draft further behind (a tree's
    accepted path, a token spelled in several)."""
    cache = cache.commit(jnp.minimum(cache.lengths, last_b - 1))
    cache, _, logits_bv = feed_missing(graphdef, params, cache, seq_bl, last_b + 1, 2 + extra)
    return logits_bv, cache.commit(jnp.minimum(cache.lengths, last_b)), cache.lengths == last_b + 1


def draw_token(logits_bv, keys_b, draw: SamplingConfig, sampling: SamplingConfig):
    """One draft draw under `draw` (greedy when drafting greedily): the token, the distribution q
    it came from, and its TETRIS score under the target's `sampling` (`draft_logprob`)."""
    token_b, q_bv = choose(keys_b, logits_bv, draw), probabilities(logits_bv, draw)
    return token_b, q_bv, draft_logprob(logits_bv, token_b, q_bv, sampling, draw.greedy)


def draft_chain(logits_bv, k: int, key_b, draw_one, feed, carry) -> tuple[Proposal, object]:
    """k autoregressive draws, each row with its own keys: `draw_one(logits, keys_b)` -> (token_b,
    q_bv, score_b) turns the logits after the last fed token into a draw (the first from
    `logits_bv`); `feed(carry, token_b)` -> (logits, carry) feeds each draw but the last. Returns
    the k draws as a Proposal (all real), and the carry."""
    keys_bk = jax.vmap(lambda key: jax.random.split(key, k))(key_b)
    first = draw_one(logits_bv, keys_bk[:, 0])

    def step(carry_token, keys_b):
        carry, token_b = carry_token
        logits, carry = feed(carry, token_b)
        drawn = draw_one(logits, keys_b)
        return (carry, drawn[0]), drawn

    (carry, _), rest = jax.lax.scan(step, (carry, first[0]), jnp.swapaxes(keys_bk[:, 1:], 0, 1))
    tokens_bk, q_bkv, logprob_bk = (jnp.concatenate([a[:, None], jnp.swapaxes(r, 0, 1)], axis=1)
                                    for a, r in zip(first, rest))
    proposal = Proposal(tokens_bk=tokens_bk, q_bkv=q_bkv, logprob_bk=logprob_bk,
                        num_drafts_b=jnp.full(key_b.shape[:1], k, jnp.int32))
    return proposal, carry


def model_feed(graphdef, params):
    """`draft_chain`'s feed for a draft model: each token at its cache's end, committed."""

    def feed(cache: KVCache, token_b):
        logits_b1v, cache = forward(graphdef, params, token_b[:, None], cache)
        return logits_b1v[:, 0], cache.commit(cache.lengths + 1)

    return feed
