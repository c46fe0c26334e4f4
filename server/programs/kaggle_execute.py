"""Run the generated notebook headlessly, as Kaggle would, against a local dataset folder (no network).

    python -m server.programs.kaggle_execute --dataset engines/mix/kaggle [--out DIR] [--samples N]

Prints the notebook's time and score, or why it failed (status 1); what it runs: server/kaggle/execute.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from server.kaggle.execute import execute


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.programs.kaggle_execute", description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--samples", type=int, default=None)
    args = ap.parse_args(argv)
    out = args.out or args.dataset.parent / "kaggle-run"
    report = execute(args.dataset, out, samples=args.samples)
    if report["error"] or "correct" not in report:
        print(f"[kaggle] the notebook failed after {report['notebook_seconds']}s "
              f"(executed copy: {out / 'aimo_trt.executed.ipynb'}):\n{report['error'] or 'no submission.parquet'}",
              file=sys.stderr)
        return 1
    times = report.get("aimo_trt_timings") or {}
    print(f"[kaggle] notebook ran in {report['notebook_seconds']}s (first predict {times.get('first_call')}s and first "
          f"answer {times.get('first_answer')}s after its start): "
          f"{report['correct']}/{report['scored']} correct, {report['problems']} answered; submission "
          f"{out / 'submission.parquet'}; executed notebook {out / 'aimo_trt.executed.ipynb'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
