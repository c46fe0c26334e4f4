"""A local gateway that calls `predict` the way Kaggle's AIMO gateway does, for use off Kaggle.

The program: server/programs/kaggle_gateway.py.

Like the real one (facts in tests/upstream/kaggle_evaluation.json) it reads the CSV with polars
(types inferred: numeric ids are Int64), shuffles it, and calls `predict(*row)` one row at a time,
single-threaded: one single-row Series per CSV column, positionally. It checks each answer as the
real gateway and relay would (one row, the `id` column equal to its own, an integer answer in the
competition's range that Arrow can carry), has no deadline on the first call and the competition's
per-answer deadline after it. Unlike the real one it refuses a CSV with blank rows or empty ids
(naming their lines), which the real one would answer and submit under a null id, it scores the
answers where the CSV has them, and it writes `submission.parquet` and `gateway_report.json` after
every answer (atomically: a crash or a full disk keeps every answer already written; a failed write
is logged with the answers).
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

from aimo_spec.atomic import write_atomic
from server.kaggle.competitions import competition as competition_facts


class GatewayError(RuntimeError):
    """What the real gateway would reject the submission for (or could not do)."""


def read_frame(path: Path) -> Any:
    """The problems as the real gateway reads them (polars), with errors that name the file. Rows the real
    gateway would answer under a null or empty id are refused with their lines (the same rule as
    `make kaggle`'s check, server.problems.check_blank_rows), so no such id reaches submission.parquet."""
    import polars as pl

    from server.problems import check_blank_rows, csv_rows, read_csv_text

    text = read_csv_text(path)  # not UTF-8: the file, line and byte
    try:
        frame = pl.read_csv(io.StringIO(text))
    except pl.exceptions.PolarsError as e:
        raise GatewayError(f"{path}: polars cannot read it as CSV: {e}") from None
    if frame.columns[:1] != ["id"] or "problem" not in frame.columns:
        raise GatewayError(f"{path}: needs the columns id (first) and problem (got {frame.columns})")
    if frame.height == 0:
        raise GatewayError(f"{path}: no problems")
    try:
        _, rows = csv_rows(text)
    except ValueError as e:
        raise GatewayError(f"{path}: {e}") from None
    try:
        check_blank_rows(path, rows)
    except ValueError as e:
        raise GatewayError(str(e)) from None
    ids = frame["id"].cast(pl.String)
    empty = (ids.is_null() | (ids.str.strip_chars() == "")).arg_true().to_list()
    if empty:
        lines = [str(rows[i][0]) if len(rows) == frame.height else f"row {i + 1}" for i in empty]
        raise GatewayError(f"{path}: line {', '.join(lines)}: empty id (the gateway would submit the answer under it)")
    return frame


def check_response(df: Any, expected_id: Any, answer_range: int) -> int:
    """The real gateway's validation plus what its relay needs to send the answer back."""
    import polars as pl

    if df is None:
        raise GatewayError("predict returned None (the gateway: 'No prediction received')")
    if not isinstance(df, pl.DataFrame):
        raise GatewayError(f"predict must return a polars DataFrame (got {type(df).__name__})")
    shown = expected_id.to_list()[0]
    if df.height != 1:
        raise GatewayError(f"{shown}: predict returned {df.height} rows for one problem")
    if "id" not in df.columns or "answer" not in df.columns:
        raise GatewayError(f"{shown}: predict must return columns id and answer (got {df.columns})")
    if not pl.Series(df["id"]).equals(pl.Series(expected_id)):
        raise GatewayError(f"{shown}: predict returned the id {df['id'][0]!r} ({df['id'].dtype}); the gateway "
                           f"compares it with its own {shown!r} ({expected_id.dtype}): return the id as given")
    try:
        df.to_arrow()
    except Exception as e:  # noqa: BLE001 - e.g. Int128: the relay would abort the whole run
        raise GatewayError(f"{shown}: the answer frame cannot be sent back ({type(e).__name__}: {e}; "
                           f"dtypes {df.dtypes})") from None
    answer = df["answer"][0]
    if not df["answer"].dtype.is_integer() or answer is None or isinstance(answer, bool):
        raise GatewayError(f"{shown}: the answer must be an integer (got {answer!r}, {df['answer'].dtype})")
    if not 0 <= answer < answer_range:
        raise GatewayError(f"{shown}: the answer {answer} is outside 0..{answer_range - 1}")
    return int(answer)


class Outputs:
    """submission.parquet and gateway_report.json, rewritten after each answer; write errors are kept."""

    def __init__(self, out: Path, log: Callable[[str], None]):
        self.out, self.log = out, log
        self.error: Optional[str] = None

    def write(self, results: list[dict], report: dict) -> None:
        import polars as pl

        try:
            self.out.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            pl.concat([r["frame"] for r in results], how="vertical_relaxed").write_parquet(buf)
            write_atomic(self.out / "submission.parquet", buf.getvalue())
            write_atomic(self.out / "gateway_report.json", json.dumps(report, indent=2, default=str))
            self.error = None
        except OSError as e:
            self.error = str(e)
            self.log(f"[gateway] WRITE FAILED: {e}; answers so far: "
                     + ", ".join(f"{r['id']}={r['answer']}" for r in results))


def run(predict: Callable[..., Any], problems: Path, out: Path, seed: int = 0, competition: str = "aimo3",
        answer_timeout: Optional[float] = None, log: Callable[[str], None] = print,
        started_at: Optional[float] = None) -> dict[str, Any]:
    """Call `predict` on every row as the real gateway does; the report of the whole run."""
    facts = competition_facts(competition)
    timeout = facts.answer_timeout_seconds if answer_timeout is None else answer_timeout
    frame = read_frame(problems).sample(fraction=1.0, shuffle=True, with_replacement=False, seed=seed)
    has_answers = "answer" in frame.columns
    t0 = time.monotonic()
    started_at = time.time() if started_at is None else started_at
    results: list[dict] = []
    report: dict[str, Any] = {"competition": competition, "problems": 0, "scored": 0, "correct": 0, "results": []}
    outputs = Outputs(out, log)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # single-threaded calls, as the real server
    try:
        for i, row in enumerate(frame.iter_slices(n_rows=1), start=1):
            expected_id = row["id"]
            shown = expected_id.to_list()[0]
            t = time.monotonic()
            if i == 1:
                report["first_predict_after_start_seconds"] = round(time.time() - started_at, 2)
            future = pool.submit(predict, *row)  # one single-row Series per column, positionally
            try:
                result = future.result(timeout=None if i == 1 else timeout)  # no deadline on the first call
            except concurrent.futures.TimeoutError:
                raise GatewayError(f"{shown}: no answer within {timeout:.0f}s") from None
            answer = check_response(result, expected_id, facts.answer_range)
            truth = row["answer"][0] if has_answers else None
            expected = int(truth) if isinstance(truth, (int, float)) and truth == truth else None
            results.append({"id": shown, "answer": answer, "expected": expected, "frame": result,
                            "seconds": round(time.monotonic() - t, 2),
                            "correct": None if expected is None else answer == expected})
            if i == 1:
                report["first_answer_after_start_seconds"] = round(time.time() - started_at, 2)
            scored = [r for r in results if r["expected"] is not None]
            report.update(problems=len(results), scored=len(scored), correct=sum(bool(r["correct"]) for r in scored),
                          wall_seconds=round(time.monotonic() - t0, 1),
                          results=[{k: v for k, v in r.items() if k != "frame"} for r in results])
            outputs.write(results, report)
            log(f"[gateway {i}/{frame.height}] {shown}: {answer}" + ("" if expected is None else
                f" ({'correct' if answer == expected else f'expected {expected}'})"))
    finally:
        pool.shutdown(wait=False)
    if outputs.error:
        raise GatewayError(f"every answer was computed but the outputs could not be written: {outputs.error}")
    log(f"[gateway] {report['correct']}/{report['scored']} correct, {report['problems']} answered in "
        f"{report['wall_seconds']}s; wrote {out / 'submission.parquet'}")
    return report
