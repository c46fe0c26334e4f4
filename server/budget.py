"""How many seconds each problem of a run may spend, given what is left.

- aimo2 (the AIMO-2 winners' rule): every problem has `base` seconds; what a problem leaves unused
  goes into a shared buffer, and a problem may draw at most `max_extra` from it.
- aimo3: budget = min(high, max(low, time_left - low * problems_left_after_this_one)).
- fixed: `base` seconds per problem, nothing carried over.
Every policy is also capped by the time left in the whole run. The clock is injectable, so tests
and run replays simulate a 5-hour run in milliseconds.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from aimo_spec.recipe import BudgetSpec

Clock = Callable[[], float]


class TimeBudget:
    """The run's clock for one `serving.budget` section (`BudgetSpec`) over `problems` problems."""

    def __init__(self, spec: BudgetSpec, problems: int, clock: Clock = time.monotonic):
        if problems < 1:
            raise ValueError(f"budget: problems must be >= 1 (got {problems})")
        self.spec, self.problems, self.clock = spec, problems, clock
        self.policy = spec.policy
        self.total_seconds = spec.total_seconds if spec.total_seconds is not None else problems * spec.base_seconds
        self.base_seconds, self.max_extra_seconds = spec.base_seconds, spec.max_extra_seconds
        self.low_seconds, self.high_seconds = spec.low_seconds, spec.high_seconds
        self.started = clock()
        self.done = 0
        self.buffer = 0.0
        self._current: Optional[tuple[float, float]] = None  # (start, allowance) of the open problem

    def time_left(self) -> float:
        return max(0.0, self.total_seconds - (self.clock() - self.started))

    def allowance(self) -> float:
        """Seconds the next problem may use (before it starts)."""
        left = self.time_left()
        others = max(0, self.problems - self.done - 1)
        if self.policy == "aimo2":
            want = self.base_seconds + min(self.max_extra_seconds, self.buffer)
        elif self.policy == "aimo3":
            want = min(self.high_seconds, max(self.low_seconds, left - self.low_seconds * others))
        else:
            want = self.base_seconds
        return max(0.0, min(want, left))

    def start(self) -> float:
        """Open the next problem; returns its deadline on the budget's clock."""
        if self._current is not None:
            raise RuntimeError("budget: the previous problem was not finished")
        now, allowed = self.clock(), self.allowance()
        self._current = (now, allowed)
        return now + allowed

    def finish(self) -> float:
        """Close the open problem; returns the seconds it used. Unused base time feeds the buffer."""
        if self._current is None:
            raise RuntimeError("budget: no problem is open")
        start, _ = self._current
        used = self.clock() - start
        if self.policy == "aimo2":
            self.buffer = max(0.0, self.buffer + self.base_seconds - used)
        self.done += 1
        self._current = None
        return used
