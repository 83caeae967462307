"""Turning user prompts into fixed-shape device inputs, with validation at the boundary: every engine
takes prompts through `prepare`, so they all accept the same inputs and share shape buckets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

MIN_LENGTH_BUCKET = 16
NO_EOS = -1   # the stop token of a call without one (never emitted)


def check_int(name: str, value, low: int) -> None:
    """A ValueError naming `name` and its limit unless `value` is an int (not a bool) >= `low`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def bucket_length(n: int, minimum: int = MIN_LENGTH_BUCKET) -> int:
    """Next power of two >= n, at least `minimum` (a power of two)."""
    return max(minimum, 1 << (n - 1).bit_length())


def bucket_batch(n: int) -> int:
    """1, 2, 4, 8, then multiples of 8: few programs, little padding waste."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    return -(-n // 8) * 8


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Right-padded prompts of a batch (padded rows have max_new = 0 and never run)."""

    tokens_bp: np.ndarray       # int32 [b, p] prompt ids, right-padded with 0
    lengths_b: np.ndarray       # int32 [b] prompt lengths (1 for padding rows)
    max_new_b: np.ndarray       # int32 [b] token budget of each row (0 for padding rows)
    request_ids_b: np.ndarray   # int32 [b] each row's RNG stream id (its prompt's index, or its `request_ids`)
    num_prompts: int            # how many rows are real
    out_len: int                # static size of the output buffer (bucketed max of max_new)


def encode_prompts(prompts, tokenizer, vocab_size: int) -> list[list[int]]:
    """Validates prompts (token-id lists, or strings with a tokenizer) and returns id lists."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError("prompts must be a list of prompts (token-id lists or strings), "
                         f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string but the model has no tokenizer; "
                                 "pass token-id lists or load a model with a tokenizer")
            ids = list(tokenizer(prompt)["input_ids"])
        else:
            array = np.asarray(prompt)
            if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
                raise ValueError(f"prompts[{i}] must be a 1-D list of int token ids or a string")
            ids = [int(t) for t in array]
        if not ids:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] contains token id {bad[0]}, outside [0, {vocab_size}) "
                             f"(vocab_size={vocab_size})")
        encoded.append(ids)
    return encoded


def check_max_new_tokens(max_new_tokens, num_prompts: int) -> list[int]:
    """An int (shared) or one int per prompt; each >= 1."""
    if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
        values = [int(v) for v in max_new_tokens]
        if len(values) != num_prompts:
            raise ValueError(f"max_new_tokens has {len(values)} entries for {num_prompts} prompts")
    else:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        values = [int(max_new_tokens)] * num_prompts
    for v in values:
        if v < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {v}")
    return values


def check_request_ids(request_ids, num_prompts: int) -> np.ndarray:
    """Each prompt's RNG stream id: its index by default, else the caller's distinct ints."""
    if request_ids is None:
        return np.arange(num_prompts, dtype=np.int32)
    ids = list(request_ids)
    if len(ids) != num_prompts or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                          and 0 <= i < 2**31 - 2**20 for i in ids):
        raise ValueError(f"request_ids must be None or {num_prompts} ints in [0, 2**31 - 2**20), one per prompt, "
                         f"got {request_ids!r}")
    if len(set(ids)) != len(ids):
        raise ValueError("request_ids must be distinct (equal ids would draw identical samples)")
    return np.asarray(ids, np.int32)


def prepare(prompts, tokenizer, *, vocab_size: int, max_positions: int, max_new_tokens,
            request_ids=None) -> PromptBatch:
    """Validates, encodes, buckets and pads a list of prompts."""
    ids = encode_prompts(prompts, tokenizer, vocab_size)
    max_new = check_max_new_tokens(max_new_tokens, len(ids))
    stream_ids = check_request_ids(request_ids, len(ids))
    for i, (p, n) in enumerate(zip(ids, max_new)):
        if len(p) + n > max_positions:
            raise ValueError(f"prompts[{i}] has {len(p)} tokens; with max_new_tokens={n} that is "
                             f"{len(p) + n} positions, more than max_position_embeddings={max_positions}")
    tokens = np.zeros((len(ids), bucket_length(max(len(p) for p in ids))), np.int32)
    for i, p in enumerate(ids):
        tokens[i, :len(p)] = p
    real = PromptBatch(tokens_bp=tokens, lengths_b=np.asarray([len(p) for p in ids], np.int32),
                       max_new_b=np.asarray(max_new, np.int32), request_ids_b=stream_ids, num_prompts=len(ids),
                       out_len=bucket_length(max(max_new)))
    return subset(real, np.arange(len(ids)))   # bucketed and padded


def subset(batch: PromptBatch, rows, multiple: int = 1, min_rows: int = 0) -> PromptBatch:
    """The batch of some of `batch`'s real rows (keeping their request ids, hence their RNG streams),
    bucketed like a fresh batch (at least `min_rows`, then up to a multiple of `multiple`)."""
    rows = np.asarray(rows, np.int64)
    pad = -(-max(bucket_batch(max(len(rows), 1)), min_rows) // multiple) * multiple - len(rows)
    # Padding rows get ids past every real one, so no two rows share an RNG stream.
    ids = np.concatenate([batch.request_ids_b[rows], batch.request_ids_b.max() + 1 + np.arange(pad)])
    return PromptBatch(tokens_bp=np.pad(batch.tokens_bp[rows], ((0, pad), (0, 0))),
                       lengths_b=np.pad(batch.lengths_b[rows], (0, pad), constant_values=1),
                       max_new_b=np.pad(batch.max_new_b[rows], (0, pad)), request_ids_b=ids.astype(np.int32),
                       num_prompts=len(rows), out_len=batch.out_len)


def check_eos(eos_token_id, vocab_size: int) -> int:
    if eos_token_id is None:
        return NO_EOS
    if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, (int, np.integer)) \
            or not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"eos_token_id must be None or an int in [0, {vocab_size}), got {eos_token_id!r}")
    return int(eos_token_id)
