"""What the goodput policy's per-step `lax.switch` costs when it always picks plain decoding.

Times, round-robin after warm-up (median of --rounds), at one batch size: `jaxspec.generate`
(autoregressive), the speculative engine with fixed k = 0, and the goodput policy with a cost model
under which drafting never pays (so every step runs its k = 0 branch) for standard selection
(k + 1 branches) and TETRIS (2 branches). Any gap between the last two and fixed k = 0 is the
price of choosing on device among compiled branches. Writes docs/results/switch_overhead.{json,md}.

    python scripts/switch_overhead.py [--batch 64] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import jaxspec
from jaxspec.benchmarking import build_pair, prompt_sets, table, write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    target, draft, _ = build_pair("tiny-8L")
    config = target.config
    prompts = prompt_sets(config.vocab_size, args.batch, 1)[0]
    never = jaxspec.CostModel.from_coefficients(draft_fixed=1.0, draft_per_token=0.0, target_fixed=1e-3,
                                                target_per_token=1e-5)
    specs = {"autoregressive (jaxspec.generate)": None, "engine, fixed k=0": jaxspec.SpecConfig(k=0),
             "goodput, 7 branches, always k=0": jaxspec.SpecConfig(k=6, policy="goodput", cost_model=never),
             "goodput + tetris, 2 branches, always k=0": jaxspec.SpecConfig(k=4, extra=2, selection="tetris",
                                                                            policy="goodput", cost_model=never)}

    def fn(spec):
        if spec is None:
            return lambda: jaxspec.generate(target, prompts, max_new_tokens=args.new_tokens)
        decoder = jaxspec.SpeculativeDecoder(target, draft, spec=spec)
        return lambda: decoder.generate(prompts, max_new_tokens=args.new_tokens)

    fns = {label: fn(spec) for label, spec in specs.items()}
    outputs = {label: f() for label, f in fns.items()}
    seconds = {label: [] for label in fns}
    for _ in range(args.rounds):
        for label, f in fns.items():
            start = time.perf_counter()
            outputs[label] = f()
            seconds[label].append(time.perf_counter() - start)
    base = np.asarray(seconds["engine, fixed k=0"])
    reference = outputs["autoregressive (jaxspec.generate)"].tokens
    rows = [{"method": label, "ms": 1e3 * float(np.median(s)), "vs_fixed_k0": float(np.median(np.asarray(s) / base)),
             "same_output": outputs[label].tokens == reference,
             "k_used": sorted(set(outputs[label].stats.extra.get("k_trace", [0])))}
            for label, s in seconds.items()]
    md = (f"Batch {args.batch}, {args.new_tokens} new tokens, pair tiny-8L, median of {args.rounds} round-robin "
          "runs after warm-up (`vs_fixed_k0`: median of within-round ratios).\n\n" + table(rows))
    print(md)
    write_results("switch_overhead", {"args": vars(args), "rows": rows}, md)


if __name__ == "__main__":
    main()
