"""Drafters: what proposes draft tokens each step (never how many are verified). The `Drafter` protocol
(`base`), a smaller model (`model`), prompt lookup (`ngram`), suffix decoding (`suffix`), the per-row best
of several (`hybrid`), an EAGLE-3 head (`eagle`), a draft model with another tokenizer (`crossvocab`), and
draft trees (`trees`)."""

from jaxspec.drafting.base import Drafter, Proposal
from jaxspec.drafting.crossvocab import CrossVocabDrafter, VocabMap
from jaxspec.drafting.eagle import EagleDrafter
from jaxspec.drafting.hybrid import HybridDrafter
from jaxspec.drafting.model import ModelDrafter
from jaxspec.drafting.ngram import NgramDrafter
from jaxspec.drafting.suffix import SuffixDrafter

__all__ = ["CrossVocabDrafter", "Drafter", "EagleDrafter", "HybridDrafter", "ModelDrafter", "NgramDrafter", "Proposal",
           "SuffixDrafter", "VocabMap"]
