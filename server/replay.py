"""Replay a competition run from recorded samples: compare time-budget policies and early-stop rules
without generating again.

    python -m server.replay --eval runs/mix/eval/eval.json --variant int8_wo --runs 200

For each policy (the recipe's budget kinds: aimo2 shared buffer, aimo3 remaining-time rule, fixed) and
each early-stop rule, `--runs` simulated runs shuffle the problems; a problem's samples all start
together and finish when they did in the recording; the rule stops the problem as the solver would
(k of the first m finished agree, or n finished), the budget cuts it at its allowance, the vote is
the majority of the samples finished by then, and the unused time goes back to the run's clock.
Reported per policy and rule: expected score, its spread, and the mean time left at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from server.budget import TimeBudget
from server.metrics import majority
from server.solver import early_stop
from trtbuild.core.recipe import SolverSpec


NEVER = 10**6  # an early-stop count no problem reaches


@dataclass(frozen=True)
class Rule:
    """A named early-stop rule, as the solver's own `SolverSpec` fields."""

    name: str
    spec: SolverSpec


def parse_rule(text: str) -> Rule:
    """'4of5+10': 4 of the first 5 agree, or 10 finished; 'all': wait for every sample."""
    if text == "all":
        return Rule("all", SolverSpec(samples=NEVER, early_stop_first=NEVER, early_stop_agree=NEVER,
                                      enough_finished=NEVER))
    head, _, enough = text.partition("+")
    agree, _, first = head.partition("of")
    try:
        spec = SolverSpec(samples=NEVER, early_stop_first=int(first), early_stop_agree=int(agree),
                          enough_finished=int(enough) if enough else NEVER)
    except ValueError:
        raise ValueError(f"--rules: {text!r} is not 'AofB', 'AofB+N' or 'all'") from None
    return Rule(text, spec)


def play_problem(samples: list[tuple[Optional[int], float]], rule: Rule, allowance: float) -> tuple[Optional[int], float]:
    """(answer, seconds used) for one problem under `rule` and `allowance`: the solver's own
    early-stop rule and vote, on the recorded finish times."""
    done: list[Optional[int]] = []
    for answer, t in sorted(samples, key=lambda s: s[1]):
        if t > allowance:
            return majority(done), allowance
        done.append(answer)
        if early_stop(done, len(samples), rule.spec) not in (None, "all"):
            return majority(done), t
    return majority(done), max((t for _, t in samples), default=0.0)


def replay(problems: list[dict[str, Any]], spec: Any, rule: Rule, runs: int, seed: int = 0) -> dict[str, Any]:
    scores, lefts = [], []
    rng = random.Random(seed)
    for _ in range(runs):
        order = problems[:]
        rng.shuffle(order)
        now = [0.0]
        budget = TimeBudget(spec, len(order), clock=lambda: now[0])
        score = 0
        for p in order:
            allowance = budget.allowance()
            budget.start()
            answer, used = play_problem([(s["answer"], s["finished_at"]) for s in p["samples"]], rule, allowance)
            now[0] += used
            budget.finish()
            score += int(answer is not None and answer == p["truth"])
        scores.append(score)
        lefts.append(budget.time_left())
    return {"rule": rule.name, "expected_score": round(statistics.mean(scores), 3),
            "score_stdev": round(statistics.pstdev(scores), 3), "min_score": min(scores), "max_score": max(scores),
            "mean_time_left": round(statistics.mean(lefts), 1), "runs": runs}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.replay", description=__doc__.splitlines()[0])
    ap.add_argument("--eval", required=True, type=Path, help="eval.json from `make eval`")
    ap.add_argument("--variant", default=None, help="default: the variant the recipe serves (build.quantization)")
    ap.add_argument("--recipe", default=None, help="budget defaults from this recipe (default: the eval's)")
    ap.add_argument("--rules", default="4of5+10,3of4+8,all")
    ap.add_argument("--policies", default="aimo2,aimo3,fixed")
    ap.add_argument("--seconds-per-problem", type=float, default=None,
                    help="scale the run's total time: problems x this (default: the recipe's base_seconds)")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import dataclasses

    from trtbuild.core.recipe import load_recipe

    data = json.loads(args.eval.read_text())
    recipe = load_recipe(args.recipe or data["recipe"], check_paths=False)
    served = recipe.build.quantization if recipe.build.quantization != "bf16" else "merged"
    variant = args.variant or (served if served in data["variants"] else next(iter(data["variants"])))
    problems = [r for r in data["variants"][variant]["results"] if r["truth"] is not None]
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
            r = replay(problems, spec, parse_rule(rule), args.runs)
            rows.append({"policy": policy, **r})
    print(f"Replay of {variant} ({len(problems)} problems, {args.runs} shuffled runs each) from {args.eval}")
    print(f"{'policy':<7} {'rule':<9} {'expected score':>14} {'stdev':>6} {'min':>4} {'max':>4} {'time left s':>11}")
    for r in rows:
        print(f"{r['policy']:<7} {r['rule']:<9} {r['expected_score']:>14} {r['score_stdev']:>6} {r['min_score']:>4} "
              f"{r['max_score']:>4} {r['mean_time_left']:>11}")
    if args.out:
        args.out.write_text(json.dumps({"variant": variant, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
