"""Goodput policy against every fixed configuration, across batch sizes.

For each batch size: autoregressive decoding, fixed k = 1..6 (standard), fixed-k TETRIS, and the
goodput policy with standard selection (k chosen per step among 0..6) and with TETRIS (drafting on
or off, then a budget C chosen per step). The cost model is profiled first on this device (and
saved next to the results); for each fixed k the measured mean step time is compared with the
cost model's prediction. Greedy outputs are checked identical to autoregressive decoding.
Writes docs/results/<name>.{json,md,png}.

    python scripts/bench_goodput.py [--batches 1 4 16 64] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import jaxspec
from jaxspec.benchmarking import RESULTS_DIR, layer_skip_pair, machine, table, timed, write_results
from jaxspec.cost import CostModel

PAIRS = {
    # name: (config, draft layers, damping, sharpness)
    "tiny-8L": (jaxspec.ModelConfig(vocab_size=2048, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=2,
                                    intermediate_size=768, max_position_embeddings=2048, tie_word_embeddings=True,
                                    name="tiny-8L"), 2, 0.06, 6.0),
    "smollm2-shape": (jaxspec.ModelConfig.preset("smollm2-135m").replace(vocab_size=8192, name="smollm2-v8k"),
                      4, 0.15, 6.0),
}


def run(label, decoder_or_none, target, ids, new_tokens, repeats, reference):
    if decoder_or_none is None:
        seconds, res = timed(lambda: jaxspec.generate(target, ids, max_new_tokens=new_tokens), repeats=repeats)
    else:
        seconds, res = timed(lambda: decoder_or_none.generate(ids, max_new_tokens=new_tokens), repeats=repeats)
    s = res.stats
    tok_s = sum(map(len, res.tokens)) / seconds
    row = {"method": label, "tok_s": tok_s, "step_ms": 1e3 * seconds / max(s.steps, 1),
           "steps": s.steps, "draft_len": s.mean_draft_length, "acceptance": s.acceptance_rate,
           "same_output": reference is None or res.tokens == reference}
    return row, res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="tiny-8L", choices=sorted(PAIRS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="bench_goodput")
    args = parser.parse_args()
    config, layers, damping, sharpness = PAIRS[args.pair]
    target, draft = layer_skip_pair(config, draft_layers=layers, damping=damping, sharpness=sharpness)
    start = time.perf_counter()
    cost = CostModel.profile(target, draft, batches=sorted({1, 2, 4, 8, 16, 32, 64} | set(args.batches)),
                             tokens_per_row=(1, 2, 4, 8), cache_lens=(64, 256), repeats=5)
    print(f"profiled in {time.perf_counter() - start:.0f} s: {cost.fit}", flush=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    cost.save(RESULTS_DIR / f"{args.name}_cost_model.json")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, int(n)).tolist() for n in rng.integers(8, 48, max(args.batches))]
    kmax = max(args.ks)
    rows = []
    for batch in args.batches:
        ids = prompts[:batch]
        ar, ar_res = run("autoregressive", None, target, ids, args.new_tokens, args.repeats, None)
        batch_rows = [ar]
        configs = [(f"fixed k={k}", jaxspec.SpecConfig(k=k)) for k in args.ks]
        configs += [(f"tetris k={k} extra=2", jaxspec.SpecConfig(k=k, extra=2, selection="tetris")) for k in (2, 4)]
        configs += [("goodput", jaxspec.SpecConfig(k=kmax, policy="goodput", cost_model=cost)),
                    ("goodput + tetris", jaxspec.SpecConfig(k=4, extra=2, selection="tetris", policy="goodput",
                                                            cost_model=cost))]
        for label, spec in configs:
            decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec)
            row, res = run(label, decoder, target, ids, args.new_tokens, args.repeats, ar_res.tokens)
            if label.startswith("fixed"):
                # cache_len as the engine computes it (prompt bucket + output bucket + window bucket)
                cache_len = (jaxspec.prompts.bucket_length(max(map(len, ids)))
                             + jaxspec.prompts.bucket_length(args.new_tokens)
                             + jaxspec.prompts.bucket_length(spec.k + 2, 8))
                predicted = cost.step_seconds(jaxspec.prompts.bucket_batch(batch), spec.k, cache_len)
                row["predicted_step_ms"] = 1e3 * predicted
                row["prediction_error"] = predicted / (row["step_ms"] / 1e3) - 1
            if label.startswith("goodput"):
                trace = res.stats.extra["k_trace"]
                row["k_used"] = f"{np.mean(trace):.2f} (0 in {np.mean(np.asarray(trace) == 0):.0%} of steps)"
            batch_rows.append(row)
        best_fixed = max(r["tok_s"] for r in batch_rows if not r["method"].startswith("goodput"))
        for row in batch_rows:
            row["batch"] = batch
            row["vs_ar"] = row["tok_s"] / ar["tok_s"]
            row["vs_best_fixed"] = row["tok_s"] / best_fixed
            print(table([row], COLUMNS), flush=True)
        rows += batch_rows
    m = machine()
    md = "\n".join([
        f"Pair `{args.pair}` (random weights; the draft is the target's first {layers} layers, deeper layers damped "
        f"by {damping}), greedy, {args.new_tokens} new tokens per request, median of {args.repeats} timed runs after "
        f"warm-up. Machine: {m['processor']}, {m['cpu_count']} cores, {m['device_kind']}, jax {m['jax']}. "
        f"Cost model profiled on this machine: target fit R^2 {cost.fit['target']['r2']:.3f} (worst held-out "
        f"error {cost.fit['target']['worst_heldout_rel_error']:.1%}), draft R^2 {cost.fit['draft']['r2']:.3f}.",
        "", table(rows, COLUMNS), "", f"![goodput]({args.name}.png)"])
    plot(rows, args.batches, RESULTS_DIR / f"{args.name}.png")
    print("\n" + md)
    write_results(args.name, {"args": vars(args), "cost_model": cost.to_dict(), "rows": rows}, md)


COLUMNS = ["batch", "method", "tok_s", "vs_ar", "vs_best_fixed", "step_ms", "predicted_step_ms", "prediction_error",
           "draft_len", "acceptance", "k_used", "same_output"]


def plot(rows, batches, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    for method in methods:
        ys = [next((r["vs_ar"] for r in rows if r["method"] == method and r["batch"] == b), np.nan) for b in batches]
        style = dict(lw=2.5, marker="o") if method.startswith("goodput") else dict(lw=1, alpha=0.6, marker=".")
        ax.plot(batches, ys, label=method, **style)
    ax.set(xscale="log", xlabel="batch size", ylabel="tokens/s relative to autoregressive",
           title="Fixed configurations and the goodput policy")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
