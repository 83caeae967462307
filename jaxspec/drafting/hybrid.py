"""`HybridDrafter`: for each row and step, the proposal of whichever drafter expects more accepted
tokens (suffix decoding's hybrid with a model drafter, chosen per row instead of per batch).

Shape key: b rows, l sequence slots, k drafts, m members.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp

from jaxspec.drafting.base import Drafter, Proposal
from jaxspec.drafting.eagle import EagleDrafter
from jaxspec.drafting.model import ModelDrafter
from jaxspec.drafting.ngram import NgramDrafter
from jaxspec.drafting.suffix import SuffixDrafter
from jaxspec.sampling import SamplingConfig

_FREE = (NgramDrafter, SuffixDrafter)


class HybridDrafter(Drafter):
    """Every member proposes each step; each row verifies the proposal with the larger score, the
    expected number of accepted drafts sum_j prod_{i<=j} p_i (p_i = exp of the member's per-draft
    log-probability; ties: the earlier member).

    Lossless: which proposal a row verifies must not depend on a random draw, or the verified
    draft would no longer follow the q it is checked against. A member whose drafts are
    deterministic given the prefix (n-gram, suffix, a greedy draft, any member under greedy
    decoding) is scored on its whole path; one that samples, on its first draft's estimate alone
    (E[q(x)], a function of the prefix), as p + p^2 + ... over its drafts. The chosen proposal is
    then verified against its own q exactly as it would be alone.

    A draft model keeps its own drafts in its cache; where another member's proposal was verified
    it drops them (`ModelDrafter.discard`) and takes the kept tokens in at its next proposal (its
    first forward is k + 2 wide instead of 2). An EAGLE head needs nothing: it absorbs what the
    target kept. Members: n-gram or suffix lookup first (free), then a draft Model (same
    vocabulary) or an EAGLE drafter. Under the goodput policy the first member may also draft
    alone (`propose_free`), the others skipping those steps, in plans priced without their cost.
    """

    def __init__(self, drafters):
        self.members = tuple(drafters)
        if len(self.members) < 2:
            raise ValueError(f"HybridDrafter needs at least two drafters, got {len(self.members)}")
        self.feature_layers = next((m.feature_layers for m in self.members if isinstance(m, Drafter)
                                    and m.feature_layers), ())

    def __repr__(self):
        return f"HybridDrafter({list(self.members)!r})"

    def _key(self):
        return self.members

    def bound(self, members, k: int) -> HybridDrafter:
        """This hybrid over its members as the target binds them (`members`, drafters), a draft
        model's first forward wide enough to take in k accepted tokens of another member."""
        if not isinstance(members[0], _FREE):
            raise ValueError(f"HybridDrafter's first member must be n-gram or suffix lookup (the free one), got "
                             f"{type(members[0]).__name__}")
        for m in members:
            if not isinstance(m, (*_FREE, ModelDrafter, EagleDrafter)):
                raise ValueError("HybridDrafter members must be n-gram or suffix drafters, a draft Model with the "
                                 f"target's vocabulary or an EagleDrafter, got {type(m).__name__}")
        return HybridDrafter([ModelDrafter(m.model, greedy=m.greedy, extra=k) if isinstance(m, ModelDrafter) else m
                              for m in members])

    @property
    def params(self):
        return tuple(m.params for m in self.members)

    def static(self) -> HybridDrafter:
        twin = copy.copy(self)
        twin.members = tuple(m.static() for m in self.members)
        return twin

    def forwards_per_step(self, k: int) -> int:
        return sum(m.forwards_per_step(k) for m in self.members)

    @property
    def vocab_size(self) -> int | None:
        return next((m.vocab_size for m in self.members if m.vocab_size is not None), None)

    def remember(self, sequences, final: bool = True) -> None:
        sequences = [list(s) for s in sequences]
        for m in self.members:
            m.remember(sequences, final)

    def forget(self) -> None:
        """Empties every member's corpus (`SuffixDrafter.forget`)."""
        for m in self.members:
            if hasattr(m, "forget"):
                m.forget()

    def _each(self, method: str, params, state, *args):
        return tuple(getattr(m, method)(p, s, *args) for m, p, s in zip(self.members, params, state))

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        return tuple(m.init(p, tokens_bp, prompt_len_b, cache_len) for m, p in zip(self.members, params))

    def init_deferred(self, params, tokens_bp, prompt_len_b, cache_len: int):
        return tuple(m.init_deferred(p, tokens_bp, prompt_len_b, cache_len) for m, p in zip(self.members, params))

    def lag(self, state, seq_bl, pending_b):
        return jnp.max(jnp.stack([m.lag(s, seq_bl, pending_b) for m, s in zip(self.members, state)]), axis=0)

    def catch_up(self, params, state, seq_bl, pending_b, width: int):
        return self._each("catch_up", params, state, seq_bl, pending_b, width)

    def absorb(self, params, state, features_bwf, next_bw, count_b):
        return tuple(m.absorb(p, s, features_bwf, next_bw, count_b) if m.feature_layers else s
                     for m, p, s in zip(self.members, params, state))

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        out = self._each("propose", params, state, seq_bl, pending_b, k, key_b, sampling)
        proposals = [proposal for proposal, _ in out]
        score_mb = jnp.stack([_score(m, p, sampling) for m, p in zip(self.members, proposals)])
        pick_b = jnp.argmax(score_mb, axis=0)

        def chosen(*xs):
            stacked = jnp.stack(xs)
            return jnp.take_along_axis(stacked, pick_b.reshape((1, -1) + (1,) * (stacked.ndim - 2)), 0)[0]

        proposal = Proposal(*(chosen(*(getattr(p, f) for p in proposals))
                              for f in ("tokens_bk", "q_bkv", "num_drafts_b", "logprob_bk")))
        # Rows that took another member's proposal: this one fed the pending token, not what follows.
        keep_b = [jnp.where(pick_b == i, jnp.iinfo(jnp.int32).max, pending_b + 1) for i in range(len(out))]
        return proposal, tuple(m.discard(s, keep) for m, (_, s), keep in zip(self.members, out, keep_b))

    def forecast(self, params, seq_bl, pending_b, k: int):
        """The free member's (for the plans it runs alone, `StepPlan.free`)."""
        return self.members[0].forecast(params[0], seq_bl, pending_b, k)

    def propose_free(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        """The first member's proposal alone (a plan of the goodput policy's: `StepPlan.free`); the
        others skip the step and fall behind from the pending token on (`lag`, `catch_up`)."""
        proposal, first = self.members[0].propose(params[0], state[0], seq_bl, pending_b, k, key_b, sampling)
        return proposal, (first, *(m.discard(s, pending_b) for m, s in zip(self.members[1:], state[1:])))


def _score(member: Drafter, proposal: Proposal, sampling: SamplingConfig):
    """Expected accepted drafts of a member's proposal, from what its random draws do not sway (`HybridDrafter`)."""
    deterministic = sampling.greedy or member.free or getattr(member, "greedy", False)
    return jnp.sum(proposal.reach_bk(deterministic), axis=1)
