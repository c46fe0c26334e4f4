"""Run the generated notebook headlessly, as Kaggle would, against a local dataset folder (no network).

    python -m server.kaggle.execute --dataset engines/mix/kaggle [--samples N]

Sets the paths the notebook reads (AIMO_TRT_DATASET, AIMO_TRT_SITE, AIMO_OUT), executes every cell with
nbclient in a fresh kernel, saves the executed notebook, and prints the gateway's report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional


def execute(dataset: Path, out: Path, site: Optional[Path] = None, problems: Optional[int] = None,
            samples: Optional[int] = None, timeout: int = 3600) -> dict:
    import nbformat
    from nbclient import NotebookClient

    out.mkdir(parents=True, exist_ok=True)
    site = site or Path(tempfile.mkdtemp(prefix="aimo-trt-site-"))
    env = {"AIMO_TRT_DATASET": str(dataset.resolve()), "AIMO_TRT_SITE": str(site), "AIMO_OUT": str(out.resolve()),
           "PYTHONNOUSERSITE": "1"}
    if problems:
        env["AIMO_PROBLEMS"] = str(problems)
    if samples:
        env["AIMO_SAMPLES"] = str(samples)
    nb = nbformat.read(str(dataset / "aimo_trt.ipynb"), as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    t0 = time.monotonic()
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(out)}}).execute()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        nbformat.write(nb, str(out / "aimo_trt.executed.ipynb"))
    report = json.loads((out / "gateway_report.json").read_text())
    report["notebook_seconds"] = round(time.monotonic() - t0, 1)
    report["printed"] = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    return report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.kaggle.execute", description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--samples", type=int, default=None)
    args = ap.parse_args(argv)
    out = args.out or args.dataset.parent / "kaggle-run"
    report = execute(args.dataset, out, samples=args.samples)
    print(f"[kaggle] notebook ran in {report['notebook_seconds']}s: {report['correct']}/{report['scored']} correct, "
          f"{report['problems']} answered; submission {out / 'submission.csv'}; executed notebook "
          f"{out / 'aimo_trt.executed.ipynb'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
