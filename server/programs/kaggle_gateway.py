"""A local gateway that calls `predict` the way Kaggle's AIMO gateway does, for use off Kaggle.

    python -m server.programs.kaggle_gateway --engine engines/mix/build/embedded --problems engines/problems/smoke.csv \
        [--serving engines/mix/kaggle/serving.json]

Serves `predict` from the engine (or --url's OpenAI-compatible servers) to the local gateway
(server/kaggle/gateway.py), which writes `submission.parquet` and `gateway_report.json` to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from server.kaggle.gateway import GatewayError, read_frame, run


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.programs.kaggle_gateway", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--serving", default=None, help="the serving settings: a Kaggle dataset's serving.json "
                                                    "(default: the defaults)")
    ap.add_argument("--problems", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=Path("runs/kaggle"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--competition", choices=("aimo3", "aimo2"), default="aimo3")
    ap.add_argument("--url", default="", help="solve through OpenAI-compatible server(s) (comma-separated)")
    args = ap.parse_args(argv)
    from server.kaggle.predict import Predictor

    try:
        n = read_frame(args.problems).height
        predictor = Predictor(args.engine, problems=n, samples=args.samples, url=args.url,
                              competition=args.competition, serving=args.serving)
    except (GatewayError, ValueError, FileNotFoundError) as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    try:
        run(predictor.predict, args.problems, args.out, args.seed, competition=args.competition)
    except (GatewayError, RuntimeError) as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 1
    finally:
        predictor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
