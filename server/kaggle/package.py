"""`make kaggle MODEL=mix`: a folder to upload as a Kaggle dataset, and the notebook that runs it offline.

    python -m server.kaggle.package --recipe engines/mix.yaml --out engines/mix/kaggle [--wheels runtime]

The folder holds `wheels/` (the project's own wheel; with `--wheels runtime` also the pinned serving
libraries Kaggle's image lacks or has at other versions, from requirements/kaggle.txt), `engine/`
(the built engine folder), `problems.csv` (for the local gateway) and `aimo_trt.ipynb`. The notebook
installs the wheels with `pip --no-index` (no network) into a folder of its own, builds `predict`,
and starts Kaggle's inference server, or the local gateway off Kaggle.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]


def _cell(kind: str, source: str) -> dict:
    cell = {"cell_type": kind, "metadata": {}, "source": source.strip("\n").splitlines(keepends=True)}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def notebook(dataset_name: str, problems: int, competition: str) -> dict:
    """The notebook as nbformat 4 JSON. Paths come from the environment where the test sets them."""
    cells = [
        _cell("markdown", f"""
# aimo-trt: TIR solver ({competition.upper()} inference API)

Offline: installs the wheels of the `{dataset_name}` dataset with `pip --no-index`, loads the engine
lazily inside the first `predict` call (the inference server must answer the gateway fast), and
serves `predict` with Kaggle's inference server, or with the local gateway off Kaggle.
"""),
        _cell("code", f"""
import glob, os, subprocess, sys
DATASET = os.environ.get("AIMO_TRT_DATASET", "/kaggle/input/{dataset_name}")
SITE = os.environ.get("AIMO_TRT_SITE", "/kaggle/tmp/aimo-trt-site")
wheels = sorted(glob.glob(os.path.join(DATASET, "wheels", "*.whl")))
assert wheels, f"no wheels in {{DATASET}}/wheels"
subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", "--upgrade",
                "--target", SITE, *wheels], check=True)
sys.path.insert(0, SITE)
print(f"installed {{len(wheels)}} wheels into {{SITE}}")
"""),
        _cell("code", f"""
from server.kaggle.predict import Predictor

predictor = Predictor(os.path.join(DATASET, "engine"), problems=int(os.environ.get("AIMO_PROBLEMS", "{problems}")),
                      samples=int(os.environ["AIMO_SAMPLES"]) if os.environ.get("AIMO_SAMPLES") else None)


def predict(id_, problem):
    \"\"\"Called by the inference server with single-row polars Series; returns DataFrame(id, answer).\"\"\"
    return predictor.predict(id_, problem)
"""),
        _cell("code", f"""
from server.kaggle.runner import serve

report = serve(predict, os.path.join(DATASET, "problems.csv"), out=os.environ.get("AIMO_OUT", "/kaggle/working"),
               competition="{competition}")
report and print({{k: v for k, v in report.items() if k != "results"}})
"""),
    ]
    for i, cell in enumerate(cells):
        cell["id"] = f"aimo-trt-{i}"
    return {"cells": cells, "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


NOT_SHIPPED = {"torch", "numpy"}  # Kaggle's image has them (torch with CUDA)


def runtime_requirements() -> list[str]:
    """requirements/kaggle.txt and everything it needs (this environment's resolved versions, i.e. the
    ones pinned in constraints.txt), pinned, without what Kaggle's image already has."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    top = [line.split("#")[0].strip() for line in (ROOT / "requirements" / "kaggle.txt").read_text().splitlines()]
    todo, seen = [t for t in top if t], {}
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name in NOT_SHIPPED:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist.version.split("+")[0]
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return [f"{n}=={v}" for n, v in sorted(seen.items())]


def build(engine_dir: Path, out: Path, problems_csv: Path, wheels: str = "project", dataset_name: str = "aimo-trt",
          problems: int = 50, competition: str = "aimo3", python_version: str = "3.11") -> dict:
    if not (engine_dir / "engine.json").is_file():
        raise FileNotFoundError(f"{engine_dir}/engine.json: no engine; run `make engine` first")
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out / "wheels"), str(ROOT)], check=True)
    pinned: list[str] = []
    if wheels == "runtime":
        pinned = runtime_requirements()
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", python_version, "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                        "-d", str(out / "wheels"), *pinned], check=True)
    shutil.copytree(engine_dir, out / "engine", ignore=shutil.ignore_patterns("manifest.json"))
    shutil.copy(problems_csv, out / "problems.csv")
    (out / "aimo_trt.ipynb").write_text(json.dumps(notebook(dataset_name, problems, competition), indent=1) + "\n")
    info = {"wheels": sorted(p.name for p in (out / "wheels").glob("*.whl")), "pinned": pinned, "mode": wheels,
            "engine": str(engine_dir), "competition": competition, "size_bytes": sum(
                p.stat().st_size for p in out.rglob("*") if p.is_file())}
    (out / "dataset.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.kaggle.package", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--problems", type=Path, default=ROOT / "engines" / "problems" / "smoke.csv")
    ap.add_argument("--wheels", choices=("project", "runtime"), default="runtime")
    ap.add_argument("--competition", choices=("aimo3", "aimo2"), default="aimo3")
    args = ap.parse_args(argv)
    from trtbuild.core.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe)
        kind = "trtllm" if recipe.layout.has_engine("trtllm") else "embedded"
        out = args.out or recipe.layout.kaggle
        info = build(recipe.layout.engine(kind), out, args.problems, args.wheels, competition=args.competition)
    except (RecipeError, FileNotFoundError, ValueError, subprocess.CalledProcessError) as e:
        print(f"kaggle: {e}", file=sys.stderr)
        return 2
    print(f"[kaggle] {out}: {len(info['wheels'])} wheels, engine {kind}, {info['size_bytes'] / 1e6:.1f} MB; "
          f"upload the folder as a dataset and run {out / 'aimo_trt.ipynb'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
