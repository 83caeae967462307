"""The goodput policy in the deterministic simulator (`jaxspec.tools.policy_sim`), against the best
fixed draft length in hindsight and against plain decoding, each of its rules switched off, and the policy
decoding in segments of S = 1, 2, 4, 8 steps that choose only at their ends (`Rules.segment`), with its choice
running from the next segment (lag 0) or the one after (lag 1), against the policy choosing every step.

Scenarios: two machines (`policy_sim.machine_cost`: "gpu", memory-bound steps; "cpu", a 4-token
verification costing two plain steps), batch 1 / 4 / 16 / 64, a draft position costing 0.02 / 0.1
/ 0.5 of a batch-1 target step, and acceptance constant (0.3, 0.6, 0.8, 0.95), drifting mid-run
(0.9 -> 0.3, 0.3 -> 0.9), falling along the window (0.95 * 0.85^j) or differing between rows
(half at 0.9, half at 0.3); plus cost models the policy believes wrong (drafting 3x cheaper or
dearer than it is). 128 tokens a row, plans k = 0..6, a change of plan costs 0.1 of a plain
step, four texts per scenario. Writes docs/results/policy_sim.{md,json} (or --out DIR, --name NAME).

    python scripts/policy_sim.py [--quick] [--cost-model FILE --batches 1 4 --max-k 8 --name NAME]

--cost-model: the same acceptance scenarios on one machine's profiled cost model (seconds; a change of plan
costs 0.1 of a plain step there).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from checkout import add_out_argument, out_dir

from jaxspec.policy import goodput as policy
from jaxspec.policy.cost import CostModel
from jaxspec.tools import policy_sim as ps
from jaxspec.tools.benchmarking import table, write_results

ACCEPTANCE = {"0.3": dict(alphas=(0.3,)), "0.6": dict(alphas=(0.6,)), "0.8": dict(alphas=(0.8,)),
              "0.95": dict(alphas=(0.95,)), "0.9->0.3": dict(alphas=(0.9,), drift=(0.5, (0.3,))),
              "0.3->0.9": dict(alphas=(0.3,), drift=(0.5, (0.9,))), "falling": dict(alphas=(0.95,), falloff=0.85),
              "rows 0.9/0.3": dict(alphas=(0.9, 0.3))}
RULES = {"policy": ps.Rules(), "no hysteresis": ps.Rules(margin=0.0), "no probing": ps.Rules(off_decay=1.0),
         "one rate per batch": ps.Rules(per_row=False), "geometric (no per-slot rates)": ps.Rules(per_slot=False),
         "choose every 4 drafting steps": ps.Rules(draft_chunk=policy.CHOOSE_EVERY),
         "no drain rule": ps.Rules(drain=False), "no catch-up cost": ps.Rules(catch_up=False),
         "neutral prior 0.6": ps.Rules(prior=0.6)}
SEGMENTS = {f"S={s} lag {lag}": ps.Rules(segment=s, lag=lag) for lag in (0, 1) for s in (1, 2, 4, 8)}


def profiled_scenarios(path: str, batches):
    """The acceptance scenarios on a machine's own profiled cost model (`jaxspec profile`), in seconds."""
    cost = CostModel.load(path)
    for batch in batches:
        for name, acceptance in ACCEPTANCE.items():
            yield ps.Scenario(name=f"profiled acc {name}", batch=batch, cost=cost,
                              round_trip=0.1 * cost.step_seconds(batch, 0), **acceptance)


def scenarios(quick: bool):
    batches, ratios = ((1, 16), (0.1,)) if quick else ((1, 4, 16, 64), (0.02, 0.1, 0.5))
    for machine in ("gpu", "cpu"):
        for ratio in ratios:
            for batch in batches:
                for name, acceptance in ACCEPTANCE.items():
                    yield ps.Scenario(name=f"{machine} draft {ratio} acc {name}", batch=batch,
                                      cost=ps.machine_cost(machine, ratio), round_trip=0.1, **acceptance)
        for factor, label in ((3.0, "3x dearer"), (1 / 3, "3x cheaper")):
            for batch in batches:
                true = ps.machine_cost(machine, 0.1)
                believed = CostModel.from_coefficients(**{**_coefficients(true),
                                                          "draft_fixed": true.draft_fixed / factor,
                                                          "draft_per_token": true.draft_per_token / factor})
                yield ps.Scenario(name=f"{machine} draft 0.1 acc 0.8, drafting {label} than believed", batch=batch,
                                  cost=true, believed=believed, round_trip=0.1, alphas=(0.8,))


def _coefficients(cost: CostModel) -> dict:
    return {f.name: getattr(cost, f.name) for f in dataclasses.fields(cost)
            if f.name in ("draft_fixed", "draft_per_token", "target_fixed", "target_per_token")}


def _rule_row(label: str, mine: list[dict], policy_rows: list[dict]) -> dict:
    """One row of the rules table: `mine` against the full policy, scenario by scenario."""
    gain = [p["vs_best"] - m["vs_best"] for p, m in zip(policy_rows, mine)]
    return {"rules": label, "worst_vs_best": min(r["vs_best"] for r in mine),
            "mean_vs_best": float(np.mean([r["vs_best"] for r in mine])),
            "worst_vs_plain_where_plain_best": min((r["vs_plain"] for r in mine if r["plain_is_best"]),
                                                   default=float("nan")),
            "below_0.97_of_best": sum(r["vs_best"] < 0.97 for r in mine),
            "policy_gains_over_2pct_in": sum(g > 0.02 for g in gain),
            "policy_largest_gain": max(gain), "policy_largest_loss": -min(gain)}


def _fixed_in_segments(s: ps.Scenario, plans, seeds: int) -> dict:
    """The best fixed plan's tokens per second decoding in segments of S steps over its own without segments
    (the masked tail's cost alone), per S in SEGMENTS."""
    def rate(j, segment):
        runs = [ps.simulate(s, plans, fixed=j, rules=ps.Rules(segment=segment), seed=seed) for seed in range(seeds)]
        return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)

    rates = [rate(j, 0) for j in range(len(plans))]
    best = int(np.argmax(rates))
    return {segment: rate(best, segment) / rates[best] for segment in sorted({r.segment for r in SEGMENTS.values()})}


def _segment_row(label: str, mine: list[dict], policy_rows: list[dict], tails: list[dict]) -> dict:
    """One row of the segments table: `mine` against the policy choosing every step, scenario by scenario;
    `tails`: `_fixed_in_segments` of each scenario."""
    loss = [p["vs_best"] - m["vs_best"] for p, m in zip(policy_rows, mine, strict=True)]
    segment = SEGMENTS[label].segment if label in SEGMENTS else 0
    return {"rules": label, "best_fixed_in_segments": float(np.mean([t.get(segment, 1.0) for t in tails])),
            "worst_vs_best": min(r["vs_best"] for r in mine),
            "mean_vs_best": float(np.mean([r["vs_best"] for r in mine])),
            "below_0.97_of_best": sum(r["vs_best"] < 0.97 for r in mine),
            "mean_loss_vs_policy": float(np.mean(loss)), "largest_loss_vs_policy": max(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few scenarios (a smoke run)")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--cost-model", metavar="FILE",
                        help="a profiled CostModel JSON: its scenarios instead of the two model machines")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="with --cost-model")
    parser.add_argument("--max-k", type=int, default=6, help="plans k = 0..max-k")
    parser.add_argument("--name", default="policy_sim")
    add_out_argument(parser)
    args = parser.parse_args()
    plans = tuple((k, None) for k in range(args.max_k + 1))
    start = time.perf_counter()
    rows = []
    tails = []
    for s in (profiled_scenarios(args.cost_model, args.batches) if args.cost_model else scenarios(args.quick)):
        if s.believed is None:
            tails.append(_fixed_in_segments(s, plans, args.seeds))
        everything = {**RULES, **SEGMENTS}
        for label, result in zip(everything, ps.compare(s, plans, tuple(everything.values()), seeds=args.seeds)):
            rows.append({"rules": label, **result})
    core = [r for r in rows if "believed" not in r["scenario"]]
    policy_rows = [r for r in core if r["rules"] == "policy"]
    misses = [r for r in policy_rows if r["vs_best"] < 0.97 or (r["plain_is_best"] and r["vs_plain"] < 0.99)]
    summary = [_rule_row(label, [r for r in core if r["rules"] == label], policy_rows) for label in RULES]
    segments = [_segment_row(label, [r for r in core if r["rules"] == label], policy_rows, tails)
                for label in ("policy", *SEGMENTS)]
    wrong = [r for r in rows if "believed" in r["scenario"] and r["rules"] == "policy"]
    columns = ["scenario", "batch", "best_fixed", "best_vs_plain", "vs_best", "vs_plain", "most_run", "switches"]
    md = "\n".join([
        f"# Goodput policy in the simulator ({len(policy_rows)} scenarios, {args.seeds} texts each)", "",
        "Written by `make policy-sim` (`scripts/policy_sim.py`): deterministic, the clock is a cost model "
        "(`jaxspec.tools.policy_sim`), no timing. `vs_best`: the policy's tokens per simulated second over the best "
        f"fixed draft length's in hindsight (k = 0..{args.max_k}, the same texts); `vs_plain`: over plain "
        "decoding's. Goals: "
        "`vs_best` >= 0.97 everywhere, `vs_plain` >= 0.99 where plain decoding is best.", "",
        "## Each rule switched off", "",
        "`policy_gains_over_2pct_in`: scenarios where the policy with every rule beats this variant by more than "
        "2% of the best fixed plan (a rule is kept only where that is at least one); `policy_largest_loss`: the "
        "most the full policy trails the variant on one scenario.", "",
        table(summary), "",
        f"## Scenarios below the goals ({len(misses)} of {len(policy_rows)})", "",
        table(misses, columns) if misses else "none", "",
        "## Segments", "",
        "Decoding in segments of S steps of one plan (`Rules.segment`): a row finished inside a segment is "
        "masked, the last segment runs to its end after the batch is done, and the policy chooses only at a "
        "segment's end; with lag 1 its choice runs a segment later (the host dispatched the next segment "
        "already). Against the same best fixed plan as above (which stops at the step that finishes the "
        "batch); `best_fixed_in_segments`: the best fixed plan's own rate in segments of S over its rate "
        "without (the masked tail's cost alone, mean over the scenarios); `mean_loss_vs_policy` and "
        "`largest_loss_vs_policy`: the policy choosing every step's `vs_best` minus this one's, mean and "
        "largest over the scenarios (negative: a gain).", "",
        table(segments), "",
        "## A cost model that is wrong about the drafter", "",
        "Not among the goals: the policy trusts its profiled cost model, and a profile 3x off in the draft's "
        "cost makes it choose draft lengths for the wrong machine (the remedy is profiling on the machine that "
        "decodes: `jaxspec profile`).", "", table(wrong, columns) if wrong else "none", "",
        "## Every scenario (the full policy)", "", table(policy_rows, columns)])
    write_results(out_dir(args) / args.name, {"args": vars(args), "summary": summary, "segments": segments,
                                              "rows": rows,
                              "seconds": time.perf_counter() - start}, md)
    print(table(summary))
    print(f"{len(misses)} of {len(policy_rows)} scenarios below the goals; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
