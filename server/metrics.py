"""Accuracy from recorded samples, computed exactly: maj@k and pass@k over all k-subsets, and accuracy
under a wall-clock budget. Pure Python, so reports and replays need no model."""

from __future__ import annotations

import itertools
import math
from typing import Optional, Sequence

from server.solver import tally


def majority(answers: Sequence[Optional[int]]) -> Optional[int]:
    """The solver's majority vote (`server.solver.tally`) over answers in the order they ended."""
    return tally(answers)[0]


def maj_at_k(answers: Sequence[Optional[int]], truth: int, k: int) -> float:
    """P(the majority of k samples drawn without replacement is right), over every k-subset (in order)."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n} (got {k})")
    total = math.comb(n, k)
    if total > 200_000:
        raise ValueError(f"C({n}, {k}) = {total} subsets: too many to enumerate exactly")
    hits = sum(majority([answers[i] for i in idx]) == truth for idx in itertools.combinations(range(n), k))
    return hits / total


def pass_at_k(answers: Sequence[Optional[int]], truth: int, k: int) -> float:
    """P(at least one of k samples is right): 1 - C(n - c, k) / C(n, k), exact."""
    n, c = len(answers), sum(a == truth for a in answers)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def accuracy_at_budget(samples: Sequence[tuple[Optional[int], float]], truth: int, seconds: float) -> bool:
    """With all samples launched together, is the majority of those finished by `seconds` right?"""
    return majority([a for a, t in sorted(samples, key=lambda s: s[1]) if t <= seconds]) == truth
