"""Replay a competition run from recorded samples: compare time-budget policies and early-stop rules
without generating again (the program: server/programs/replay.py).

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

import random
import statistics
from dataclasses import dataclass
from typing import Any, Optional

from aimo_spec.recipe import SolverSpec
from server.budget import TimeBudget
from server.solver import early_stop, entropy_weights, tally

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
