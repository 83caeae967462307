"""A fast tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata, without torch.

For byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: Llama-3, SmolLM, Qwen2) the
pipeline transformers builds from such a file; other types fall back to transformers' GGUF path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# `tokenizer.ggml.pre` -> the regex its merges were learned with. Anything not listed (gpt2,
# smollm, ...) uses GPT-2's own byte-level split.
_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
           **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT)}

_CONTROL, _USER_DEFINED = 3, 4


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    others = [b for b in range(256) if b not in printable]   # mapped past 255, in order
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], path: str | None = None):
    """A transformers `PreTrainedTokenizerFast` equivalent to the one the GGUF describes."""
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        return _transformers_fallback(kind, path)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    alphabet = byte_alphabet()
    letters = set(alphabet.values())

    def spell(token: str) -> str:
        return token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {spell(tok): i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in metadata.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    split = _SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Control tokens stay whole and count as special; a "control" token spelled outside the byte
    # alphabet is a mislabelled ordinary token and is left alone.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= letters])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])

    def special(key):
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos = special("bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[spell(bos)])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"))


def _transformers_fallback(kind, path):
    if path is None:
        raise ValueError(f"GGUF tokenizer type {kind!r} is not supported without the file path")
    try:
        import os

        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                             gguf_file=os.path.basename(path))
    except Exception as err:  # transformers' GGUF reader needs torch
        raise ValueError(f"GGUF tokenizer type {kind!r} is built natively only for 'gpt2' "
                         f"(byte-level BPE); transformers' fallback failed: {err}") from err
