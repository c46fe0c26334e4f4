"""One problem: N TIR samples at once, early stop when answers agree, cancel the rest, vote.

Rules (defaults are the AIMO-2 winners'):
- a sample *finishes* when it ends on its own (end of sequence, max tokens); cancelled and timed-out
  samples do not count as finished;
- early stop: when `agree` of the first `first` finished samples have the same answer (checked as
  each of those first samples finishes), or when `enough` samples have finished, or at the deadline;
  the others are then cancelled (their final messages are awaited, so nothing leaks into the next
  problem);
- vote over every sample with an integer answer, a cut-off one included: `majority` counts votes,
  `entropy` weights each by 1 / its mean token entropy (top-k logprobs; confident samples count
  more), `local_entropy` by 1 / the mean entropy of the tokens that end at its boxed answer (the
  AIMO-3 runner-up's weighting: how sure the sample was when it wrote the answer). Ties go to the
  answer whose first vote came first. No answer at all: `default_answer`.
- entropy weights resist degenerate samples: a repetition loop is very confident (entropy ~1e-5),
  so no weight may exceed `weight_cap` x the median weight of the problem's samples; a sample
  without logprobs weighs that median (not 1.0 against confident samples' 20).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from server.protocol import Engine
from server.tir import SampleTrace, TIRClient
from trtbuild.core.recipe import SolverSpec

FINISHED = ("stop", "length")  # the finish reasons of a sample that ended on its own
CANCEL_GRACE = 30.0  # seconds a cancelled sample may take to report its end
MIN_ENTROPY = 1e-3  # a sample with ~0 entropy gets weight 1000, not infinity


@dataclass
class SolveResult:
    problem_id: str
    answer: int
    votes: dict[int, float]
    stop_rule: str  # agree | enough | all | deadline
    seconds: float
    traces: list[SampleTrace] = field(default_factory=list)
    expected: Optional[int] = None
    default_used: bool = False

    @property
    def correct(self) -> Optional[bool]:
        return None if self.expected is None else self.answer == self.expected

    @property
    def finished(self) -> int:
        return sum(t.finish in FINISHED for t in self.traces)

    @property
    def cancelled(self) -> int:
        return sum(t.finish == "cancelled" for t in self.traces)

    @property
    def code_calls(self) -> int:
        return sum(len(t.code_calls) for t in self.traces)

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.traces)


def tally(answers: Sequence[Optional[int]], weights: Optional[Sequence[float]] = None
          ) -> tuple[Optional[int], dict[int, float]]:
    """(winner, total weight per answer) over answers in the order they ended; None answers cast no
    vote, each other answer weighs 1 unless `weights` says otherwise; a tie goes to the answer whose
    first vote came first. The one vote rule: the solver, the metrics and the replay all use it."""
    totals: dict[int, float] = {}
    first_seen: dict[int, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        totals[a] = totals.get(a, 0.0) + (1.0 if weights is None else weights[i])
        first_seen.setdefault(a, i)
    if not totals:
        return None, {}
    return min(totals, key=lambda a: (-totals[a], first_seen[a])), totals


def entropy_weights(entropies: Sequence[Optional[float]], cap: float = 4.0) -> list[float]:
    """1 / entropy per sample, each at most `cap` x the median weight of those with an entropy; a
    sample without one (None) weighs that median. No entropy at all: every sample weighs 1."""
    raw = [None if e is None else 1.0 / max(e, MIN_ENTROPY) for e in entropies]
    known = [w for w in raw if w is not None]
    if not known:
        return [1.0] * len(raw)
    median = statistics.median(known)
    return [median if w is None else min(w, cap * median) for w in raw]


def sample_entropy(trace: SampleTrace, method: str) -> Optional[float]:
    """The entropy a vote method weights a sample by: mean over all its tokens, or near its answer."""
    return trace.local_entropy if method == "local_entropy" else trace.mean_entropy


def vote(traces: list[SampleTrace], method: str = "majority", cap: float = 4.0) -> tuple[Optional[int], dict[int, float]]:
    """(winner, weight per answer); traces in the order they ended (the tie rule uses it). Only
    samples with an answer enter the weights' median."""
    if method == "majority":
        return tally([t.answer for t in traces])
    voters = [t for t in traces if t.answer is not None]
    return tally([t.answer for t in voters], entropy_weights([sample_entropy(t, method) for t in voters], cap))


def early_stop(finished_answers: list[Optional[int]], n_samples: int, cfg: SolverSpec) -> Optional[str]:
    """The rule that ends the problem now, given answers of finished samples in finish order."""
    n = len(finished_answers)
    if n <= cfg.early_stop_first:
        counts = Counter(a for a in finished_answers if a is not None)
        if counts and counts.most_common(1)[0][1] >= cfg.early_stop_agree:
            return "agree"
    if n >= cfg.enough_finished:
        return "enough"
    if n >= n_samples:
        return "all"
    return None


def with_samples(spec: SolverSpec, samples: int) -> SolverSpec:
    """`spec` for another sample count (the early-stop counts capped by it)."""
    return replace(spec, samples=samples, early_stop_first=min(spec.early_stop_first, samples),
                   early_stop_agree=min(spec.early_stop_agree, samples),
                   enough_finished=min(spec.enough_finished, samples))


class Solver:
    def __init__(self, engine: Engine, client: TIRClient, config: SolverSpec = SolverSpec(),
                 system_prompt: Optional[str] = None):
        self.engine, self.client, self.config, self.system_prompt = engine, client, config, system_prompt

    async def solve(self, problem_id: str, problem: str, deadline: Optional[float] = None,
                    expected: Optional[int] = None) -> SolveResult:
        cfg = self.config
        t0 = time.monotonic()
        prompt = self.engine.tokenize(self.engine.chat_prompt(problem, self.system_prompt))
        base_seed = zlib.crc32(f"{problem_id}\n{problem}".encode()) % 100_000
        cancel = asyncio.Event()
        tasks = {asyncio.ensure_future(self.client.run(prompt, i, base_seed + i, deadline, cancel, cfg.modulus)): i
                 for i in range(cfg.samples)}
        ended: list[SampleTrace] = []
        finished_answers: list[Optional[int]] = []
        rule = "all"
        pending = set(tasks)
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic()) + 5.0
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:  # the engine did not honour the deadline: cancel everything
                rule = "deadline"
                break
            for task in sorted(done, key=lambda t: t.result().seconds):
                trace = task.result()
                ended.append(trace)
                if trace.finish in FINISHED:
                    finished_answers.append(trace.answer)
                elif trace.finish == "timeout":
                    rule = "deadline"
            hit = early_stop(finished_answers, cfg.samples, cfg)
            if hit and pending:
                rule = hit
                break
            if hit:
                rule = hit
        if pending:
            cancel.set()
            done, stuck = await asyncio.wait(pending, timeout=CANCEL_GRACE)
            ended.extend(sorted((t.result() for t in done), key=lambda t: t.seconds))
            for task in stuck:  # the engine did not answer the cancel: drop the sample, keep going
                task.cancel()
                ended.append(SampleTrace(sample=tasks[task], seed=base_seed + tasks[task], finish="error",
                                         error=f"no final message {CANCEL_GRACE:.0f}s after cancel"))
        winner, weights = vote(ended, cfg.vote, cfg.weight_cap)
        return SolveResult(problem_id, cfg.default_answer if winner is None else winner, weights, rule,
                           time.monotonic() - t0, ended, expected, winner is None)
