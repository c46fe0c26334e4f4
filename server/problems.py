"""A run over many problems: the time budget, the solver, progress, and the whole-run figures."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from server.budget import TimeBudget
from server.solver import Solver, SolveResult


@dataclass(frozen=True)
class Problem:
    id: str
    text: str
    answer: Optional[int] = None


def read_csv_text(path: str | Path) -> str:
    """A CSV file's text: UTF-8, a leading byte-order mark dropped (spreadsheets write one, and it would
    hide the first column's name); other bytes are an error naming the file, line and byte."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such problems file")
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                         "save the file as UTF-8") from None


def csv_rows(text: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """The header and each record after it with the line it starts on, as Kaggle's gateway sees the file:
    blank lines before the header are skipped (polars skips them too) but blank rows after it are kept,
    because polars.read_csv, which the gateway uses, reads each one as a row of nulls (csv.DictReader
    would skip them silently). Fields may be of any size (the real gateway reads a 1 MB problem)."""
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))
    # strict: a quote left open no longer swallows the rest of the file into one field (later rows vanished)
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: list[str] = []
    rows: list[tuple[int, list[str]]] = []
    line = 0  # the last line read so far: a record starts on the line after it
    try:
        for fields in reader:
            if header:
                rows.append((line + 1, fields))
            else:
                header = fields  # [] while the lines are blank
            line = reader.line_num
    except csv.Error as e:
        raise ValueError(f"line {line + 1}: not valid CSV ({e}; a quote left open, or one inside an unquoted "
                         "field): quote a field that holds commas, quotes or line breaks, doubling its quotes"
                         ) from None
    return header, rows


def is_blank(fields: list[str]) -> bool:
    """A blank row: an empty line, spaces only, or only empty fields (`,,`); polars reads it as nulls."""
    return not any(f.strip() for f in fields)


def check_blank_rows(path: str | Path, rows: list[tuple[int, list[str]]]) -> None:
    """A CSV with blank rows is refused, naming every such line: Kaggle's gateway would pass each one
    to `predict` as a problem with a null id, and the answer would be submitted under that null id."""
    blank = [line for line, fields in rows if is_blank(fields)]
    if blank:
        shown = ", ".join(map(str, blank[:20])) + (f" and {len(blank) - 20} more" if len(blank) > 20 else "")
        many = "s" if len(blank) > 1 else ""
        raise ValueError(f"{path}: line{many} {shown}: blank row{many}: Kaggle's gateway (polars.read_csv) reads a "
                         "blank row as a problem with a null or blank id and submits its answer under that id; "
                         "delete the blank lines")


def read_problems(path: str | Path) -> list[Problem]:
    """A CSV with columns id, problem and optionally answer (an integer), checked as Kaggle's gateway
    would read it: blank rows are an error (see check_blank_rows), as are empty and duplicate ids."""
    path = Path(path)
    text = read_csv_text(path)
    try:
        cols, rows = csv_rows(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    for need in ("id", "problem"):
        if need not in cols:
            raise ValueError(f"{path}: missing column {need!r} (columns: {', '.join(cols) or 'none'})")
    twice = [c for c in ("id", "problem", "answer") if cols.count(c) > 1]  # others, blank ones too, are not read
    if twice:
        raise ValueError(f"{path}: column{'s' if len(twice) > 1 else ''} {', '.join(map(repr, twice))} given twice")
    check_blank_rows(path, rows)
    out, seen = [], set()
    for row_no, fields in rows:
        if len(fields) > len(cols):  # an unquoted comma cut the problem short and moved the rest along
            raise ValueError(f"{path}: line {row_no}: {len(fields)} fields under a header of {len(cols)} "
                             f"({', '.join(cols)}): quote a problem that holds commas")
        row = dict(zip(cols, fields))
        pid, text = (row.get("id") or "").strip(), (row.get("problem") or "").strip()
        if not pid or not text:
            raise ValueError(f"{path}: line {row_no}: empty id or problem")
        if pid in seen:
            raise ValueError(f"{path}: line {row_no}: duplicate id {pid!r}")
        seen.add(pid)
        raw = (row.get("answer") or "").strip()
        try:
            answer = int(raw) if raw else None
        except ValueError:
            raise ValueError(f"{path}: line {row_no}: column 'answer' must be an integer (got {raw!r})") from None
        out.append(Problem(pid, text, answer))
    if not out:
        raise ValueError(f"{path}: no problems")
    return out


def failure(result: SolveResult) -> Optional[str]:
    """Why a problem got no real answer: every sample ended in an error (e.g. a prompt over
    max_input_len, a dead engine); None when at least one sample ran."""
    if result.traces and all(t.finish == "error" for t in result.traces):
        return result.traces[0].error or "error"
    return None


def tools_note(result: SolveResult) -> str:
    """What happened to a problem that lost its tools (see server.solver): why, and the retry."""
    retry = (f"retried ({result.attempts - 1} more tr{'y' if result.attempts == 2 else 'ies'})" if result.attempts > 1
             else "not retried")
    return f"{result.tool_failure}; {retry}"


@dataclass
class RunReport:
    results: list[SolveResult] = field(default_factory=list)
    wall_seconds: float = 0.0
    engine_busy_seconds: Optional[float] = None  # None: the backend keeps no engine statistics
    interrupted: bool = False  # Ctrl-C (or a cancellation) ended the run early: results hold what was done
    speculative: Optional[dict] = None  # what the engine's drafter did (EngineStats.speculative), when it drafted
    engine: Optional[dict] = None  # where the engine's time went (EngineStats.profile), for an in-process engine

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    @property
    def scored(self) -> list[SolveResult]:
        return [r for r in self.results if r.expected is not None]

    @property
    def correct(self) -> int:
        return sum(bool(r.correct) for r in self.scored)

    def lanes(self) -> dict[str, float]:
        """Sample-seconds per lane across all samples, and the engine's idle share of the wall clock."""
        traces = [t for r in self.results for t in r.traces]
        gen = sum(t.generation_seconds for t in traces)
        tool = sum(t.tool_seconds for t in traces)
        total = sum(t.seconds for t in traces)
        return {"generation": gen, "tool": tool, "other": max(0.0, total - gen - tool),
                "engine_idle": (max(0.0, self.wall_seconds - self.engine_busy_seconds)
                                if self.engine_busy_seconds is not None else None)}

    def summary(self) -> dict:
        lanes = self.lanes()
        return {
            "problems": len(self.results), "scored": len(self.scored), "correct": self.correct,
            "accuracy": self.correct / len(self.scored) if self.scored else None,
            "wall_seconds": self.wall_seconds, "tokens": self.tokens,
            "tokens_per_second": self.tokens / self.wall_seconds if self.wall_seconds else 0.0,
            "code_calls": sum(r.code_calls for r in self.results),
            "lanes_seconds": lanes,
            "interrupted": self.interrupted,
            "failed": {r.problem_id: failure(r) for r in self.results if failure(r)},
            "tools_lost": {r.problem_id: tools_note(r) for r in self.results if r.tool_failure},
            "tool_faults": sum(r.tool_faults for r in self.results),
        }

    def table(self) -> str:
        head = (f"{'id':<12} {'answer':>8} {'expected':>8} {'ok':>3} {'votes':<22} {'secs':>6} {'fin':>3} "
                f"{'canc':>4} {'calls':>5} {'stop':<8}")
        lines = [head, "-" * len(head)]
        for r in self.results:
            votes = ",".join(f"{a}:{w:g}" for a, w in sorted(r.votes.items(), key=lambda kv: -kv[1])[:3]) or "-"
            ok = "" if r.correct is None else ("yes" if r.correct else "no")
            exp = "" if r.expected is None else str(r.expected)
            lines.append(f"{r.problem_id[:12]:<12} {r.answer:>8} {exp:>8} {ok:>3} {votes[:22]:<22} {r.seconds:>6.1f} "
                         f"{r.finished:>3} {r.cancelled:>4} {r.code_calls:>5} {r.stop_rule:<8}")
        for r in self.results:
            why = failure(r)
            if why:
                lines.append(f"{r.problem_id[:12]:<12} answer {r.answer} is the default: every sample failed: {why}")
            if r.tool_failure:
                lines.append(f"{r.problem_id[:12]:<12} lost its tools: {tools_note(r)}")
        s = self.summary()
        lanes = s["lanes_seconds"]
        acc = f"{s['correct']}/{s['scored']} correct" if s["scored"] else "no answers to score"
        lanes_total = lanes["generation"] + lanes["tool"] + lanes["other"] or 1.0
        lines += ["-" * len(head),
                  f"{acc}; {s['tokens']} tokens in {s['wall_seconds']:.1f} s = "
                  f"{s['tokens_per_second']:.1f} tok/s (whole run); "
                  f"{s['code_calls']} code calls",
                  f"sample time: generation {100 * lanes['generation'] / lanes_total:.1f}%, "
                  f"tool {100 * lanes['tool'] / lanes_total:.1f}%, "
                  f"other {100 * lanes['other'] / lanes_total:.1f}%; engine idle "
                  + (f"{lanes['engine_idle']:.1f} s of {s['wall_seconds']:.1f} s wall"
                     if lanes["engine_idle"] is not None
                     else "not known (the backend reports no engine statistics)")]
        return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def run_problems(solver: Solver, problems: list[Problem], budget: TimeBudget,
                       traces_path: Optional[Path] = None, engine_stats: Optional[Callable[[], float]] = None,
                       progress: Callable[[str], None] = log,
                       on_result: Optional[Callable[["RunReport"], None]] = None) -> RunReport:
    """Solve problems in order under the budget; traces go to JSONL as each problem ends, and
    `on_result` sees the report after each problem (to write results as they come). Ctrl-C or a
    cancellation ends the run early with `interrupted` set and every finished problem kept."""
    report = RunReport()
    t0 = time.monotonic()
    busy0 = engine_stats() if engine_stats else 0.0
    out = traces_path.open("w") if traces_path else None
    try:
        for i, p in enumerate(problems, start=1):
            allowance = budget.allowance()
            deadline_on_budget_clock = budget.start()
            # the solver runs on the real monotonic clock; convert the budget's deadline
            deadline = time.monotonic() + (deadline_on_budget_clock - budget.clock())
            progress(f"[solve {i}/{len(problems)}] {p.id}: budget {allowance:.0f} s (buffer {budget.buffer:.0f} s, "
                     f"{budget.time_left():.0f} s left)")
            result = await solver.solve(p.id, p.text, deadline, p.answer)
            budget.finish()
            report.results.append(result)
            ok = "" if result.correct is None else (" correct" if result.correct else f" wrong (expected {p.answer})")
            why = failure(result)
            progress(f"[solve {i}/{len(problems)}] {p.id}: answer {result.answer}{ok}; {result.seconds:.1f} s, "
                     f"{result.finished} finished, {result.cancelled} cancelled, {result.code_calls} code calls, "
                     f"stop: {result.stop_rule}" + (f"; every sample failed: {why}" if why else "")
                     + (f"; LOST ITS TOOLS: {tools_note(result)}" if result.tool_failure else ""))
            if out:
                try:
                    for t in result.traces:
                        out.write(json.dumps({"problem_id": p.id, **t.to_json()}) + "\n")
                    out.flush()
                except OSError as e:  # traces are a record, answers matter more: keep solving
                    progress(f"[solve] could not write {traces_path}: {e}; traces stop here")
                    out = None
            report.wall_seconds = time.monotonic() - t0
            if on_result:
                on_result(report)
    except (KeyboardInterrupt, asyncio.CancelledError):
        report.interrupted = True
        progress(f"[solve] interrupted after {len(report.results)} of {len(problems)} problems")
    finally:
        if out:
            try:
                out.close()
            except OSError:
                pass
    report.wall_seconds = time.monotonic() - t0
    report.engine_busy_seconds = (engine_stats() - busy0) if engine_stats else None
    return report
