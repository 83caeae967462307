"""Autoregressive generation: the baseline every speculative path must reproduce exactly.

It runs on the speculative engine without a drafter (every step a `step.plain_step`), in the same
segments, so plain decoding gets the host overlap and attention bounds that speed ratios divide by.
"""

from __future__ import annotations

from jaxspec.drafting import Drafter
from jaxspec.engine.decoder import SpeculativeDecoder
from jaxspec.models.model import Model
from jaxspec.results import GenerationResult
from jaxspec.sampling import SamplingConfig
from jaxspec.spec import SpecConfig

_NO_DRAFTER = Drafter()   # one instance: the programs it keys are shared by every call


def generate(model: Model, prompts, max_new_tokens=64, sampling: SamplingConfig | None = None,
             seed: int = 0, eos_token_id: int | None = None, request_ids=None) -> GenerationResult:
    """Autoregressive generation for a batch of prompts of different lengths.

    Args:
      model: the jaxspec.Model to sample from.
      prompts: a list of token-id lists, or of strings when the model has a tokenizer.
      max_new_tokens: the most new tokens per prompt (an int, or one per prompt), >= 1.
      sampling: SamplingConfig; default greedy.
      seed: RNG seed; request i's j-th token is drawn with a key made from (seed, i, j) alone, so
        the output of a request does not depend on what else is in the batch.
      eos_token_id: a row stops after emitting this token (kept in its output); None: never.
      request_ids: distinct ints naming each prompt's RNG stream in place of its index i, so a
        request samples the same tokens whatever list it is passed in (a resumed batch job).

    Returns:
      GenerationResult with the new tokens of each prompt in prompt order.
    """
    decoder = SpeculativeDecoder(model, _NO_DRAFTER, SpecConfig(k=0), sampling)
    return decoder.generate(prompts, max_new_tokens, seed, eos_token_id, request_ids=request_ids)
