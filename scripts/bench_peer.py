"""Peer benchmark: jaxspec against transformers on one GGUF pair, the same prompts, float32, greedy.

Both frameworks load the same GGUF files (dequantised to float32) into one process and decode the
first --prompts code prompts of data/code_prompts.jsonl, --new-tokens each (no eos), at each batch
size B (the prompts B at a time, cycled to fill a batch):
  jaxspec plain (`jaxspec.generate`), speculative (`SpeculativeDecoder`, SpecConfig(k) for each of
    --ks; with --cost-model FILE also policy="goodput" at the largest k, with that profiled model);
  transformers plain (`generate(do_sample=False)`, left-padded with an attention mask) and assisted
    (`assistant_model=` the draft, transformers' own draft-length schedule); assisted generation
    takes one row only, so it runs at batch 1 (N/A at larger B).
--pair smollm2: SmolLM2-135M, drafts from n-gram lookup (jaxspec `NgramDrafter`, transformers'
prompt lookup, `prompt_lookup_num_tokens` = the largest k).
One framework's weights are in memory at a time (the Qwen pair in float32 takes 11 GB in jaxspec
and 9 GB in torch, this VM 24 GB, shared): the other's wait on disk (`WeightParking`), swapped
between configurations, untimed; --resident keeps both.
Every configuration is warmed up, then timed once per round, round-robin (`round_robin`); tok_s
uses the median time; ratios are medians over rounds of the time ratio within a round: `vs_plain`
against the same engine's plain decoding, `vs_tf_plain` / `vs_tf_assisted` (jaxspec rows) against
transformers' plain / assisted decoding. Outputs: jaxspec plain is checked against transformers
plain, speculative against its engine's plain, transformers at B > 1 against itself at batch 1;
`agree` counts identical rows, `first_diff` names where the others part (float32 rounding can
flip a near-tie late in a sequence). Also at batch 1: one verification of 5 tokens against one
plain step, jaxspec's inside its device loop (`engine.timing.time_steps`, n-gram drafts) and a
cached transformers forward, with a context of the prompts' median length.

    python scripts/bench_peer.py [--pair qwen|smollm2] [--models DIR] [--batches 1 4] [--ks 3 5]
        [--rounds 2] [--new-tokens 64] [--prompts 4] [--cost-model FILE] [--resident] [--out DIR]

Writes docs/results/<name>.{json,md} (or into --out DIR).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
from checkout import MODELS, add_out_argument, code_prompts, out_dir, qwen_files

import jaxspec
from jaxspec.engine import timing
from jaxspec.tools import benchmarking as bench

COLUMNS = ["batch", "engine", "method", "k", "tok_s", "vs_plain", "vs_tf_plain", "vs_tf_assisted",
           "mean_accepted", "checked_vs", "agree", "first_diff"]


def load_pair(args, parking):
    """(jaxspec target, its draft, transformers target, generate's drafting arguments, a title);
    each framework's weights are parked (`WeightParking`) as soon as it is loaded, unless --resident."""
    if args.pair == "qwen":
        target_path, draft_path = qwen_files(args.models)
        target, draft = jaxspec.load(target_path), jaxspec.load(draft_path)
    else:
        target_path = jaxspec.example_model("smollm2-135m")
        target, draft = jaxspec.load(target_path), jaxspec.NgramDrafter(max_ngram=3)
    parking.add("jaxspec", [m for m in (target, draft) if isinstance(m, jaxspec.Model)])
    parking.hold(None)
    hf_target = bench.transformers_gguf(target_path)
    if args.pair == "qwen":
        hf_draft = bench.transformers_gguf(draft_path)
        parking.add("transformers", [hf_target, hf_draft])
        return target, draft, hf_target, {"assistant_model": hf_draft}, "Qwen2.5-Coder 1.5B target, 0.5B draft"
    parking.add("transformers", [hf_target])
    return (target, draft, hf_target, {"prompt_lookup_num_tokens": max(args.ks), "max_matching_ngram_size": 3},
            "SmolLM2-135M, n-gram lookup drafts")


def jaxspec_fn(generate, batches):
    def fn(on_finish=None):
        results = [generate(chunk) for chunk in batches]
        return SimpleNamespace(tokens=[t for r in results for t in r.tokens], stats=[r.stats for r in results])
    return fn


def transformers_fn(model, batches, new_tokens, **drafting):
    import torch

    def fn(on_finish=None):
        tokens = []
        for chunk in batches:
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=0, **drafting)
            tokens += out[:, width:].tolist()
        return SimpleNamespace(tokens=tokens, stats=None)
    return fn


def run_batch(batch, pair, prompts, args, reference, parking):
    """Rows of every configuration at one batch size; `reference` collects each engine's plain
    tokens by batch (transformers' batch-1 tokens check its larger batches)."""
    target, draft, hf_target, drafting = pair
    rows_in = [prompts[i % len(prompts)] for i in range(-(-len(prompts) // batch) * batch)]
    batches = [rows_in[i:i + batch] for i in range(0, len(rows_in), batch)]
    new = args.new_tokens
    fns = {("jaxspec", "plain", 0): jaxspec_fn(lambda c: jaxspec.generate(target, c, max_new_tokens=new), batches)}
    specs = [("speculative", k, jaxspec.SpecConfig(k=k)) for k in args.ks]
    if args.cost_model:
        specs.append(("goodput", max(args.ks), jaxspec.SpecConfig(k=max(args.ks), policy="goodput",
                                                                  cost_model=jaxspec.CostModel.load(args.cost_model))))
    for method, k, spec in specs:
        decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec)
        fns[("jaxspec", method, k)] = jaxspec_fn(lambda c, d=decoder: d.generate(c, max_new_tokens=new), batches)
    fns[("transformers", "plain", 0)] = transformers_fn(hf_target, batches, new)
    if batch == 1:
        fns[("transformers", "assisted", None)] = transformers_fn(hf_target, batches, new, **drafting)
    print(f"batch {batch}: {len(fns)} configurations x {len(batches)} call(s), warm-up and {args.rounds} round(s)",
          flush=True)
    results, seconds, _ = bench.round_robin(fns, args.rounds, before=lambda label: parking.hold(label[0]))
    tf_plain, tf_assisted = ("transformers", "plain", 0), ("transformers", "assisted", None)
    reference.update({(engine, batch): results[(engine, "plain", 0)].tokens for engine in ("jaxspec", "transformers")})
    checks = {"jaxspec plain": ("transformers", batch), "transformers plain": ("transformers", 1)}
    rows = []
    for label, res in results.items():
        engine, method, k = label

        def vs(other, label=label):
            return float(np.median(seconds[other] / seconds[label])) if other in seconds else None
        check = checks.get(f"{engine} {method}", (engine, batch))
        if check == (engine, batch) and method == "plain" or check not in reference:
            agree, diff, check_name = "-", "", "-"
        else:
            firsts = bench.first_differences(reference[check], res.tokens[:len(reference[check])])
            agree = f"{firsts.count(None)}/{len(firsts)}"
            diff = ", ".join(f"row {i} @ {j}" for i, j in enumerate(firsts) if j is not None)
            check_name = f"{check[0]} plain" + (f" (batch {check[1]})" if check[1] != batch else "")
        stats = [s for s in res.stats or [] if s is not None]
        rows.append({"batch": batch, "engine": engine, "method": method, "k": k,
                     "tok_s": sum(map(len, res.tokens)) / float(np.median(seconds[label])),
                     "vs_plain": vs((engine, "plain", 0)),
                     "vs_tf_plain": vs(tf_plain) if engine == "jaxspec" else None,
                     "vs_tf_assisted": vs(tf_assisted) if engine == "jaxspec" and method != "plain" else None,
                     "mean_accepted": float(np.mean([s.mean_accepted_length for s in stats]))
                     if stats and method != "plain" else None,
                     "checked_vs": check_name, "agree": agree, "first_diff": diff,
                     "seconds": seconds[label].tolist()})
        print(bench.table(rows[-1:], COLUMNS), flush=True)
    if batch > 1:
        rows.append({"batch": batch, "engine": "transformers", "method": "assisted", "k": None,
                     "tok_s": None, "checked_vs": "N/A: assisted generation takes batch 1 only"})
    return rows


def step_costs(target, hf_target, context_ids, parking, k=4):
    """Seconds of one plain step and of one verification of k + 1 tokens, batch 1, per engine."""
    ctx = len(context_ids)
    ngram = jaxspec.NgramDrafter().bind_vocab(target.config.vocab_size)
    parking.hold("jaxspec")
    jax_s = [timing.time_steps(target, ngram, kk, 1, timing.cache_len_for(ctx, kk, 6), repeats=5) for kk in (0, k)]
    parking.hold("transformers")
    tf_s = [bench.transformers_step_seconds(hf_target, context_ids, context_ids[-n:]) for n in (1, k + 1)]
    return [{"engine": engine, "context": ctx, "step_ms": s[0] * 1e3, f"verify_{k + 1}_ms": s[1] * 1e3,
             "ratio": s[1] / s[0]} for engine, s in (("jaxspec", jax_s), ("transformers", tf_s))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="qwen", choices=["qwen", "smollm2"])
    parser.add_argument("--models", default=str(MODELS), metavar="DIR", help="folder of the Qwen GGUF files")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4, help="how many of the code prompts")
    parser.add_argument("--cost-model", metavar="FILE", help="a CostModel JSON for this pair: adds goodput rows")
    parser.add_argument("--resident", action="store_true",
                        help="keep both frameworks' weights in memory (the Qwen pair: about 21 GB); by default one "
                             "framework's wait on disk while the other's run (`WeightParking`), swapped untimed")
    parser.add_argument("--name", default=None, help="default: bench_peer (qwen), bench_peer_smollm2")
    add_out_argument(parser)
    args = parser.parse_args()
    name = args.name or ("bench_peer" if args.pair == "qwen" else "bench_peer_smollm2")
    # OpenMP threads that spin while waiting slow torch fivefold on this shared VM whenever another
    # process holds a core (SmolLM2, 2 threads: 2.1 tok/s spinning, 9.8 passive); read at torch's import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_peer_") as folder:
        parking = bench.WeightParking(folder, resident=args.resident)
        target, draft, hf_target, drafting, title = load_pair(args, parking)
        print(f"loaded {title} in {time.perf_counter() - start:.0f} s", flush=True)
        prompts = code_prompts(target.tokenizer)[:args.prompts]
        rows, reference = [], {}
        for batch in sorted(args.batches):
            rows += run_batch(batch, (target, draft, hf_target, drafting), prompts, args, reference, parking)
        context = sorted(prompts, key=len)[len(prompts) // 2]
        costs = step_costs(target, hf_target, context, parking)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(bench.table(costs), flush=True)
    m = bench.machine()
    weights = "resident" if args.resident else f"parked on disk in turn, {parking.swaps} swaps (untimed)"
    md = "\n".join([
        f"# {name}\n\n`python scripts/bench_peer.py {' '.join(sys.argv[1:])}`\n",
        " ".join(__doc__.split("\n\n")[1].split()),
        f"\n{title}; {len(prompts)} prompt(s), {args.new_tokens} new tokens each, {args.rounds} round(s). "
        f"Machine: {m['cpu_model']}, {m['cpu_count']} cores; jax {m['jax']}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}), "
        f"transformers {sys.modules['transformers'].__version__}. "
        f"Total time {time.perf_counter() - start:.0f} s; peak memory {peak_gb:.1f} GiB; weights {weights}.", "",
        bench.table(rows, COLUMNS), "",
        "One verification of 5 tokens against one plain step, batch 1 (`ratio` = verify / step):", "",
        bench.table(costs)])
    print("\n" + md)
    bench.write_results(out_dir(args) / name, {"args": vars(args), "rows": rows, "step_costs": costs,
                                                  "peak_rss_gib": peak_gb, "swaps": parking.swaps}, md)


if __name__ == "__main__":
    main()
