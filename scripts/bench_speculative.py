"""Speculative decoding on CPU: every method, over batch sizes and k, with real models.

Parts:
  sonnet  SmolLM2-135M-Instruct with n-gram lookup, asked to repeat lines of Sonnet 18 (the TETRIS
          paper's sonnet task).
  qwen    Qwen2.5-Coder 1.5B target, 0.5B draft, on the code prompts in data/code_prompts.jsonl
          (needs `make models-qwen`); then, at batch 1, transformers' autoregressive and assisted
          generation (assistant_model=; it supports no larger batch) on the same GGUF files and prompts.

For each batch size, greedy: autoregressive decoding, standard speculative decoding at each k,
TETRIS at k with extra = 1..3 (budget C = N * k, standard's), the goodput policy (k chosen per step
in 0..max k, with a cost model profiled here first or read from --cost-model), and pipelined
decoding (draft and target alternate two half batches; one device). Throughput (tokens/s) and each
request's latency (seconds from the call's start until it finished, reported by `on_finish`; p50
and p90 over the batch) are measured in the same calls. Configurations are warmed up, then timed
round-robin, one call each per round; `vs_ar` is the median over rounds of the ratio to
autoregressive within a round (this VM's speed drifts). Outputs are checked identical to
autoregressive decoding. Writes docs/results/<name>.{json,md} and <name>_{throughput,vsr}.png (or
into --out DIR).

    python scripts/bench_speculative.py [--part sonnet qwen] [--batches 1 4] [--ks 1 2 3 4 5 6]
"""

from __future__ import annotations

import argparse
import gc
import time

import jax
import numpy as np
from checkout import QWEN, QWEN_DRAFT, add_out_argument, code_prompts, out_dir, pyplot, qwen_files, sonnet

import jaxspec
from jaxspec.prompts import bucket_batch, bucket_length
from jaxspec.tools.benchmarking import machine, round_robin, table, transformers_gguf, write_results

METHODS = ("speculative", "tetris", "goodput", "pipelined")
COLUMNS = ["task", "batch", "method", "k", "extra", "tok_s", "vs_ar", "latency_p50_s", "latency_p90_s",
           "acceptance", "vsr", "ter", "mean_accepted", "k_used", "same_output"]


def configurations(args, cost):
    """(method, k, extra, SpecConfig or None) for every configuration timed at one batch size."""
    configs = [("autoregressive", 0, 0, None)]
    if "speculative" in args.methods:
        configs += [("speculative", k, 0, jaxspec.SpecConfig(k=k)) for k in args.ks]
    if "tetris" in args.methods:
        configs += [("tetris", k, e, jaxspec.SpecConfig(k=k, extra=e, selection="tetris"))
                    for k in args.tetris_ks or args.ks for e in args.extras]
    if "goodput" in args.methods:
        configs += [("goodput", max(args.ks), 0, jaxspec.SpecConfig(k=max(args.ks), policy="goodput",
                                                                      cost_model=cost))]
    if "pipelined" in args.methods:
        configs += [("pipelined", k, 0, jaxspec.SpecConfig(k=k, pipeline=True)) for k in args.pipeline_ks or args.ks]
    return configs


def cost_model(part, target, draft, prompts, args):
    """The --cost-model file profiled for this pair, else a fresh profile (saved next to the results)."""
    draft_name = draft.config.name if isinstance(draft, jaxspec.Model) else "ngram"
    for path in args.cost_model:
        cost = jaxspec.CostModel.load(path)
        if (cost.target_name, cost.draft_name) == (target.config.name, draft_name):
            print(f"{part}: cost model from {path}", flush=True)
            return cost
    # Profiled at the cache size the runs compile for (and half of it) and at their batch buckets.
    cache_len = (bucket_length(max(map(len, prompts))) + bucket_length(args.new_tokens)
                 + bucket_length(max(args.ks) + 2, 8))
    batches = args.profile_batches or sorted({1, 2} | {bucket_batch(b) for b in args.batches})
    start = time.perf_counter()
    cost = jaxspec.CostModel.profile(target, draft if isinstance(draft, jaxspec.Model) else None, batches=batches,
                                     ks=(0, 1, 2, 4), cache_lens=args.profile_cache_lens or (cache_len // 2, cache_len),
                                     passes=2)
    print(f"{part}: cost model profiled in {time.perf_counter() - start:.0f} s (batches {batches}), "
          f"R^2 {cost.fit['step']['r2']:.3f}", flush=True)
    cost.save(out_dir(args) / f"{args.name}_{part}_cost_model.json")
    jax.clear_caches()
    return cost


def run_grid(part, task, target, draft, prompts, args):
    """Rows of every configuration at every batch size; also the autoregressive outputs by batch."""
    cost = cost_model(part, target, draft, prompts, args) if "goodput" in args.methods else None
    rows, reference = [], {}
    for batch in args.batches:
        ids = [prompts[i % len(prompts)] for i in range(batch)]
        configs = configurations(args, cost)
        fns = {}
        for method, k, extra, spec in configs:
            label = (method, k, extra)
            if spec is None:
                fns[label] = lambda on_finish: jaxspec.generate(target, ids, max_new_tokens=args.new_tokens)
            else:
                decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec)
                fns[label] = (lambda on_finish, decoder=decoder:
                              decoder.generate(ids, max_new_tokens=args.new_tokens, on_finish=on_finish))
        print(f"{task}, batch {batch}: {len(fns)} configurations, warm-up and {args.rounds} round(s)", flush=True)
        results, seconds, latencies = round_robin(fns, args.rounds)
        ar = ("autoregressive", 0, 0)
        reference[batch] = results[ar].tokens
        for method, k, extra, spec in configs:
            label = (method, k, extra)
            res, s = results[label], results[label].stats
            p50, p90 = (float(np.median(np.percentile(latencies[label], q, axis=1))) for q in (50, 90))
            row = {"task": task, "batch": batch, "method": method, "k": k, "extra": extra,
                   "tok_s": sum(map(len, res.tokens)) / float(np.median(seconds[label])),
                   "vs_ar": float(np.median(seconds[ar] / seconds[label])),
                   "latency_p50_s": p50, "latency_p90_s": p90,
                   "acceptance": s.acceptance_rate if spec else None, "vsr": s.vsr if spec else None,
                   "ter": s.ter if spec else None, "mean_accepted": s.mean_accepted_length if spec else 1.0,
                   "k_used": float(np.mean(s.extra["k_trace"])) if method == "goodput" else None,
                   "same_output": res.tokens == reference[batch]}
            rows.append(row)
            print(table([row], COLUMNS), flush=True)
        del fns, results
        jax.clear_caches()   # programs of this batch size are not reused; keep memory bounded
    return rows, reference, cost


def timed_run(fn, warm):
    warm()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def transformers_rows(task, prompts, new_tokens, reference, jax_ar_tok_s):
    # Imported here: only these rows need torch, and the scripts that import this one (bench_eagle,
    # device_check on a GPU machine's own python) may run without it.
    import torch

    target, draft = transformers_gguf(QWEN), transformers_gguf(QWEN_DRAFT)   # no eos: exactly new_tokens
    rows = []
    ids = torch.tensor([prompts[0]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for method, kwargs in (("transformers autoregressive", {}),
                               ("transformers assisted", {"assistant_model": draft})):
            run = lambda: target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,  # noqa: E731
                                          do_sample=False, pad_token_id=0, **kwargs)
            seconds, out = timed_run(run, lambda: target.generate(ids, attention_mask=mask, max_new_tokens=8,
                                                                  do_sample=False, pad_token_id=0, **kwargs))
            tokens = out[0, len(prompts[0]):].tolist()
            tok_s = len(tokens) / seconds
            rows.append({"task": task, "batch": 1, "method": method, "k": None, "extra": None, "tok_s": tok_s,
                         "vs_ar": tok_s / jax_ar_tok_s, "latency_p50_s": seconds, "latency_p90_s": seconds,
                         "same_output": tokens == reference[1][0]})
            print(table(rows[-1:], COLUMNS), flush=True)
    return rows


def qwen_part(args):
    start = time.perf_counter()
    target, draft = map(jaxspec.load, qwen_files())
    print(f"loaded the Qwen pair in {time.perf_counter() - start:.0f}s", flush=True)
    prompts = code_prompts(target.tokenizer)
    task = "qwen-coder 1.5B <- 0.5B, code"
    rows, reference, cost = run_grid("qwen", task, target, draft, prompts, args)
    del target, draft
    gc.collect()
    if not args.skip_transformers and 1 in reference:
        # Against jaxspec at batch 1, timed minutes earlier: a ratio across moments, so rougher.
        ar_b1 = next(r["tok_s"] for r in rows if r["batch"] == 1 and r["method"] == "autoregressive")
        rows += transformers_rows(task, prompts, args.new_tokens, reference, ar_b1)
    return rows, cost


def sonnet_part(args):
    model = jaxspec.load(jaxspec.example_model("smollm2-135m"))
    poem = sonnet()
    prompts = []
    for first in range(0, 8):
        ask = (f"Here is a sonnet:\n{poem}\n\nRepeat lines {first + 1} to {first + 6} "
               f"of the sonnet exactly, one per line.")
        chat = model.tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                                   add_generation_prompt=True)
        prompts.append(model.tokenizer(chat)["input_ids"])
    rows, _, cost = run_grid("sonnet", "smollm2-135m + n-gram, sonnet", model, jaxspec.NgramDrafter(max_ngram=3),
                             prompts, args)
    return rows, cost


def plot(rows, prefix):
    """<prefix>_throughput.png: tokens/s against k, one line per method, a panel per task and batch;
    <prefix>_vsr.png: TETRIS VSR against extra draft tokens (extra 0 = standard), a line per k."""
    plt = pyplot()
    panels = list(dict.fromkeys((r["task"], r["batch"]) for r in rows if r["k"] is not None))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (task, batch) in zip(axes[0], panels):
        here = [r for r in rows if (r["task"], r["batch"]) == (task, batch) and r["k"] is not None]
        lines = {}
        for r in here:
            line = r["method"] + (f" extra={r['extra']}" if r["method"] == "tetris" else "")
            lines.setdefault(line, []).append((r["k"], r["tok_s"]))
        for line, points in lines.items():
            ks, tok_s = zip(*sorted(points))
            if line == "autoregressive":
                ax.axhline(tok_s[0], color="grey", lw=1, label=line)
            elif line == "goodput":   # k chosen per step: one value
                ax.axhline(tok_s[0], color="k", ls="--", lw=1, label=f"goodput (k <= {ks[0]})")
            else:
                ax.plot(ks, tok_s, marker="o", lw=2 if line == "speculative" else 1, label=line)
        ax.set(xlabel="k (draft tokens verified per row)", ylabel="tokens/s", title=f"{task}, batch {batch}")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{prefix}_throughput.png", dpi=110)
    plt.close(fig)

    panels = [p for p in panels if any(r["method"] == "tetris" and (r["task"], r["batch"]) == p for r in rows)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (task, batch) in zip(axes[0], panels):
        here = [r for r in rows if (r["task"], r["batch"]) == (task, batch)]
        for k in sorted({r["k"] for r in here if r["method"] == "tetris"}):
            points = sorted((r["extra"], r["vsr"]) for r in here
                            if r["k"] == k and r["method"] in ("speculative", "tetris"))
            ax.plot(*zip(*points), marker="o", label=f"k={k}")
        ax.set(xlabel="extra draft tokens per row (0 = standard)", ylabel="VSR (accepted / verified)",
               title=f"TETRIS, {task}, batch {batch}")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{prefix}_vsr.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", default=["qwen", "sonnet"], choices=["qwen", "sonnet"])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="besides autoregressive decoding (always run)")
    parser.add_argument("--tetris-ks", type=int, nargs="+", help="k of the TETRIS rows (default: --ks)")
    parser.add_argument("--extras", type=int, nargs="+", default=[1, 2, 3], help="TETRIS extra draft tokens")
    parser.add_argument("--pipeline-ks", type=int, nargs="+", help="k of the pipelined rows (default: --ks)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds over all configurations")
    parser.add_argument("--cost-model", nargs="+", default=[], metavar="FILE",
                        help="cost models to use for the goodput policy (one per pair, matched by the model "
                             "names in the file); pairs without one are profiled first")
    parser.add_argument("--profile-batches", type=int, nargs="+",
                        help="batch sizes the cost model is profiled at (default: 1, 2 and --batches' buckets)")
    parser.add_argument("--profile-cache-lens", type=int, nargs="+",
                        help="cache sizes the cost model is profiled at (default: the runs' and half of it)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--name", default="bench_speculative")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    out_dir(args).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows, costs = [], {}
    for part, run in (("sonnet", sonnet_part), ("qwen", qwen_part)):
        if part in args.part:
            part_rows, cost = run(args)
            rows += part_rows
            costs[part] = cost.to_dict() if cost is not None else None
    m = machine()
    md = "\n".join([
        f"Greedy, {args.new_tokens} new tokens per request, float32 weights dequantised from the GGUF files. "
        f"Every configuration is warmed up, then timed once per round for {args.rounds} round(s), round-robin: "
        "`tok_s` uses its median time; `vs_ar` is the median over rounds of its speed relative to "
        "autoregressive decoding within the round (this VM's speed drifts by tens of percent over minutes). "
        "`latency_p50_s` / `latency_p90_s`: seconds from the call's start until a request finished (reported "
        "by `on_finish`; the loop then returns to the host once per finished request), median and 90th "
        "percentile over the batch's requests, median over rounds; autoregressive decoding "
        "(`jaxspec.generate`) returns every request at the end of the call. TETRIS uses the standard budget "
        "C = N * k; `goodput` chooses k in 0..max k per step (`k_used`: mean over steps) from a cost model "
        "(profiled on this machine first, or --cost-model); `pipelined` alternates draft and target over two "
        "half batches on one device (at batch 1: one batch, stepped from the host). VSR = accepted / verified drafts, "
        "TER = emitted / (verified + one per row-step). "
        "`same_output`: identical to autoregressive decoding. Transformers rows (batch 1, timed once after a "
        "short warm-up): `vs_ar` against jaxspec autoregressive at batch 1, timed minutes apart. "
        f"Machine: {m['processor']}, {m['cpu_count']} cores, {m['device_kind']}, jax {m['jax']}. "
        f"Total time {time.perf_counter() - start:.0f} s.",
        "", table(rows, COLUMNS), "", f"![throughput against k]({args.name}_throughput.png)"]
        + (["", f"![TETRIS VSR]({args.name}_vsr.png)"] if "tetris" in args.methods else []))
    plot(rows, out_dir(args) / args.name)
    print("\n" + md)
    write_results(out_dir(args) / args.name, {"args": vars(args), "cost_models": costs, "rows": rows}, md)


if __name__ == "__main__":
    main()
