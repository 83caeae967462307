"""`jaxspec generate`'s model arguments checked before anything loads: the `--draft` forms (the
first check `generate` makes) and that model paths exist and presets are known, so a typo fails
in a second instead of after the target has loaded.

`--draft` forms:
    PATH | preset:NAME    a draft model (GGUF file, HF folder, jaxspec checkpoint; random weights)
    HEAD_DIR              an EAGLE-3 head folder (`jaxspec train-eagle`)
    ngram | none          prompt lookup; plain autoregressive decoding
    suffix                suffix decoding (`jaxspec.SuffixDrafter`)
    suffix+PATH | suffix+HEAD_DIR   suffix decoding with a model drafter behind it (`jaxspec.HybridDrafter`)
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import jaxspec
from jaxspec.models.config import PRESETS

KEYWORDS = ("ngram", "none")   # the forms that load no model and need nothing beyond this version
SUFFIX = "suffix"


def suffix_drafters() -> tuple[type | None, type | None]:
    """(SuffixDrafter, HybridDrafter) where this jaxspec has them, else None: the one switch for the
    `suffix` forms of --draft (both classes are being added to the library; until then the forms
    are refused as not available)."""
    return getattr(jaxspec, "SuffixDrafter", None), getattr(jaxspec, "HybridDrafter", None)


@dataclasses.dataclass(frozen=True)
class DraftForm:
    """A checked --draft value.

    Attributes:
      text: the value as given.
      model: the draft model or EAGLE-3 head to load (a path or preset:NAME); None: no model.
      lookup: "ngram" or "suffix": the model-free drafter (with a model: a hybrid of both); None:
        the model alone, or plain decoding when there is no model either (--draft none).
    """

    text: str
    model: str | None
    lookup: str | None

    @property
    def plain(self) -> bool:
        return self.model is None and self.lookup is None


def valid_forms() -> str:
    """The --draft forms this version accepts, for messages and --help."""
    suffix, hybrid = suffix_drafters()
    forms = ["PATH (draft model: GGUF file, HF folder, jaxspec checkpoint)", "preset:NAME (random weights)",
             "HEAD_DIR (EAGLE-3 head from jaxspec train-eagle)", *KEYWORDS]
    if suffix is not None:
        forms.append(SUFFIX)
    if suffix is not None and hybrid is not None:
        forms.append("suffix+PATH or suffix+HEAD_DIR")
    return ", ".join(forms)


def parse_draft(text: str) -> DraftForm:
    """Checks a --draft value without loading anything (paths must exist, presets must be known).

    Raises:
      ValueError: an unknown form (the message lists the valid ones), a missing path, an unknown
        preset, or a suffix form this version does not have.
    """
    if text in KEYWORDS:
        return DraftForm(text, None, None if text == "none" else text)
    if text == SUFFIX or text.startswith(SUFFIX + "+"):
        model = text[len(SUFFIX) + 1:] or None
        suffix, hybrid = suffix_drafters()
        if suffix is None or (model is not None and hybrid is None):
            needs = "jaxspec.SuffixDrafter" if suffix is None else "jaxspec.HybridDrafter"
            raise ValueError(f"--draft {text}: suffix decoding{' with a draft model' if model else ''} is not "
                             f"available in this version (no {needs}); valid forms: {valid_forms()}")
        if model is not None:
            check_model("--draft", model, text)
        return DraftForm(text, model, SUFFIX)
    check_model("--draft", text, text)
    return DraftForm(text, text, None)


def check_model(option: str, spec: str, given: str | None = None) -> None:
    """A model argument (path or preset:NAME) that can load: the path exists, the preset is known.
    `given`: the whole --draft value, when `spec` is part of it (its message then lists the forms)."""
    if spec.startswith("preset:"):
        name = spec.split(":", 1)[1]
        if name not in PRESETS:
            close = difflib.get_close_matches(name, PRESETS, n=1)
            hint = f" (did you mean preset:{close[0]}?)" if close else ""
            raise ValueError(f"{option} {given or spec}: unknown preset {name!r}{hint}; presets: "
                             f"{', '.join(sorted(PRESETS))}")
        return
    if Path(spec).exists():
        return
    if option != "--draft":
        raise FileNotFoundError(f"{option} {spec}: no such file or folder (a GGUF file, HF folder, jaxspec "
                                "checkpoint, or preset:NAME)")
    close = difflib.get_close_matches(spec, [*KEYWORDS, SUFFIX], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close and close[0] in valid_forms() else ""
    raise ValueError(f"--draft {given}: no such file or folder, and not a keyword; {hint}valid forms: "
                     f"{valid_forms()}")


def make_drafter(form: DraftForm, model):
    """The drafter of a --draft form; `model`: its loaded draft model or EAGLE-3 drafter, or None.
    --draft none decodes plainly through the engine with k = 0, with an n-gram drafter that drafts nothing."""
    suffix, hybrid = suffix_drafters()
    if form.lookup == "ngram" or form.plain:
        return jaxspec.NgramDrafter(max_ngram=3)
    if form.lookup == SUFFIX:
        return suffix() if model is None else hybrid([suffix(), model])
    return model
