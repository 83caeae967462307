"""What a generate call returns: tokens, texts and statistics, the same for every engine."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class GenerationStats:
    """Counters gathered on device and read once at the end of a call.

    Speculative fields are zero for autoregressive generation, where every step is one target
    forward that emits one token per live row.

    Attributes:
      new_tokens: tokens emitted over all requests.
      steps: decode-loop iterations (target forwards after the prefill).
      seconds: wall time of the decoding (prefill + loop, from prepared inputs), less compile_seconds.
      tokens_per_second: new_tokens / seconds: decoding speed, compilation excluded.
      compile_seconds: wall time tracing and compiling programs in the call (0.0 once warm: `warm_up`).
      per_request_new_tokens: tokens emitted per request, in prompt order.
      target_forwards, draft_forwards: model calls (a prefill counts once).
      drafted_tokens: draft tokens proposed (for live rows).
      verified_tokens: draft tokens sent to the target for verification.
      accepted_tokens: draft tokens accepted.
      acceptance_rate: accepted / drafted.
      vsr: verification success rate, accepted / verified (TETRIS).
      ter: target efficiency rate, emitted / (verified + one per row-step), i.e. tokens kept
        out of the most the verification could have yielded.
      mean_accepted_length: tokens emitted per row per target forward.
      mean_draft_length: draft tokens verified per row per step.
    """

    new_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    compile_seconds: float = 0.0
    per_request_new_tokens: list[int] = dataclasses.field(default_factory=list)
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    vsr: float = 0.0
    ter: float = 0.0
    mean_accepted_length: float = 0.0
    mean_draft_length: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GenerationResult:
    """Attributes:
      tokens: the new tokens of each prompt (eos included when hit), in prompt order.
      texts: the decoded new tokens when the model has a tokenizer (ending before eos), else None.
      stats: GenerationStats.
    """

    tokens: list[list[int]]
    texts: list[str] | None
    stats: GenerationStats


def decode_texts(tokenizer, tokens: list[list[int]], eos: int = -1) -> list[str] | None:
    """Each row's text, cut before its first `eos` (the token ids keep it); None without a tokenizer."""
    cut = [t[:t.index(eos)] if eos in t else t for t in tokens]
    return None if tokenizer is None else [tokenizer.decode(t, skip_special_tokens=False) for t in cut]
