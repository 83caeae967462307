"""The `jaxspec` command line's other subcommands: `profile`, `bench`, `distill`, and the helpers
the subcommands share (model arguments, output folders, chat prompts, integer lists).
`jaxspec.cli.main` holds `generate`, `merge` and the entry point."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax

import jaxspec
from jaxspec.cli import jobs as jobs_lib
from jaxspec.engine import kernels
from jaxspec.policy.cost import COEFFICIENTS, CostModel
from jaxspec.tools.benchmarking import table

MODEL_HELP = "GGUF file, HF folder, jaxspec checkpoint, or preset:NAME (random weights)"
DTYPES = ("float32", "bfloat16")
NO_DRAFT_MODEL = ("none", "ngram")   # --draft values that load no draft model


def warn(message: str) -> None:
    """Prints a one-line warning on stderr."""
    print(f"jaxspec: warning: {message}", file=sys.stderr, flush=True)


def add_model_args(group, *, quantize: bool = False) -> None:
    """--target and --dtype (and --quantize): the model options every model-loading subcommand has."""
    group.add_argument("--target", required=True, help=MODEL_HELP)
    group.add_argument("--dtype", default="float32", choices=DTYPES)
    if quantize:
        group.add_argument("--quantize", default="none", choices=["none", "int8"],
                           help="int8 weights (one scale per output channel) for the target and a draft model")


def output_path(output: str) -> Path:
    """--output as a Path, once its folder is known to exist (checked before any model is loaded)."""
    path = Path(output)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"--output {output}: folder {str(path.parent)!r} does not exist")
    return path


def chat_tokenizer(model: jaxspec.Model, name: str):
    """The model's tokenizer, which --chat needs for its chat template; `name`: the model's argument."""
    if model.tokenizer is None:
        raise ValueError(f"--chat needs a tokenizer with a chat template; {name} has no tokenizer")
    return model.tokenizer


def chat_prompt(tokenizer, text: str) -> str:
    """`text` as a user's turn in the tokenizer's chat template, with the assistant's turn opened."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def load_model(spec: str, dtype: str, *, seed: int = 0, quantize: str = "none") -> jaxspec.Model:
    """A model from a path or `preset:NAME` (random weights), int8-quantized on request."""
    quantize = None if quantize == "none" else quantize
    if spec.startswith("preset:"):
        config = jaxspec.ModelConfig.preset(spec.split(":", 1)[1])
        model = jaxspec.Model.random(config, seed=seed, dtype=dtype)
        return model.quantize(quantize) if quantize else model
    return jaxspec.load(spec, dtype=dtype, quantize=quantize)


def save_trained(trained, history: dict, output: Path, eval_rows: list[dict]) -> None:
    """Saves a trained draft or head with its history.json, and prints its held-out evaluations."""
    trained.save(output)
    (output / "history.json").write_text(json.dumps(history, indent=1))
    if eval_rows:
        print(table(eval_rows))


def positive_ints(text: str, low: int = 1) -> tuple[int, ...]:
    """An argparse type: comma-separated integers, each >= `low`."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < low:
        kind = "positive" if low == 1 else f">= {low}"
        raise argparse.ArgumentTypeError(f"expected {kind} integers, got {text!r}")
    return values


def nonnegative_ints(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated integers, each >= 0 (draft lengths, layer indices)."""
    return positive_ints(text, low=0)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def profile(args) -> int:
    """`jaxspec profile`: times speculative steps on this device and writes the fitted cost model."""
    target = load_model(args.target, args.dtype, quantize=args.quantize)
    draft = None if args.draft in NO_DRAFT_MODEL else load_model(args.draft, args.dtype, seed=1,
                                                                    quantize=args.quantize)
    print(f"profiling {target.config.name} (target) and {draft.config.name if draft else 'no draft model'} "
          f"on {jax.devices()[0].device_kind} ...", flush=True)
    grid = dict(batches=args.batches, ks=args.ks, cache_lens=args.cache_lens, passes=args.passes)
    cost = CostModel.profile(target, draft, **grid)
    if args.free:   # a hybrid drafter's free plans verify without the draft model's catch-up
        cost = dataclasses.replace(cost, free=CostModel.profile(target, None, **grid))
    cost.fit["kernels"] = _kernels()   # the XLA:CPU kernels each timed program compiled with
    cost.save(args.output)
    fits = {**cost.fit, **({"free " + part: fit for part, fit in cost.free.fit.items()} if cost.free else {})}
    rows = [{"part": part, **{k: v for k, v in fit.items() if k != "points_seconds"}}
            for part, fit in fits.items() if fit and part != "kernels"]
    coefficients = [{"coefficient": name, "seconds": getattr(cost, name),
                     **({"free (no draft model)": getattr(cost.free, name)} if cost.free else {})}
                    for name in COEFFICIENTS]
    print(table(coefficients))
    print(table(rows))
    if cost.fit["kernels"]["programs"]:
        print(table(cost.fit["kernels"]["programs"]))
    print(f"wrote {args.output}")
    return 0


def _kernels() -> dict:
    """This process's choices so far, for a record (`jaxspec profile` keeps it in the cost model):
    the machine, the setting, and per probed program its product rows, each candidate's total
    milliseconds and the choice."""
    programs = [dict(program=d["program"], rows=" ".join(map(str, d["rows"])), kernels=d["kernels"],
                     **{f"{name}_ms": round(1e3 * sec, 3) for name, sec in d["seconds"].items()})
                for d in kernels.DECISIONS]
    return dict(machine=kernels.machine_key(), setting=kernels.mode(), programs=programs)


SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"   # a source checkout's; an installed package has none

# name -> (script, arguments of a quick run: small sizes, one repeat, results under a *_quick name).
BENCHES: dict[str, tuple[str, list[str]]] = {
    "speculative": ("bench_speculative.py", ["--part", "sonnet", "--new-tokens", "32", "--batches", "4",
                                             "--ks", "2", "4", "--tetris-ks", "2", "--extras", "1", "3",
                                             "--pipeline-ks", "2", "--rounds", "1", "--profile-batches", "4",
                                             "--profile-cache-lens", "296",
                                             "--skip-transformers", "--name", "bench_speculative_quick"]),
    "tetris": ("bench_tetris.py", ["--part", "tiny", "--batches", "8", "--ks", "2", "--extras", "1",
                                   "--new-tokens", "32", "--repeats", "1", "--name", "bench_tetris_quick"]),
    "goodput": ("bench_goodput.py", ["--batches", "4", "--ks", "1", "2", "--new-tokens", "24", "--rounds", "1",
                                     "--name", "bench_goodput_quick"]),
    "mesh": ("mesh_sweep.py", ["--threads", "multi", "--new-tokens", "16", "--repeats", "1", "--name",
                               "mesh_sweep_quick"]),
    "goodput-sliced": ("bench_goodput_sliced.py", ["--batches", "8", "--ks", "1", "2", "--new-tokens", "16",
                                                   "--rounds", "2", "--name", "bench_goodput_sliced_quick"]),
}


def bench(args) -> int:
    """`jaxspec bench`: runs the benchmark scripts one after another, each in its own process."""
    names = [args.only] if args.only else list(BENCHES)
    extra = list(args.script_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if extra and not args.only:
        raise ValueError("extra script arguments need --only NAME (each script takes its own arguments)")
    out = [] if args.out is None else ["--out", str(Path(args.out).resolve())]
    failed = []
    for name in names:
        script, quick = BENCHES[name]
        path = SCRIPTS / script
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: `jaxspec bench` runs the scripts of a source checkout")
        command = [sys.executable, str(path), *(quick if args.quick else []), *out, *extra]
        print("$ " + " ".join(command), flush=True)
        if args.dry_run:
            continue
        if subprocess.run(command).returncode != 0:
            failed.append(name)
    if failed:
        print(f"jaxspec: error: benchmark{'s' if len(failed) > 1 else ''} failed: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


def distill(args) -> int:
    """`jaxspec distill`: train a draft to agree with its target; saves it as a jaxspec checkpoint."""
    def prompt_texts(path):
        jobs = jobs_lib.read_jobs(path, skip_bad_lines=args.skip_bad_lines, warn=warn)
        return [job.prompt for job in jobs]

    for name in ("steps", "batch_size", "max_new_tokens", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.learning_rate <= 0:
        raise ValueError(f"--learning-rate must be > 0, got {args.learning_rate}")
    prompts = prompt_texts(args.prompts)
    heldout = prompt_texts(args.heldout) if args.heldout else None
    output = output_path(args.output)
    target = load_model(args.target, args.dtype)
    if args.draft is not None:
        draft = load_model(args.draft, args.dtype, seed=1)
    else:
        draft = jaxspec.draft_from_target(target, args.init_layers, hidden_size=args.init_hidden, seed=args.seed)
    if args.chat:
        tok = chat_tokenizer(target, args.target)
        for texts in (prompts, heldout or []):
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("--chat needs string prompts, got token ids")
            texts[:] = [chat_prompt(tok, t) for t in texts]
    eos = target.tokenizer.eos_token_id if args.eos and target.tokenizer is not None else None
    print(f"distilling {draft.config.name} ({draft.config.num_layers} layers, hidden {draft.config.hidden_size}) "
          f"from {target.config.name} on {len(prompts)} prompts, {args.steps} steps", flush=True)
    trained, history = jaxspec.distill(
        target, draft, prompts, steps=args.steps, learning_rate=args.learning_rate, seed=args.seed, loss=args.loss,
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, temperature=list(args.temperature),
        eos_token_id=eos, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, data_cache=args.data_cache,
        heldout_prompts=heldout, eval_every=args.eval_every, eval_k=args.eval_k,
        eval_max_new_tokens=args.eval_max_new_tokens, progress=not args.no_progress)
    save_trained(trained, history, output, [
        {"step": s, "heldout_acceptance": a, "tokens_per_step": m}
        for s, a, m in zip(history["eval_step"], history["acceptance_rate"], history["mean_accepted_length"])])
    print(f"final loss {history['loss'][-1]:.4f}; wrote the draft to {output} (load it with jaxspec.load)")
    return 0


def add_distill(sub) -> None:
    p = sub.add_parser(
        "distill", help="train a draft model to agree with its target (optax; resumable with orbax)",
        description="The target continues the prompts (cached in --data-cache), then the draft is trained to "
                    "match the target's next-token distributions on those sequences (AdamW, warm-up + cosine, "
                    "gradient clipping). With --checkpoint-dir a killed run resumes from its last checkpoint "
                    "and ends as an uninterrupted one would. Held-out greedy acceptance (speculative decoding "
                    "with the draft) is measured before, every --eval-every steps and after. The draft is "
                    "saved as a jaxspec checkpoint folder, with history.json.",
        epilog="example:\n  jaxspec distill --target model.gguf --init-layers 4 --init-hidden 256 "
               "--prompts train.jsonl --heldout heldout.jsonl --output draft/ --steps 600 "
               "--checkpoint-dir ckpt/ --data-cache data/",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    models = p.add_argument_group("models")
    add_model_args(models)
    models.add_argument("--draft", help="the starting draft (same vocabulary); default: made from the target")
    models.add_argument("--init-layers", type=int, default=4,
                        help="without --draft: the draft's layers (the target's first ones when the width is kept)")
    models.add_argument("--init-hidden", type=int, default=None,
                        help="without --draft: the draft's width (default: the target's)")
    data = p.add_argument_group("data")
    data.add_argument("--prompts", required=True, metavar="IN.jsonl", help='training prompts, {"id", "prompt"} lines')
    data.add_argument("--heldout", metavar="IN.jsonl", help="held-out prompts for the acceptance estimate")
    data.add_argument("--skip-bad-lines", action="store_true", help="skip malformed prompt lines with a warning")
    data.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    data.add_argument("--max-new-tokens", type=int, default=64, help="continuation length per prompt")
    data.add_argument("--temperature", type=_floats, default=(0.0,),
                      help="temperature(s) of the target's continuations, e.g. 0,1 for both (default 0)")
    data.add_argument("--eos", action=argparse.BooleanOptionalAction, default=True,
                      help="end continuations at the tokenizer's end-of-sequence token")
    data.add_argument("--data-cache", metavar="DIR", help="keep the generated continuations here for reruns")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=500)
    train.add_argument("--learning-rate", type=float, default=1e-3, help="peak AdamW learning rate")
    train.add_argument("--loss", default="tvd", choices=["tvd", "forward_kl", "reverse_kl"])
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--warmup-steps", type=int, default=0)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--eval-max-new-tokens", type=int, default=None)
    add_training_args(train)
    p.add_argument("--output", required=True, metavar="DIR", help="where to save the trained draft")
    p.set_defaults(run=distill)


def add_training_args(train) -> None:
    """The options `distill` and `train-eagle` share: seed, checkpoints, evaluation, progress."""
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--checkpoint-dir", metavar="DIR", help="orbax checkpoints; an existing run there resumes")
    train.add_argument("--checkpoint-every", type=int, default=100)
    train.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    train.add_argument("--eval-k", type=int, default=4, help="draft length of the held-out evaluation")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run the benchmark scripts (scripts/bench_*.py, mesh_sweep.py)",
                       description="Runs the benchmark suite of a source checkout, each script in its own "
                                   "process; each prints tables and writes <name>.{json,md} into --out "
                                   f"(default: the checkout's docs/results). Benchmarks: {', '.join(BENCHES)}. "
                                   "Arguments after `--` go to the script (with --only).",
                       epilog="example: jaxspec bench --quick --only tetris --out /tmp/results")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and one repeat (minutes, not hours); results under <name>_quick")
    p.add_argument("--only", choices=list(BENCHES), help="run this benchmark only")
    p.add_argument("--out", metavar="DIR", help="the folder the results go to (default: docs/results)")
    p.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(run=bench)


def add_profile(sub) -> None:
    p = sub.add_parser("profile", help="time speculative steps on this device and fit a cost model",
                       description="Times the speculative decode step over batch sizes, draft lengths and cache "
                                   "sizes (inside a compiled loop), fits the linear latency models of the draft "
                                   "and the target verification and writes them as JSON for "
                                   "SpecConfig(policy='goodput', cost_model=CostModel.load(...)).")
    add_model_args(p, quantize=True)
    p.add_argument("--draft", default="none", help="path, preset:NAME, or none/ngram (no draft model)")
    p.add_argument("--batches", type=positive_ints, default=(1, 2, 4, 8, 16), help="comma-separated batch sizes")
    p.add_argument("--ks", type=nonnegative_ints, default=(0, 1, 2, 4),
                   help="draft lengths timed (0 and at least two values >= 1)")
    p.add_argument("--cache-lens", type=positive_ints, default=(128, 512), help="cache sizes")
    p.add_argument("--passes", type=int, default=3,
                   help="passes over all the shapes, each in a shuffled order; a shape's time is the median over "
                        "passes (a drift of the machine's speed then does not bend the fit)")
    p.add_argument("--free", action="store_true",
                   help="also time the target with no draft model: prices the free plans of a hybrid drafter "
                        "(--draft suffix+PATH under --policy goodput)")
    p.add_argument("--output", default="cost_model.json")
    p.set_defaults(run=profile)
