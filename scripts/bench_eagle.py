"""EAGLE-3 heads trained here, against autoregressive decoding and the other drafters.

  --pair smollm2  SmolLM2-135M-Instruct. Training data: the target's own greedy answers to chat
                  prompts built from Shakespeare (passages to explain, summarise or continue, and
                  short open requests; `distill_smollm2.py`'s builder); held out: prompts from
                  works never trained on. Compared: autoregressive, n-gram lookup, EAGLE k = 2..5.
  --pair qwen     Qwen2.5-Coder 1.5B (`make models-qwen`). Training data: the Python standard
                  library's source; held out: the code prompts of data/code_prompts.jsonl.
                  Compared: autoregressive, the 0.5B draft, EAGLE, and at batch 1 transformers'
                  assisted generation with the 0.5B draft.

Training resumes after a kill: the target's features, the continuations and orbax checkpoints
live in models/<pair>-eagle3-work; the head is saved to models/<pair>-eagle3 (EAGLE-3 layout).
Timing: greedy, tokens/s medians over round-robin rounds after a warm-up; vs_ar is the median of
within-round ratios; the head's step cost is timed against a target step of one token.

    python scripts/bench_eagle.py --pair smollm2 [--train-only | --eval-only] [--steps 1200]

Writes docs/results/bench_eagle_<pair>.{json,md} (or into --out DIR).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import jax
import numpy as np
from bench_speculative import transformers_rows
from checkout import MODELS, QWEN, QWEN_DRAFT, add_out_argument, code_prompts, out_dir
from distill_smollm2 import prompt_split

import jaxspec
from jaxspec.cli.eagle import source_texts
from jaxspec.models import eagle
from jaxspec.tools.benchmarking import machine, table, write_results
from jaxspec.training.distill import answered


def smollm2_data(target, args):
    """(training token lists: prompt + the target's answer; the same for held-out prompts; the
    held-out prompts)."""
    train, heldout, _, _ = prompt_split(target.tokenizer, args.per_work, args.seed)
    train, heldout = train[:args.prompts], [target.tokenizer.encode(t) for t in heldout[:16]]
    return _answered(target, train, "continuations", args), _answered(target, heldout, "heldout", args), heldout


def _answered(target, prompts, name, args) -> list[list[int]]:
    ids = [target.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    return answered(target, ids, max_new_tokens=args.max_new_tokens, seed=args.seed,
                    eos_token_id=target.tokenizer.eos_token_id, max_len=args.seq_len, data_cache=str(args.work / name))


def qwen_data(target, args):
    """(standard-library modules, about `epochs` passes in `steps`; 8 other modules' first pieces
    held out; the code prompts of data/)."""
    texts = source_texts("stdlib")
    random.Random(args.seed).shuffle(texts)
    budget, data = int(args.steps * args.batch_size * args.seq_len / args.epochs), []
    for text in texts[8:]:
        data.append(target.tokenizer.encode(text))
        budget -= len(data[-1])
        if budget <= 0:
            break
    heldout = [target.tokenizer.encode(text)[:args.seq_len] for text in texts[:8]]
    return data, heldout, code_prompts(target.tokenizer)


def train(target, data, heldout, args):
    counts = np.zeros(target.config.vocab_size, np.int64)
    for row in data:
        counts += np.bincount(np.asarray(row), minlength=target.config.vocab_size)
    head = jaxspec.EagleHead.init(target, draft_vocab_size=args.draft_vocab, token_counts=counts, seed=args.seed)
    coverage = float(np.sort(counts)[::-1][:head.config.layer.vocab_size].sum() / counts.sum())
    print(f"{len(data)} sequences, {int(counts.sum())} tokens; draft vocabulary {head.config.layer.vocab_size} "
          f"covers {coverage:.3f} of them", flush=True)
    start = time.perf_counter()
    head, history = jaxspec.train_eagle(
        target, head, data, steps=args.steps, learning_rate=args.learning_rate, seed=args.seed,
        batch_size=args.batch_size, seq_len=args.seq_len, feature_cache_dir=args.work / "features",
        checkpoint_dir=args.work / "checkpoints", checkpoint_every=50, heldout=heldout,
        eval_every=max(1, args.steps // 4), eval_k=3)
    head.save(args.output)
    (Path(args.output) / "history.json").write_text(json.dumps(history))
    info = {"sequences": len(data), "tokens": int(counts.sum()), "draft_vocab_coverage": coverage,
            "train_minutes_this_run": (time.perf_counter() - start) / 60}
    (Path(args.output) / "training.json").write_text(json.dumps(info))
    return head


class _Runs:
    """The first `count` prompts decoded `batch` at a time; tokens and statistics summed."""

    def __init__(self, generate, prompts, batch: int, count: int):
        self.calls = [lambda p=prompts[i:i + batch]: generate(p) for i in range(0, count, batch)]

    def __call__(self):
        results = [jax.block_until_ready(call()) for call in self.calls]
        return {"tokens": [t for r in results for t in r.tokens], "new": sum(r.stats.new_tokens for r in results),
                "drafted": sum(r.stats.drafted_tokens for r in results),
                "accepted": sum(r.stats.acceptance_rate * r.stats.drafted_tokens for r in results),
                "steps": sum(r.stats.steps for r in results),
                "per_step": sum(r.stats.mean_accepted_length * r.stats.steps for r in results)}


def speed_rows(target, drafts: dict, prompts, args, batch: int, eos):
    count = max(batch, min(len(prompts), args.bench_prompts) // batch * batch)
    new = dict(max_new_tokens=args.new_tokens, eos_token_id=eos)
    fns = {"autoregressive": _Runs(lambda p: jaxspec.generate(target, p, **new), prompts, batch, count)}
    for label, (draft, k) in drafts.items():
        decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=k))
        fns[label] = _Runs(lambda p, d=decoder: d.generate(p, **new), prompts, batch, count)
    results = {label: fn() for label, fn in fns.items()}   # warm-up (compiles)
    seconds = {label: [] for label in fns}
    for _ in range(args.rounds):
        for label, fn in fns.items():
            start = time.perf_counter()
            results[label] = fn()
            seconds[label].append(time.perf_counter() - start)
    ar, rows = np.asarray(seconds["autoregressive"]), []
    args.reference[batch] = results["autoregressive"]["tokens"]
    for label, res in results.items():
        rows.append({"batch": batch, "prompts": count, "method": label,
                     "tok_s": res["new"] / float(np.median(seconds[label])),
                     "vs_ar": float(np.median(ar / np.asarray(seconds[label]))),
                     "acceptance": res["accepted"] / res["drafted"] if res["drafted"] else None,
                     "tokens_per_step": res["per_step"] / res["steps"] if res["steps"] else None,
                     "same_output": res["tokens"] == results["autoregressive"]["tokens"]})
    return rows


def head_step_fraction(target, head, rounds: int = 20) -> float:
    """Seconds of one head draft step over one target step of a single token (batch 1)."""
    cache_t, cache_h = target.init_cache(1, 256), head.init_cache(1, 256)
    tok = jax.numpy.zeros((1, 1), jax.numpy.int32)
    hidden = jax.numpy.zeros((1, 1, head.config.layer.hidden_size), head.params["fc_fd"].dtype)
    target_step = jax.jit(lambda p, c: target.forward(p, tok, c)[0])
    head_step = jax.jit(lambda p, c: eagle.head_forward(head.graphdef, p, head.embed_vd, hidden, tok, c)[0])
    times = {"target": [], "head": []}
    for i in range(rounds + 2):
        for name, fn, args in (("target", target_step, (target.params, cache_t)), ("head", head_step,
                                                                                     (head.params, cache_h))):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return float(np.median(np.asarray(times["head"]) / np.asarray(times["target"])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", choices=["smollm2", "qwen"], default="smollm2")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="a chat prompt and its answer fit whole")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--prompts", type=int, default=800, help="smollm2: training prompts")
    p.add_argument("--per-work", type=int, default=24, help="smollm2: passages per training work")
    p.add_argument("--max-new-tokens", type=int, default=128, help="smollm2: answer length of the training data")
    p.add_argument("--epochs", type=float, default=4, help="qwen: passes over the code in --steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-only", action="store_true")
    p.add_argument("--eval-only", action="store_true", help="measure the head already in models/")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--ks", type=int, nargs="+", default=[2, 3, 5])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--bench-prompts", type=int, default=8, help="held-out prompts decoded per timed run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", help="features, continuations and checkpoints (default models/<pair>-eagle3-work)")
    p.add_argument("--output", help="the head (default models/<pair>-eagle3)")
    add_out_argument(p)
    args = p.parse_args()
    args.work = Path(args.work or MODELS / f"{args.pair}-eagle3-work")
    args.output = Path(args.output or MODELS / f"{args.pair}-eagle3")
    if args.pair == "qwen" and not QWEN.exists():
        raise SystemExit(f"{QWEN} is missing: run `make models-qwen`")
    target = jaxspec.load(jaxspec.example_model("smollm2-135m") if args.pair == "smollm2" else QWEN)
    data, heldout, prompts = (smollm2_data if args.pair == "smollm2" else qwen_data)(target, args)
    head = jaxspec.load(args.output, target=target) if args.eval_only else train(target, data, heldout, args)
    if args.train_only:
        return
    bench(target, head, prompts, args)


def bench(target, head, heldout, args) -> None:
    eos = target.tokenizer.eos_token_id if args.pair == "smollm2" else None
    drafts = {f"eagle k={k}": (jaxspec.EagleDrafter(head), k) for k in args.ks}
    if args.pair == "smollm2":
        drafts["n-gram k=4"] = (jaxspec.NgramDrafter(max_ngram=3), 4)
    else:
        drafts["0.5B draft k=3"] = (jaxspec.load(QWEN_DRAFT), 3)
    rows, args.reference = [], {}
    for batch in args.batches:
        rows += speed_rows(target, drafts, heldout, args, batch, eos)
        print(table(rows[-len(drafts) - 1:]), flush=True)
        jax.clear_caches()
    if args.pair == "qwen" and 1 in args.batches:
        # transformers on the same prompt (batch 1), timed after the jaxspec rows: a rougher ratio.
        ar_b1 = next(r["tok_s"] for r in rows if r["batch"] == 1 and r["method"] == "autoregressive")
        for r in transformers_rows("qwen", heldout, args.new_tokens, args.reference, ar_b1):
            rows.append({key: r[key] for key in ("batch", "method", "tok_s", "vs_ar", "same_output")})
    fraction = head_step_fraction(target, head)
    history = json.loads((Path(args.output) / "history.json").read_text())
    info = json.loads((Path(args.output) / "training.json").read_text())
    curve = [{"step": s, "training_tokens": s * args.batch_size * args.seq_len, "heldout_loss": loss,
              "heldout_accepted_per_step_k3": a}
             for s, loss, a in zip(history["eval_step"], history["heldout_loss"], history["heldout_accepted_length"])]
    m = machine()
    md = "\n".join([
        f"{target.config.name} (float32) with an EAGLE-3 head trained here: {args.steps} steps of batch "
        f"{args.batch_size} x {args.seq_len} tokens on {info['sequences']} sequences ({info['tokens']} tokens; "
        f"draft vocabulary {head.config.layer.vocab_size}, covering {info['draft_vocab_coverage']:.3f} of them; "
        f"the optimizer steps took {info['train_minutes_this_run']:.0f} min). "
        f"Measured on the first {args.bench_prompts} of {len(heldout)} held-out prompts (decoded `batch` at a time), "
        f"greedy, {args.new_tokens} new tokens; tok/s medians over "
        f"{args.rounds} round-robin rounds after warm-up. One head step costs {fraction:.3f} of a one-token target "
        f"step (batch 1). Machine: {m['processor']}, {m['cpu_count']} cores, jax {m['jax']}.", "", table(rows), "",
        "Held-out loss and greedy acceptance (k = 3, tokens per step) against training tokens seen:", "",
        table(curve)])
    print("\n" + md)
    del args.reference
    write_results(out_dir(args) / f"bench_eagle_{args.pair}", {
        "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "head_step_fraction": fraction,
        "curve": curve, "training": info}, md)


if __name__ == "__main__":
    main()
