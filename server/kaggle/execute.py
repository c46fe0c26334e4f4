"""Run the generated notebook headlessly, as Kaggle would, against a local dataset folder (no network).

The program: server/programs/kaggle_execute.py.

Sets the paths the notebook reads (AIMO_TRT_DATASET, AIMO_TRT_SITE, AIMO_OUT), executes every cell with
nbclient in a fresh kernel whose working directory is the output folder (where the gateway, ours or
Kaggle's, writes `submission.parquet`), saves the executed notebook, and scores the submission
against the answer column of the dataset's problems.csv.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

SITE_PREFIX = "aimo-trt-site-"  # the temporary install folder's name, when the caller gives none


def score(submission: Path, problems_csv: Path) -> dict[str, Any]:
    """Answers in `submission.parquet` against the CSV's answer column (where it has one)."""
    import polars as pl

    from server.problems import read_problems

    truth = {p.id: p.answer for p in read_problems(problems_csv)}
    got = {str(i): a for i, a in pl.read_parquet(submission).select("id", "answer").iter_rows()}
    scored = {k: v for k, v in truth.items() if v is not None}
    return {"problems": len(got), "missing": sorted(set(truth) - set(got)), "scored": len(scored),
            "correct": sum(got.get(k) == v for k, v in scored.items()), "answers": got}


def execute(dataset: Path, out: Path, site: Optional[Path] = None, problems: Optional[int] = None,
            samples: Optional[int] = None, timeout: int = 3600, env: Optional[dict[str, str]] = None) -> dict:
    """Execute the notebook; its report: the score, the gateway's timings, what the cells printed.

    Without `site` the wheels go to a temporary folder (about 480 MB with the runtime wheels) that is
    removed when the run ends, failed or not; a `site` the caller passes is the caller's and is kept."""
    if site is not None:
        return _execute(dataset, out, site, problems, samples, timeout, env)
    with tempfile.TemporaryDirectory(prefix=SITE_PREFIX, ignore_cleanup_errors=True) as tmp:
        return _execute(dataset, out, Path(tmp), problems, samples, timeout, env)


def _execute(dataset: Path, out: Path, site: Path, problems: Optional[int], samples: Optional[int], timeout: int,
             env: Optional[dict[str, str]]) -> dict:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    out.mkdir(parents=True, exist_ok=True)
    run_env = {"AIMO_TRT_DATASET": str(dataset.resolve()), "AIMO_TRT_SITE": str(site), "AIMO_OUT": str(out.resolve()),
               "PYTHONNOUSERSITE": "1", **(env or {})}
    if problems:
        run_env["AIMO_PROBLEMS"] = str(problems)
    if samples:
        run_env["AIMO_SAMPLES"] = str(samples)
    nb = nbformat.read(str(dataset / "aimo_trt.ipynb"), as_version=4)
    saved = {k: os.environ.get(k) for k in run_env}
    os.environ.update(run_env)  # the kernel inherits this process's environment
    t0 = time.monotonic()
    error: Optional[str] = None
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(out)}}).execute()
    except CellExecutionError as e:
        error = str(e)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        nbformat.write(nb, str(out / "aimo_trt.executed.ipynb"))
    report: dict[str, Any] = {"notebook_seconds": round(time.monotonic() - t0, 1), "error": error,
                              "printed": "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))}
    for name in ("gateway_report.json", "double_report.json", "result.json", "aimo_trt_timings.json"):
        if (out / name).is_file():
            report[name.removesuffix(".json")] = json.loads((out / name).read_text())
    if (out / "submission.parquet").is_file():
        report.update(score(out / "submission.parquet", dataset / "problems.csv"))
    return report
