"""Replay a competition run from recorded samples: compare time-budget policies and early-stop rules
without generating again.

    python -m server.replay --eval runs/mix/eval/eval.json --variant int8_wo --runs 200

For each policy (the recipe's budget kinds: aimo2 shared buffer, aimo3 remaining-time rule, fixed) and
each early-stop rule, `--runs` simulated runs shuffle the problems; a problem's samples all start
together and finish when they did in the recording; the rule stops the problem as the solver would
(k of the first m finished agree, or n finished), the budget cuts it at its allowance, the vote is
the solver's vote (each of `--votes`: majority, entropy, local_entropy, with the recipe's weight
cap) over the samples finished by then, and the unused time goes back to the run's clock.
Reported per policy, rule and vote: expected score, its spread, and the mean time left at the end;
first, per vote, the accuracy of voting over all recorded samples (which vote wins, no budget).
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
from server.solver import early_stop, entropy_weights, tally
from aimo_spec.recipe import SolverSpec

VOTES = ("majority", "entropy", "local_entropy")
Sample = tuple[Optional[int], float, Optional[float], Optional[float]]  # answer, finished at, mean, local entropy


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


def vote_of(samples: list[Sample], method: str = "majority", cap: float = 4.0) -> Optional[int]:
    """The solver's vote (`server.solver.vote`) over recorded samples, in the order they finished."""
    if method == "majority":
        return tally([s[0] for s in samples])[0]
    voters = [s for s in samples if s[0] is not None]
    ent = [s[2] if method == "entropy" else s[3] for s in voters]
    return tally([s[0] for s in voters], entropy_weights(ent, cap))[0]


def play_problem(samples: list[Sample], rule: Rule, allowance: float, method: str = "majority",
                 cap: float = 4.0) -> tuple[Optional[int], float]:
    """(answer, seconds used) for one problem under `rule` and `allowance`: the solver's own
    early-stop rule and vote, on the recorded finish times."""
    done: list[Sample] = []
    for s in sorted(samples, key=lambda s: s[1]):
        if s[1] > allowance:
            return vote_of(done, method, cap), allowance
        done.append(s)
        if early_stop([d[0] for d in done], len(samples), rule.spec) not in (None, "all"):
            return vote_of(done, method, cap), s[1]
    return vote_of(done, method, cap), max((s[1] for s in samples), default=0.0)


def recorded(p: dict[str, Any]) -> list[Sample]:
    """A problem's recorded samples (older eval.json files have no entropies: None)."""
    return [(s["answer"], s["finished_at"], s.get("mean_entropy"), s.get("local_entropy")) for s in p["samples"]]


def vote_accuracy(problems: list[dict[str, Any]], method: str, cap: float = 4.0) -> dict[str, Any]:
    """Accuracy of `method` voting over every recorded sample of each problem (no budget, no early stop),
    and on how many problems it disagrees with the majority vote."""
    right = differs = 0
    for p in problems:
        samples = sorted(recorded(p), key=lambda s: s[1])
        answer = vote_of(samples, method, cap)
        right += int(answer is not None and answer == p["truth"])
        differs += int(answer != vote_of(samples, "majority"))
    with_entropy = sum(s[2] is not None for p in problems for s in recorded(p))
    return {"vote": method, "correct": right, "problems": len(problems),
            "accuracy": round(right / max(1, len(problems)), 4), "differs_from_majority": differs,
            "samples_with_logprobs": with_entropy}


def replay(problems: list[dict[str, Any]], spec: Any, rule: Rule, runs: int, seed: int = 0, method: str = "majority",
           cap: float = 4.0) -> dict[str, Any]:
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
            answer, used = play_problem(recorded(p), rule, allowance, method, cap)
            now[0] += used
            budget.finish()
            score += int(answer is not None and answer == p["truth"])
        scores.append(score)
        lefts.append(budget.time_left())
    return {"rule": rule.name, "vote": method, "expected_score": round(statistics.mean(scores), 3),
            "score_stdev": round(statistics.pstdev(scores), 3), "min_score": min(scores), "max_score": max(scores),
            "mean_time_left": round(statistics.mean(lefts), 1), "runs": runs}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.replay", description=__doc__.splitlines()[0])
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
        print(f"replay: --variant {variant!r} is not in {args.eval} (has: {', '.join(data['variants'])})", file=sys.stderr)
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
    print(f"{'vote':<14} {'correct':>8} {'accuracy':>9} {'differs from majority':>22} {'samples with logprobs':>22}")
    for a in accuracy:
        print(f"{a['vote']:<14} {a['correct']:>4}/{a['problems']:<3} {a['accuracy']:>9} {a['differs_from_majority']:>22} "
              f"{a['samples_with_logprobs']:>22}")
    print(f"{'policy':<7} {'rule':<9} {'vote':<14} {'expected score':>14} {'stdev':>6} {'min':>4} {'max':>4} {'time left s':>11}")
    for r in rows:
        print(f"{r['policy']:<7} {r['rule']:<9} {r['vote']:<14} {r['expected_score']:>14} {r['score_stdev']:>6} "
              f"{r['min_score']:>4} {r['max_score']:>4} {r['mean_time_left']:>11}")
    if args.out:
        args.out.write_text(json.dumps({"variant": variant, "votes": accuracy, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
