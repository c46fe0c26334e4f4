"""A local gateway that behaves like Kaggle's AIMO gateway, for testing `predict` before submitting.

    python -m server.kaggle.gateway --engine engines/mix/build/embedded --problems engines/problems/smoke.csv

Like the real one it shuffles the problems, calls `predict(id_, problem)` one row at a time with
single-row polars Series, checks the returned DataFrame (columns id and answer, one row, the same
id, an integer answer), and enforces a per-answer timeout. It writes `submission.csv`, scores the
answers where the file has them, and reports the whole run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ANSWER_TIMEOUT_SECONDS = 30 * 60  # AIMO-2's per-answer limit


class GatewayError(RuntimeError):
    """What the real gateway would reject the submission for."""


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or "id" not in rows[0] or "problem" not in rows[0]:
        raise GatewayError(f"{path}: needs columns id and problem")
    return rows


def check_response(df: Any, pid: str) -> int:
    cols = list(getattr(df, "columns", []))
    if cols[:2] != ["id", "answer"] or len(df) != 1:
        raise GatewayError(f"{pid}: predict must return a one-row DataFrame with columns id, answer (got {cols}, "
                           f"{len(df) if hasattr(df, '__len__') else '?'} rows)")
    got_id, answer = df["id"][0], df["answer"][0]
    if str(got_id) != pid:
        raise GatewayError(f"{pid}: predict returned the id {got_id!r}")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise GatewayError(f"{pid}: the answer must be an integer (got {answer!r})")
    return answer


def run(predict: Callable[[Any, Any], Any], problems: Path, out: Path, seed: int = 0,
        answer_timeout: float = ANSWER_TIMEOUT_SECONDS, log: Callable[[str], None] = print) -> dict[str, Any]:
    import polars as pl

    rows = read_rows(problems)
    random.Random(seed).shuffle(rows)
    out.mkdir(parents=True, exist_ok=True)
    results, t0 = [], time.monotonic()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # single-threaded calls, as the real gateway
    try:
        for i, row in enumerate(rows, start=1):
            pid = row["id"]
            t = time.monotonic()
            future = pool.submit(predict, pl.Series("id", [pid]), pl.Series("problem", [row["problem"]]))
            try:
                answer = check_response(future.result(timeout=answer_timeout), pid)
            except concurrent.futures.TimeoutError:
                raise GatewayError(f"{pid}: no answer within {answer_timeout:.0f}s") from None
            expected = int(row["answer"]) if row.get("answer", "").strip() else None
            results.append({"id": pid, "answer": answer, "expected": expected, "seconds": round(time.monotonic() - t, 2),
                            "correct": None if expected is None else answer == expected})
            log(f"[gateway {i}/{len(rows)}] {pid}: {answer}" + ("" if expected is None else
                                                              f" ({'correct' if answer == expected else f'expected {expected}'})"))
    finally:
        pool.shutdown(wait=False)
    with (out / "submission.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "answer"])
        for r in results:
            w.writerow([r["id"], r["answer"]])
    scored = [r for r in results if r["expected"] is not None]
    report = {"problems": len(results), "scored": len(scored), "correct": sum(bool(r["correct"]) for r in scored),
              "wall_seconds": round(time.monotonic() - t0, 1), "results": results}
    (out / "gateway_report.json").write_text(json.dumps(report, indent=2))
    log(f"[gateway] {report['correct']}/{report['scored']} correct, {report['problems']} answered in "
        f"{report['wall_seconds']}s; wrote {out / 'submission.csv'}")
    return report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.kaggle.gateway", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--problems", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=Path("runs/kaggle"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--url", default="", help="solve through OpenAI-compatible server(s) (comma-separated)")
    args = ap.parse_args(argv)
    from server.kaggle.predict import Predictor

    predictor = Predictor(args.engine, problems=len(read_rows(args.problems)), samples=args.samples, url=args.url)
    try:
        run(predictor.predict, args.problems, args.out, args.seed)
    except GatewayError as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 1
    finally:
        predictor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
