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
- a problem *lost its tools* when at least `TOOL_FAULT_SHARE` of its samples had a code call lost by
  the sandbox itself (a worker killed from outside, a session that could not start: `ToolCall.fault`,
  never the code's own errors). Such samples were fed a false tool result, so the problem is solved
  again with fresh samples in the time it has left (`MIN_RETRY_SECONDS`), if the sandbox answers a
  probe cell. The result keeps every try's samples (their tokens were spent), but a sample with a
  lost code call never votes while any other sample does. The result says what
  happened (`tool_failure`, `attempts`, `tool_faults`), so every surface logs and reports it;
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

from aimo_spec.protocol import Engine
from aimo_spec.recipe import SolverSpec
from server.tir import SampleTrace, TIRClient

FINISHED = ("stop", "length")  # the finish reasons of a sample that ended on its own
CANCEL_GRACE = 30.0  # seconds a cancelled sample may take to report its end
LATE_CANCEL_GRACE = 5.0  # ... once the problem's deadline has passed (the run's answer deadline is near)
TOOL_FAULT_SHARE = 0.25  # this share of samples hit by sandbox faults: the problem lost its tools
MIN_RETRY_SECONDS = 5.0  # a retry is worth it only with this much of the problem's time left
MAX_TOOL_RETRIES = 1  # fresh tries of a problem that lost its tools (each needs a working sandbox)
PROBE_SECONDS = 10.0  # the probe cell's time limit before a retry
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
    attempts: int = 1  # tries of this problem (a retry follows a problem that lost its tools)
    tool_failure: Optional[str] = None  # why the (first) try lost its tools; None when the tools held

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

    @property
    def tool_faults(self) -> int:
        """Code calls the sandbox itself lost, over every try."""
        return sum(len(t.tool_faults) for t in self.traces)


def tool_failure(traces: Sequence[SampleTrace]) -> Optional[str]:
    """Why these samples lost their tools (see the module doc), or None when the sandbox held up."""
    hit = [t for t in traces if t.tool_faults]
    if not hit or len(hit) < TOOL_FAULT_SHARE * len(traces):
        return None
    kinds = Counter(f for t in hit for f in t.tool_faults)
    top = ", ".join(f"{k} x{n}" for k, n in kinds.most_common(3))
    return f"{len(hit)} of {len(traces)} samples had code calls lost by the sandbox ({top})"


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


def vote(traces: list[SampleTrace], method: str = "majority",
         cap: float = 4.0) -> tuple[Optional[int], dict[int, float]]:
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


def cancel_grace(deadline: Optional[float], now: float) -> float:
    """How long cancelled samples may take to report their end: CANCEL_GRACE, but no longer than the problem
    has left, and LATE_CANCEL_GRACE once its deadline has passed (an engine that ignored deadline and cancel
    cost every problem 35 s past its time, 29 minutes over a 50-problem run)."""
    if deadline is None:
        return CANCEL_GRACE
    return min(CANCEL_GRACE, max(LATE_CANCEL_GRACE, deadline - now))


class Solver:
    def __init__(self, engine: Engine, client: TIRClient, config: SolverSpec = SolverSpec(),
                 system_prompt: Optional[str] = None):
        self.engine, self.client, self.config, self.system_prompt = engine, client, config, system_prompt

    async def solve(self, problem_id: str, problem: str, deadline: Optional[float] = None,
                    expected: Optional[int] = None) -> SolveResult:
        t0 = time.monotonic()
        too_long = self._too_long(problem)
        if too_long:  # refused untokenized: tokenizing megabytes held the event loop past the problem's budget
            return self._unasked(problem_id, too_long, t0, expected)
        try:
            prompt = self.engine.chat_ids(problem, self.system_prompt)
        except Exception as e:  # noqa: BLE001 - a template that fails on this problem's text: this problem fails
            return self._unasked(problem_id, f"the chat prompt could not be made ({type(e).__name__}: "
                                             f"{str(e)[:200]})", t0, expected)
        ended, rule = await self._attempt(problem_id, problem, prompt, deadline, 0)
        attempts, lost = 1, tool_failure(ended)
        why = lost
        while why and attempts <= MAX_TOOL_RETRIES and self._time_left(deadline) >= MIN_RETRY_SECONDS:
            broken = await self._probe_sandbox(deadline)
            if broken:
                lost = f"{lost}; no retry: {broken}"
                break
            again, rule = await self._attempt(problem_id, problem, prompt, deadline, attempts)
            attempts += 1
            ended += again
            why = tool_failure(again)
        winner, weights = vote([t for t in ended if not t.tool_faults] or ended, self.config.vote,
                               self.config.weight_cap)
        return SolveResult(problem_id, self.config.default_answer if winner is None else winner, weights, rule,
                           time.monotonic() - t0, ended, expected, winner is None, attempts, lost)

    def _unasked(self, problem_id: str, why: str, t0: float, expected: Optional[int]) -> SolveResult:
        """A problem no sample could be started for: the default answer, one error trace saying why."""
        trace = SampleTrace(sample=0, seed=0, finish="error", error=why)
        return SolveResult(problem_id, self.config.default_answer, {}, "all", time.monotonic() - t0, [trace],
                           expected, True)

    def _too_long(self, problem: str) -> str:
        """Why the problem cannot fit the engine's prompt ('' when it may): more characters than
        max_input_len tokens can hold, told without tokenizing it (engines that know their limit)."""
        limit_of = getattr(self.engine, "prompt_char_limit", None)
        limit = limit_of() if callable(limit_of) else None
        if limit is None or len(problem) <= limit:
            return ""
        return (f"problem of {len(problem)} characters: more than max_input_len "
                f"{getattr(self.engine, 'max_input_len', None)} tokens can hold")

    @staticmethod
    def _time_left(deadline: Optional[float]) -> float:
        return float("inf") if deadline is None else deadline - time.monotonic()

    async def _probe_sandbox(self, deadline: Optional[float]) -> Optional[str]:
        """Why the sandbox cannot run a trivial cell now (None: it can). A stateless cell: a retry's
        samples start fresh sessions, so this is what they will meet."""
        sandbox = self.client.sandbox
        timeout = max(1.0, min(PROBE_SECONDS, self._time_left(deadline)))
        try:
            r = await sandbox.arun("print(6 * 7)", timeout)
        except Exception as e:  # noqa: BLE001 - a sandbox that raises is the answer
            return f"the sandbox probe raised {type(e).__name__}: {e}"
        if r.status != "ok" or r.stdout.text.strip() != "42":
            return f"the sandbox probe cell ended {r.status} ({r.reason or r.fault or r.stderr.text[:200]})"
        return None

    async def _attempt(self, problem_id: str, problem: str, prompt: list[int], deadline: Optional[float],
                       attempt: int) -> tuple[list[SampleTrace], str]:
        """One try: the samples (in the order they ended) and the rule that stopped them. A retry
        (`attempt` > 0) draws other seeds and numbers its samples after the earlier tries'."""
        cfg = self.config
        key = problem_id if not attempt else f"{problem_id}#{attempt + 1}"
        base_seed = zlib.crc32(f"{key}\n{problem}".encode()) % 100_000
        first = attempt * cfg.samples
        cancel = asyncio.Event()
        tasks = {asyncio.ensure_future(self.client.run(prompt, first + i, base_seed + i, deadline, cancel,
                                                       cfg.modulus)): i
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
            grace = cancel_grace(deadline, time.monotonic())
            done, stuck = await asyncio.wait(pending, timeout=grace)
            ended.extend(sorted((t.result() for t in done), key=lambda t: t.seconds))
            for task in stuck:  # the engine did not answer the cancel: drop the sample, keep going
                task.cancel()
                ended.append(SampleTrace(sample=first + tasks[task], seed=base_seed + tasks[task], finish="error",
                                         error=f"no final message {grace:.0f}s after cancel"))
        return ended, rule
