"""Drafting with a model whose tokenizer differs from the target's.

Shape key: b rows, l target sequence slots, d draft sequence slots, k draft tokens, v target
vocabulary, w draft vocabulary, m draft tokens per target token at most.

Two static tables, built once from the two vocabularies' byte strings (`VocabMap`), bridge them:

- proposals go through the *intersection*: a draft token whose bytes are exactly one target
  token's is proposed as that token; the others' logits are masked before the draw, so q is the
  draft's distribution renormalised over the intersection, an ordinary proposal over the target
  vocabulary: verification stays lossless as it is (vLLM's and transformers' intersection);
- the draft reads the committed text through each target token's *own re-tokenization*: target
  token t is fed as `expand[t]`, the draft tokens that spell its bytes (longest match first).
  Universal assisted generation's re-tokenization, done per token on device from a table, so the
  loop never waits for the host; a word split across target tokens reaches the draft split alike.

The draft keeps its own token sequence and cache. Each step it appends the expansions of the
target tokens committed since, rolls its cache back to the first token that differs (a rejected
draft) and feeds what the cache lacks (`catch_up` after plain steps).
"""

from __future__ import annotations

import copy
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.drafting.base import Drafter, draft_chain, draw_token, feed_last_two, feed_missing, model_feed
from jaxspec.drafting.trees import draft_tree
from jaxspec.models.cache import KVCache
from jaxspec.models.gguf_tokenizer import byte_alphabet
from jaxspec.models.model import Model, init_cache
from jaxspec.policy.goodput import CATCH_UP_CHUNK
from jaxspec.sampling import SamplingConfig

MAX_EXPANSION = 16   # draft tokens standing for one target token (longer spellings are cut)
_PREFILL_CHUNK = 64  # draft slots past twice the target's (room for the catch-up forwards)


def token_bytes(tokenizer, size: int) -> list[bytes | str | None]:
    """What each of the first `size` token ids stands for: its bytes; for a special token its name as
    a str (special tokens match only special tokens of the same name); None for ids the tokenizer
    lacks. Reads byte-level BPE (GPT-2 alphabet) and SentencePiece pieces ("▁" a space, "<0x41>" a byte)."""
    decoder = json.dumps(json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder"))
    byte_level = "ByteLevel" in decoder
    from_char = {c: b for b, c in byte_alphabet().items()}
    added = tokenizer.added_tokens_decoder
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(size, len(tokenizer)))))
    out: list[bytes | str | None] = [None] * size
    for i, piece in enumerate(pieces):
        if i in added:
            out[i] = added[i].content if added[i].special else added[i].content.encode("utf-8")
        elif piece is None:
            continue
        elif byte_level:
            out[i] = bytes(from_char[c] for c in piece) if all(c in from_char for c in piece) else None
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            out[i] = piece.replace("\u2581", " ").encode("utf-8")
    return out


class VocabMap:
    """The static tables between a draft vocabulary and a target vocabulary (numpy, int32), from
    what each token stands for (`token_bytes`: bytes, or a special token's name).

    Attributes:
      to_target_w: [w] the target token with the same bytes, or -1 (no draft mass).
      to_draft_v: [v] the draft token with the same bytes, or w (a column of zeros).
      expand_vm: [v, m] the draft tokens spelling each target token (longest match first),
        zero-padded; `expand_len_v` [v] how many are real (a special token: its namesake, or none).
    """

    def __init__(self, draft_pieces: list[bytes | str | None], target_pieces: list[bytes | str | None],
                 max_expansion: int = MAX_EXPANSION):
        w, v = len(draft_pieces), len(target_pieces)
        by_bytes = {piece: i for i, piece in reversed(list(enumerate(draft_pieces))) if piece}   # a piece's first id
        self.to_target_w = np.full((w,), -1, np.int32)
        self.to_draft_v = np.full((v,), w, np.int32)
        longest = max((len(p) for p in by_bytes if isinstance(p, bytes)), default=1)
        spellings = []
        for t, piece in enumerate(target_pieces):
            d = by_bytes.get(piece, -1)
            if d >= 0 and self.to_target_w[d] < 0:
                self.to_target_w[d], self.to_draft_v[t] = t, d
            if isinstance(piece, str):   # a special token: its namesake or nothing
                spellings.append([by_bytes[piece]] if piece in by_bytes else [])
                continue
            spelled, start = [], 0
            while piece and start < len(piece):
                for end in range(min(len(piece), start + longest), start, -1):
                    if piece[start:end] in by_bytes:
                        spelled.append(by_bytes[piece[start:end]])
                        break
                else:   # a byte the draft cannot spell: skipped (only the draft's view suffers)
                    end = start + 1
                start = end
            spellings.append(spelled[:max_expansion])
        self.expand_len_v = np.array([len(spelled) for spelled in spellings], np.int32)
        self.expand_vm = np.zeros((v, self.expand_len_v.max(initial=1)), np.int32)
        for t, spelled in enumerate(spellings):
            self.expand_vm[t, :len(spelled)] = spelled
        self.shared = int((self.to_target_w >= 0).sum())
        if not self.shared:
            raise ValueError("the draft and target vocabularies share no token: nothing can be proposed")
        tables = (self.to_target_w, self.expand_vm, self.expand_len_v)
        self.digest = hashlib.sha256(b"".join(table.tobytes() for table in tables)).hexdigest()

    @classmethod
    def from_tokenizers(cls, draft_tokenizer, draft_size: int, target_tokenizer, target_size: int) -> VocabMap:
        return cls(token_bytes(draft_tokenizer, draft_size), token_bytes(target_tokenizer, target_size))


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers map every token id to the same token."""
    return a is b or a.get_vocab() == b.get_vocab()


@struct.dataclass
class _BridgeState:
    cache: KVCache          # the draft model's cache: seq_bd[:, :cache.lengths] is in it
    seq_bd: jax.Array       # the draft's tokens: expansions of the target's, then this step's drafts
    length_b: jax.Array     # draft tokens standing for the target tokens synced so far
    synced_b: jax.Array     # target positions already expanded into seq_bd


class CrossVocabDrafter(Drafter):
    """Drafts with `model`, whose vocabulary differs from the target's, through a `VocabMap`.

    Args:
      model: the draft Model.
      vocab_map: the tables between its vocabulary and the target's (`VocabMap.from_tokenizers`).
      greedy: draft by argmax whatever the sampling (as `SpecConfig.greedy_draft`).

    A row whose draft sequence would outgrow its buffer (twice the target's, plus room; reached
    only if the draft needs over twice as many tokens for the same text) stops proposing.
    """

    weights = {"model": "model.params", "tables": "_tables"}
    forwards_per_draft = 1

    def __init__(self, model: Model, vocab_map: VocabMap, *, greedy: bool = False):
        if len(vocab_map.to_target_w) != model.config.vocab_size:
            raise ValueError(f"vocab_map covers {len(vocab_map.to_target_w)} draft tokens, the draft model has "
                             f"vocab_size {model.config.vocab_size}")
        self.model, self.map, self.greedy = model, vocab_map, greedy
        self._tables = {name: jnp.asarray(getattr(vocab_map, name))
                        for name in ("to_target_w", "to_draft_v", "expand_vm", "expand_len_v")}

    def __repr__(self):
        return f"CrossVocabDrafter({self.model!r}, shared tokens={self.map.shared})"

    def _key(self):
        return (self.model.graphdef, self.map.digest, self.greedy)

    def placed(self, sharding) -> CrossVocabDrafter:
        """This drafter with its tables on `sharding` (the draft's mesh, replicated)."""
        twin = copy.copy(self)
        twin._tables = jax.device_put(self._tables, sharding)
        return twin

    @property
    def vocab_size(self) -> int:
        return len(self.map.to_draft_v)

    def init(self, params, tokens_bp, prompt_len_b, cache_len: int):
        state = self.init_deferred(params, tokens_bp, prompt_len_b, cache_len)
        # The prompt's expansion in one forward: a row spelled in more draft tokens lags (`lag`).
        return state.replace(cache=feed_missing(self.model.graphdef, params["model"], state.cache, state.seq_bd,
                                                jnp.maximum(state.length_b - 2, 0), 2 * tokens_bp.shape[1])[0])

    def init_deferred(self, params, tokens_bp, prompt_len_b, cache_len: int):
        b, slots = tokens_bp.shape[0], 2 * cache_len + 2 * _PREFILL_CHUNK
        zeros_b = jnp.zeros((b,), jnp.int32)
        state = _BridgeState(cache=init_cache(self.model.graphdef, params["model"], b, slots),
                             seq_bd=jnp.zeros((b, slots), jnp.int32), length_b=zeros_b, synced_b=zeros_b)
        return _sync(params["tables"], state, tokens_bp, prompt_len_b, tokens_bp.shape[1], slots - _PREFILL_CHUNK)

    def lag(self, state, seq_bl, pending_b):
        """Target tokens before the pending one not synced, plus draft tokens but the last two not in
        the cache, less the drafts the cache holds past the synced text (each may be a kept token)."""
        return jnp.maximum(pending_b - 2 - state.synced_b + state.length_b - state.cache.lengths, 0)

    def catch_up(self, params, state, seq_bl, pending_b, width: int):
        """Syncs the target tokens before the pending one, then feeds draft tokens till `lag` is `width` lower."""
        behind_b, chunk = jnp.maximum(self.lag(state, seq_bl, pending_b) - width, 0), 2 * width + CATCH_UP_CHUNK
        state = _sync(params["tables"], state, seq_bl, pending_b, chunk, state.seq_bd.shape[1] - chunk - 2)
        upto_b = jnp.maximum(state.length_b - 2 - jnp.maximum(behind_b - (pending_b - state.synced_b), 0), 0)
        return state.replace(cache=feed_missing(self.model.graphdef, params["model"], state.cache, state.seq_bd,
                                                upto_b, chunk)[0])

    def _fed(self, params, state, seq_bl, pending_b, ahead: int, extra: int):
        """Syncs the draft sequence to the committed text (room left for `ahead` drafts) and feeds it through
        its last token (`feed_last_two`, `extra` wider). Returns the state, the rows that may draft (all their
        text in, two draft tokens or more), the last token's slot, the logits after it, the cache below it."""
        state = _sync(params["tables"], state, seq_bl, pending_b + 1, ahead + 1 + CATCH_UP_CHUNK,
                      state.seq_bd.shape[1] - max(ahead, CATCH_UP_CHUNK) - 2)
        last_b = jnp.maximum(state.length_b - 1, 1)
        logits_bw, cache, fed_b = feed_last_two(self.model.graphdef, params["model"], state.cache, state.seq_bd,
                                                last_b, extra)
        return state, (state.synced_b == pending_b + 1) & (state.length_b >= 2) & fed_b, last_b, logits_bw, cache

    def propose(self, params, state, seq_bl, pending_b, k: int, key_b, sampling: SamplingConfig):
        """k draws from the draft's distribution over the shared tokens (q over the target vocabulary)."""
        tables, draw = params["tables"], SamplingConfig() if self.greedy else sampling
        shared_w = tables["to_target_w"] >= 0
        state, live_b, last_b, logits_bw, fed = self._fed(params, state, seq_bl, pending_b, k, CATCH_UP_CHUNK)

        def draw_one(logits_bw, keys_b):
            token_b, q_bw, score_b = draw_token(jnp.where(shared_w, logits_bw, -jnp.inf), keys_b, draw, sampling)
            return token_b, jnp.take(jnp.pad(q_bw, ((0, 0), (0, 1))), tables["to_draft_v"], axis=1), score_b

        drafted, cache = draft_chain(logits_bw, k, key_b, draw_one, model_feed(self.model.graphdef, params["model"]),
                                     fed.commit(last_b + 1))
        # This step's drafts join the draft sequence tentatively: the next sync keeps the cache
        # up to the first one the target did not keep.
        at_bk = jnp.where(live_b[:, None], last_b[:, None] + 1 + jnp.arange(k), state.seq_bd.shape[1])
        seq_bd = state.seq_bd.at[jnp.arange(seq_bl.shape[0])[:, None], at_bk].set(drafted.tokens_bk, mode="drop")
        proposal = drafted.replace(num_drafts_b=jnp.where(live_b, k, 0).astype(jnp.int32), tokens_bk=jnp.where(
            live_b[:, None], jnp.take(tables["to_target_w"], drafted.tokens_bk), 0))
        return proposal, state.replace(cache=cache.commit(jnp.where(live_b, cache.lengths, fed.lengths)), seq_bd=seq_bd)

    def propose_tree(self, params, state, seq_bl, pending_b, shape, sampling: SamplingConfig):
        """A tree over the shared tokens (each node one target token) after `propose`'s sync. Its
        nodes do not join the draft sequence: the next sync feeds the tokens the target kept."""
        to_target_w = params["tables"]["to_target_w"]
        state, live_b, last_b, logits_bw, fed = self._fed(params, state, seq_bl, pending_b, shape.columns,
                                                          CATCH_UP_CHUNK + shape.depth)
        root_w = jnp.take_along_axis(state.seq_bd, last_b[:, None], axis=1)[:, 0]
        tree, cache = draft_tree(self.model.graphdef, params["model"], fed, root_w, logits_bw, shape,
                                 SamplingConfig() if self.greedy else sampling, to_target_w >= 0)
        root_b = jnp.take_along_axis(seq_bl, pending_b[:, None], axis=1)[:, 0]
        tree = tree.replace(tokens_bw=jnp.take(to_target_w, tree.tokens_bw).at[:, 0].set(root_b),
                            cum_bw=jnp.where(live_b[:, None], tree.cum_bw, tree.cum_bw.at[:, 1:].set(-jnp.inf)))
        return tree, state.replace(cache=cache.commit(jnp.where(live_b, last_b + 1, fed.lengths)))


def _sync(tables, state: _BridgeState, seq_bl, upto_b, chunk: int, room: int) -> _BridgeState:
    """Appends the expansions of each row's next `chunk` target positions below `upto_b` (from
    `synced_b`) to the draft sequence, as far as its draft tokens stay within `room`; rolls the
    draft cache back to the first slot whose token changed."""
    expand_vm, expand_len_v = tables["expand_vm"], tables["expand_len_v"]
    m, slots, rows_b11 = expand_vm.shape[1], state.seq_bd.shape[1], jnp.arange(seq_bl.shape[0])[:, None, None]
    at_bc = state.synced_b[:, None] + jnp.arange(chunk)
    tokens_bc = jnp.take_along_axis(seq_bl, jnp.minimum(at_bc, seq_bl.shape[1] - 1), axis=1)
    len_bc = jnp.where(at_bc < upto_b[:, None], expand_len_v[tokens_bc], 0)
    end_bc = state.length_b[:, None] + jnp.cumsum(len_bc, axis=1)
    fits_bc = (at_bc < upto_b[:, None]) & (end_bc <= room)   # a prefix of each row's chunk
    len_bc = jnp.where(fits_bc, len_bc, 0)
    slot_bcm = jnp.where(jnp.arange(m) < len_bc[:, :, None], (end_bc - len_bc)[:, :, None] + jnp.arange(m), slots)
    new_bcm = expand_vm[tokens_bc]
    changed_bcm = (slot_bcm < slots) & (state.seq_bd[rows_b11, jnp.minimum(slot_bcm, slots - 1)] != new_bcm)
    first_change_b = jnp.min(jnp.where(changed_bcm, slot_bcm, jnp.iinfo(jnp.int32).max), axis=(1, 2))
    seq_bd = state.seq_bd.at[rows_b11, slot_bcm].set(new_bcm, mode="drop")
    cache = state.cache.commit(jnp.minimum(state.cache.lengths, first_change_b))
    return state.replace(cache=cache, seq_bd=seq_bd, length_b=state.length_b + jnp.sum(len_bc, axis=1),
                         synced_b=state.synced_b + jnp.sum(fits_bc, axis=1))
