"""The source checkout the scripts run from, named once: its folders, the Qwen pair of
`make models-qwen`, the prompts of data/, and the `--out` option of the scripts that write results.
`python scripts/NAME.py` puts scripts/ first on the import path, so each imports this as `checkout`.
It imports no JAX: a script may still set JAX's environment after importing it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"   # the measurements the README cites (indexed in its README.md)
MODELS = REPO / "models"              # downloaded and trained models (not in git)
DATA = REPO / "data"
QWEN, QWEN_DRAFT = (MODELS / f"qwen2.5-coder-{size}-instruct-q4_k_m.gguf" for size in ("1.5b", "0.5b"))


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """--out DIR: the folder a script writes its results to (`out_dir`)."""
    parser.add_argument("--out", metavar="DIR", help="folder for the results (default: the checkout's docs/results)")


def out_dir(args: argparse.Namespace) -> Path:
    """The folder --out names, else docs/results (left None in the arguments a result records)."""
    return Path(args.out) if args.out else RESULTS


def qwen_files(models: str | Path = MODELS) -> tuple[Path, Path]:
    """The GGUF files of Qwen2.5-Coder 1.5B (target) and 0.5B (draft) in `models` (default: the
    checkout's models/); exits with a hint where `make models-qwen` has not fetched them."""
    paths = tuple(Path(models) / path.name for path in (QWEN, QWEN_DRAFT))
    for path in paths:
        if not path.exists():
            raise SystemExit(f"{path} is missing: run `make models-qwen` (or pass the folder holding it)")
    return paths


def pyplot():
    """matplotlib.pyplot, drawing to files (the Agg backend). Imported here, on first use: plots are
    optional, and a GPU machine's python may lack matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def code_prompts(tokenizer) -> list[list[int]]:
    """The held-out code prompts of data/code_prompts.jsonl, as `tokenizer`'s token ids."""
    lines = (DATA / "code_prompts.jsonl").read_text().splitlines()
    return [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in lines]


def sonnet() -> str:
    """Sonnet 18 (data/sonnet18.txt): the TETRIS paper's copying task."""
    return (DATA / "sonnet18.txt").read_text().strip()
