"""A draft with another tokenizer: SmolLM2-135M-Instruct drafting for Qwen2.5-Coder 1.5B, against
the 0.5B draft of the target's own family, on the held-out code prompts of data/code_prompts.jsonl.

Part 1, speed (greedy, CPU): the target alone and each draft at each k, warmed up and timed
round-robin (`vs_target` is the median over rounds of the ratio within a round); acceptance and
identity with the target's own output. Part 2, the draft's view of the text: along the target's
greedy output, how often the SmolLM2 draft's first proposal is the target's next token when it
reads the text as jaxspec feeds it (each target token spelled in its own vocabulary, on device)
and when it reads the text re-tokenized by its own tokenizer (universal assisted generation, which
needs the host at every step). Writes docs/results/<name>.{json,md} (or into --out DIR).

`--part overhead` instead times the bridge itself: SmolLM2 drafting for itself, as a plain
`ModelDrafter` and through a `CrossVocabDrafter` whose map is the identity (same proposals, same
acceptance), so the ratio is the cost of syncing the draft's own sequence on device.

    python scripts/bench_crossvocab.py [--batches 1 4] [--ks 2 4] [--new-tokens 64] [--rounds 2]
    python scripts/bench_crossvocab.py --part overhead --rounds 3 --name bench_crossvocab_overhead
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import numpy as np
from checkout import add_out_argument, code_prompts, out_dir, qwen_files, sonnet

import jaxspec
from jaxspec.drafting.crossvocab import CrossVocabDrafter, VocabMap, token_bytes
from jaxspec.models.model import forward, init_cache
from jaxspec.tools.benchmarking import round_robin, table, write_results

COLUMNS = ["batch", "draft", "k", "tok_s", "vs_target", "acceptance", "mean_accepted", "same_output"]


def speed_rows(target, drafts, prompts, args):
    rows = []
    for batch in args.batches:
        chosen = prompts[:batch]
        fns = {("target alone", 0): lambda on_finish, p=chosen: jaxspec.generate(target, p, args.new_tokens)}
        for name, draft in drafts.items():
            for k in args.ks:
                decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=k))
                fns[(name, k)] = lambda on_finish, d=decoder, p=chosen: d.generate(p, args.new_tokens,
                                                                                   on_finish=on_finish)
        results, seconds, _ = round_robin(fns, args.rounds)
        base = seconds[("target alone", 0)]
        reference = results[("target alone", 0)].tokens
        for (name, k), result in results.items():
            stats = result.stats
            rows.append({"batch": batch, "draft": name, "k": k,
                         "tok_s": float(np.median(sum(map(len, result.tokens)) / seconds[(name, k)])),
                         "vs_target": float(np.median(base / seconds[(name, k)])),
                         "acceptance": stats.acceptance_rate if k else None,
                         "mean_accepted": stats.mean_accepted_length if k else None,
                         "same_output": result.tokens == reference})
            print(table(rows[-1:], COLUMNS), flush=True)
    return rows


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(graphdef, params, tokens_bt, last_b):
    """Logits at each row's last real position (an uncached forward; the LM head there only)."""
    cache = init_cache(graphdef, params, tokens_bt.shape[0], tokens_bt.shape[1])
    return forward(graphdef, params, tokens_bt, cache, last_b[:, None], empty=True)[0][:, 0]


def view_rows(target, draft, vocab_map: VocabMap, prompts, outputs):
    """First-proposal agreement along the target's output, by how the draft reads the text."""
    shared = vocab_map.to_target_w >= 0
    hits = {"spelled per target token (jaxspec)": [], "re-tokenized text (host, every step)": []}
    for prompt, out in zip(prompts, outputs):
        spelled_ctx, retok_ctx, nexts = [], [], []
        for i in range(len(out) - 1):
            ids = prompt + out[:i + 1]
            spelled_ctx.append([int(d) for t in ids for d in vocab_map.expand_vm[t, :vocab_map.expand_len_v[t]]])
            retok_ctx.append(draft.tokenizer(target.tokenizer.decode(ids), add_special_tokens=False)["input_ids"])
            nexts.append(out[i + 1])
        for label, contexts in zip(hits, (spelled_ctx, retok_ctx)):
            width = -(-max(map(len, contexts)) // 64) * 64
            batch = np.zeros((len(contexts), width), np.int32)
            last = np.asarray([len(c) - 1 for c in contexts], np.int32)
            for r, c in enumerate(contexts):
                batch[r, :len(c)] = c
            logits = np.asarray(_last_logits(draft.graphdef, draft.params, batch, last))
            proposal = vocab_map.to_target_w[np.argmax(np.where(shared, logits, -np.inf), axis=-1)]
            hits[label] += list(proposal == np.asarray(nexts))
    return [{"draft reads": label, "first proposal = target's next token": float(np.mean(v)), "positions": len(v)}
            for label, v in hits.items()]


def overhead_rows(args):
    model = jaxspec.load(jaxspec.example_model("smollm2-135m"))
    pieces = token_bytes(model.tokenizer, model.config.vocab_size)
    bridge = CrossVocabDrafter(model, VocabMap(pieces, pieces))
    text = sonnet()
    prompts = [model.tokenizer(text[i * 40:])["input_ids"][:48] for i in range(4)]
    rows = []
    for batch in args.batches:
        fns = {}
        for k in args.ks:
            for name, draft in (("ModelDrafter", model), ("CrossVocabDrafter, identity map", bridge)):
                decoder = jaxspec.SpeculativeDecoder(model, draft, spec=jaxspec.SpecConfig(k=k))
                fns[(name, k)] = lambda on_finish, d=decoder, p=prompts[:batch]: d.generate(p, args.new_tokens)
        results, seconds, _ = round_robin(fns, args.rounds)
        for k in args.ks:
            plain, bridged = ("ModelDrafter", k), ("CrossVocabDrafter, identity map", k)
            rows.append({"batch": batch, "k": k, "bridge_over_plain_time": float(np.median(seconds[bridged] /
                                                                                         seconds[plain])),
                         "acceptance": results[bridged].stats.acceptance_rate,
                         "same_output": results[bridged].tokens == results[plain].tokens})
            print(table(rows[-1:]), flush=True)
    note = (f"SmolLM2-135M drafting for itself, float32, greedy, {args.new_tokens} new tokens, sonnet prompts, "
            f"{args.rounds} rounds: time through the bridge over time as a plain draft model (median of per-round "
            f"ratios).")
    write_results(out_dir(args) / args.name, {"note": note, "rows": rows},
                  f"# {args.name}\n\n{note}\n\n`python scripts/bench_crossvocab.py --part overhead`\n\n{table(rows)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["pairs", "overhead"], default="pairs")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="bench_crossvocab")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.part == "overhead":
        return overhead_rows(args)
    target, same_family = map(jaxspec.load, qwen_files())
    drafts = {"qwen2.5-coder-0.5b (same tokenizer)": same_family,
              "smollm2-135m (other tokenizer)": jaxspec.load(jaxspec.example_model("smollm2-135m"))}
    smol = drafts["smollm2-135m (other tokenizer)"]
    start = time.perf_counter()
    vocab_map = VocabMap.from_tokenizers(smol.tokenizer, smol.config.vocab_size, target.tokenizer,
                                         target.config.vocab_size)
    map_seconds = time.perf_counter() - start
    prompts = code_prompts(target.tokenizer)
    rows = speed_rows(target, drafts, prompts, args)
    outputs = jaxspec.generate(target, prompts, args.new_tokens).tokens
    views = view_rows(target, smol, vocab_map, prompts, outputs)
    print(table(views), flush=True)
    note = (f"Qwen2.5-Coder 1.5B target (float32, from its Q4_K_M GGUF), greedy, {args.new_tokens} new tokens, "
            f"{len(prompts)} code prompts (the first `batch` at each batch size), {args.rounds} timed rounds. "
            f"SmolLM2's vocabulary shares {vocab_map.shared} of its {smol.config.vocab_size} tokens with "
            f"Qwen's {target.config.vocab_size}; the tables took {map_seconds:.1f} s to build.")
    markdown = (f"# {args.name}\n\n{note}\n\n`python scripts/bench_crossvocab.py`\n\n{table(rows, COLUMNS)}\n\n"
                f"How the SmolLM2 draft reads the text (along the target's output on all prompts):\n\n{table(views)}")
    write_results(out_dir(args) / args.name,
                  {"note": note, "rows": rows, "views": views, "shared_tokens": vocab_map.shared}, markdown)


if __name__ == "__main__":
    main()
