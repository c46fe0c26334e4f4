"""Replay a competition run from recorded samples: compare time-budget policies and early-stop rules
without generating again (server/replay.py says how).

    python -m server.programs.replay --eval runs/mix/eval/eval.json --variant int8_wo --runs 200

Prints, per vote, the accuracy of voting over all recorded samples, then per policy, rule and vote the
expected score, its spread and the mean time left; --out writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from server.replay import VOTES, parse_rule, replay, vote_accuracy
from server.tables import format_table


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.programs.replay", description=__doc__.splitlines()[0])
    ap.add_argument("--eval", required=True, type=Path, help="eval.json from `make eval`")
    ap.add_argument("--variant", default=None, help="default: the variant the recipe serves (build.quantization)")
    ap.add_argument("--recipe", default=None, help="budget defaults from this recipe (default: the eval's)")
    ap.add_argument("--rules", default="4of5+10,3of4+8,all")
    ap.add_argument("--policies", default="aimo2,aimo3,fixed")
    ap.add_argument("--votes", default=",".join(VOTES), help="votes to compare (majority, entropy, local_entropy)")
    ap.add_argument("--seconds-per-problem", type=float, default=None,
                    help="scale the run's total time: problems x this (default: the recipe's base_seconds)")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import dataclasses

    from aimo_spec.recipe import load_recipe

    data = json.loads(args.eval.read_text())
    recipe = load_recipe(args.recipe or data["recipe"], check_paths=False)
    served = recipe.build.quantization if recipe.build.quantization != "bf16" else "merged"
    variant = args.variant or (served if served in data["variants"] else next(
        (v for v in data["variants"] if v.startswith(served + "@")), next(iter(data["variants"]))))
    if variant not in data["variants"]:
        print(f"replay: --variant {variant!r} is not in {args.eval} (has: {', '.join(data['variants'])})",
              file=sys.stderr)
        return 2
    votes = [v for v in args.votes.split(",") if v]
    bad = [v for v in votes if v not in VOTES]
    if bad:
        print(f"replay: --votes: {bad} unknown (known: {', '.join(VOTES)})", file=sys.stderr)
        return 2
    problems = [r for r in data["variants"][variant]["results"] if r["truth"] is not None]
    cap = recipe.serving.solver.weight_cap
    accuracy = [vote_accuracy(problems, v, cap) for v in votes]
    base = recipe.serving.budget
    rows = []
    for policy in args.policies.split(","):
        spec = dataclasses.replace(base, policy=policy)
        if args.seconds_per_problem:
            spec = dataclasses.replace(spec, base_seconds=args.seconds_per_problem,
                                       total_seconds=args.seconds_per_problem * len(problems),
                                       low_seconds=min(spec.low_seconds, args.seconds_per_problem),
                                       high_seconds=max(spec.high_seconds, args.seconds_per_problem))
        for rule in args.rules.split(","):
            for v in votes:
                r = replay(problems, spec, parse_rule(rule), args.runs, method=v, cap=cap)
                rows.append({"policy": policy, **r})
    print(f"Replay of {variant} ({len(problems)} problems, {args.runs} shuffled runs each) from {args.eval}")
    print(f"Votes over all recorded samples (weight cap {cap}):")
    print(format_table([{**a, "of": f"{a['correct']:>4}/{a['problems']:<3}"} for a in accuracy],
                       [("vote", "vote", "<14"), ("correct", "of", ">8"), ("accuracy", "accuracy", ">9"),
                        ("differs from majority", "differs_from_majority", ">22"),
                        ("samples with logprobs", "samples_with_logprobs", ">22")]))
    print(format_table(rows, [("policy", "policy", "<7"), ("rule", "rule", "<9"), ("vote", "vote", "<14"),
                              ("expected score", "expected_score", ">14"), ("stdev", "score_stdev", ">6"),
                              ("min", "min_score", ">4"), ("max", "max_score", ">4"),
                              ("time left s", "mean_time_left", ">11")]))
    if args.out:
        args.out.write_text(json.dumps({"variant": variant, "votes": accuracy, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
