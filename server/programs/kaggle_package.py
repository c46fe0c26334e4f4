"""`make kaggle MODEL=mix`: a folder to upload as a Kaggle dataset, and the notebook that runs it offline.

    python -m server.programs.kaggle_package --recipe engines/mix.yaml --out engines/mix/kaggle [--wheels runtime]
    python -m server.programs.kaggle_package --recipe engines/mix.yaml --backend trtllm --trtllm-wheels DIR

What the folder holds, and how a TensorRT-LLM engine ships: server/kaggle/package.py.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Optional

from server.kaggle.package import KAGGLE_PYTHON, ROOT, build, python_tag, trtllm_wheel_set


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.programs.kaggle_package", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--problems", type=Path, default=ROOT / "engines" / "problems" / "smoke.csv")
    ap.add_argument("--wheels", choices=("project", "runtime"), default="runtime")
    ap.add_argument("--competition", choices=("aimo3", "aimo2"), default=None,
                    help="default: the recipe's kaggle.competition")
    ap.add_argument("--dataset-name", default="aimo-trt",
                    help="the Kaggle dataset's name (slug) the notebook looks for")
    ap.add_argument("--backend", choices=("auto", "embedded", "trtllm"), default="auto",
                    help="auto: the trtllm engine when one was built, else the embedded one")
    ap.add_argument("--trtllm-wheels", type=Path, default=None,
                    help="folder with the TensorRT-LLM 1.2.x wheel set (needed for a trtllm engine)")
    ap.add_argument("--python-version", default=KAGGLE_PYTHON,
                    help=f"the Python of the Kaggle image the wheels are for (default {KAGGLE_PYTHON}, Kaggle's)")
    args = ap.parse_args(argv)
    from aimo_spec.recipe import RecipeError, load_recipe
    from server.engine_check import EngineFolderError

    try:
        recipe = load_recipe(args.recipe, check_paths=False)  # the built engine, not the sources
        kind = args.backend
        if kind == "auto":
            kind = "trtllm" if recipe.layout.has_engine("trtllm") else "embedded"
        python_tag(args.python_version)  # before any packaging work
        if kind == "trtllm":
            trtllm_wheel_set(args.trtllm_wheels)
        out = args.out or recipe.layout.kaggle
        competition = args.competition or recipe.kaggle.competition
        info = build(recipe.layout.engine(kind), out, args.problems, recipe.serving, args.wheels,
                     dataset_name=args.dataset_name,
                     competition=competition, python_version=args.python_version, trtllm_wheels=args.trtllm_wheels,
                     answer_range=recipe.kaggle.answer_range or None)
    except (RecipeError, EngineFolderError, FileNotFoundError, ValueError, subprocess.CalledProcessError) as e:
        print(f"kaggle: {e}", file=sys.stderr)
        return 2
    print(f"[kaggle] {out}: {len(info['wheels'])} wheels, engine {kind}, {info['size_bytes'] / 1e6:.1f} MB; "
          f"upload the folder as the dataset {args.dataset_name!r} and run {out / 'aimo_trt.ipynb'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
