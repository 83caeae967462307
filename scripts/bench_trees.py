"""Draft trees against chains at equal verification budgets (greedy, CPU or GPU).

Every configuration verifies k draft tokens per row per step on average: a chain of k drafts
(standard), a TETRIS chain (k + extra drafts per row, the batch's N * k best verified), a tree of
depth D and width W with each row's k best nodes verified, and the same tree with the batch's
N * k best nodes. Per batch size: tokens emitted per row and target pass, accepted drafts per
verified draft (VSR), tokens/s against autoregressive decoding (median of per-round ratios,
round-robin after warm-up), and identity with autoregressive output. Writes
docs/results/<name>.{json,md} and <name>.png (tokens per target pass by batch), or into --out DIR.

    python scripts/bench_trees.py [--pair qwen|tiny] [--draft model|eagle] [--batches 1 4 16] [--k 4]
                                  [--tree 4 2] [--rounds 2]

`--draft eagle` drafts with the EAGLE-3 head trained for the Qwen target (models/qwen-eagle3,
`make train-eagle-qwen`) instead of the 0.5B model.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from checkout import MODELS, QWEN, QWEN_DRAFT, add_out_argument, code_prompts, out_dir, pyplot

import jaxspec
from jaxspec.tools.benchmarking import layer_skip_pair, round_robin, table, write_results

COLUMNS = ["batch", "method", "tokens_per_pass", "vsr", "verified_per_row", "tok_s", "vs_ar", "same_output"]


def load_pair(name: str, draft_kind: str = "model"):
    if name == "tiny":
        target, draft = layer_skip_pair(jaxspec.ModelConfig.preset("tiny").replace(num_layers=8), draft_layers=2,
                                        damping=0.05)
        return target, draft, [list(np.random.default_rng(i).integers(0, 256, 24)) for i in range(16)]
    target = jaxspec.load(QWEN)
    draft = (jaxspec.EagleDrafter(jaxspec.load(MODELS / "qwen-eagle3", target=target)) if draft_kind == "eagle"
             else jaxspec.load(QWEN_DRAFT))
    return target, draft, (code_prompts(target.tokenizer) * 2)[:16]


def configurations(k: int, tree: tuple[int, int], extra: int):
    return {"chain": jaxspec.SpecConfig(k=k),
            f"chain TETRIS (+{extra})": jaxspec.SpecConfig(k=k, extra=extra, selection="tetris"),
            f"tree {tree[0]}x{tree[1]}, per row": jaxspec.SpecConfig(k=k, tree=tree),
            f"tree {tree[0]}x{tree[1]}, batch budget": jaxspec.SpecConfig(k=k, tree=tree, selection="tetris")}


def run(args):
    target, draft, prompts = load_pair(args.pair, args.draft)
    rows = []
    for batch in args.batches:
        chosen = [list(map(int, p)) for p in prompts[:batch]]
        fns = {"autoregressive": lambda on_finish, p=chosen: jaxspec.generate(target, p, args.new_tokens)}
        for name, spec in configurations(args.k, tuple(args.tree), args.extra).items():
            decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec)
            fns[name] = lambda on_finish, d=decoder, p=chosen: d.generate(p, args.new_tokens)
        results, seconds, _ = round_robin(fns, args.rounds)
        reference = results["autoregressive"].tokens
        for name, result in results.items():
            s = result.stats
            rows.append({"batch": batch, "method": name,
                         "tokens_per_pass": s.mean_accepted_length if name != "autoregressive" else 1.0,
                         "vsr": s.vsr if name != "autoregressive" else None,
                         "verified_per_row": s.mean_draft_length if name != "autoregressive" else 0.0,
                         "tok_s": float(np.median(s.new_tokens / seconds[name])),
                         "vs_ar": float(np.median(seconds["autoregressive"] / seconds[name])),
                         "same_output": result.tokens == reference})
            print(table(rows[-1:], COLUMNS), flush=True)
    return rows


def plot(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "autoregressive"):
        mine = [r for r in rows if r["method"] == method]
        ax.plot([r["batch"] for r in mine], [r["tokens_per_pass"] for r in mine], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("tokens per row and target pass")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=["qwen", "tiny"], default="qwen")
    parser.add_argument("--draft", choices=["model", "eagle"], default="model", help="qwen pair: the draft")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--k", type=int, default=4, help="draft tokens verified per row per step (all methods)")
    parser.add_argument("--tree", type=int, nargs=2, default=[4, 2], metavar=("DEPTH", "WIDTH"))
    parser.add_argument("--extra", type=int, default=2, help="TETRIS chain: extra drafts per row")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default=None)
    add_out_argument(parser)
    args = parser.parse_args()
    name = args.name or f"bench_trees_{args.pair}" + ("_eagle" if args.draft == "eagle" else "")
    rows = run(args)
    note = (f"Pair `{args.pair}` ({args.draft} draft), greedy, {args.new_tokens} new tokens, k = {args.k} verified "
            f"per row per step (TETRIS and batch budgets: N * k), {args.rounds} rounds round-robin.")
    write_results(out_dir(args) / name, {"note": note, "rows": rows, "args": vars(args)},
                  f"# {name}\n\n{note}\n\n`python scripts/bench_trees.py {' '.join(sys.argv[1:])}`\n\n"
                  f"{table(rows, COLUMNS)}")
    plot(rows, out_dir(args) / f"{name}.png")


if __name__ == "__main__":
    main()
