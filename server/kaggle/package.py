"""`make kaggle MODEL=mix`: a folder to upload as a Kaggle dataset, and the notebook that runs it offline.

The program: server/programs/kaggle_package.py.

The folder holds `wheels/` (the project's own wheel; with `--wheels runtime` also the pinned serving
libraries Kaggle's image lacks or has at other versions, from requirements/kaggle.txt), `engine/`
(the built engine folder), `serving.json` (the recipe's serving section: the engine folder holds only
what the build decided), `problems.csv` (for the local gateway) and `aimo_trt.ipynb`. The notebook
installs the wheels with `pip --no-index` (no network) into a folder of its own, builds `predict`,
and starts Kaggle's inference server, or the local gateway off Kaggle.

A TensorRT-LLM engine (`build/trtllm/`) ships with a TensorRT-LLM 1.2.x wheel set the user provides
(`--trtllm-wheels`, e.g. `pip download tensorrt-llm==1.2.1` on a machine that reaches NVIDIA's index):
nothing here downloads it. It goes to `wheels/trtllm/`, and the notebook installs it offline from
there, with its dependencies, before loading the engine.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from aimo_spec.layout import ENGINE_FILE
from aimo_spec.recipe import ServingSpec, to_data
from server.kaggle.competitions import COMPETITIONS
from server.kaggle.predict import SERVING_FILE

ROOT = Path(__file__).resolve().parents[2]


def _cell(kind: str, source: str) -> dict:
    cell = {"cell_type": kind, "metadata": {}, "source": source.strip("\n").splitlines(keepends=True)}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


TRTLLM_WHEELS_DIR = "trtllm"  # under wheels/: the user's TensorRT-LLM wheel set
TRTLLM_REQUIREMENT = "tensorrt-llm>=1.2,<1.3"  # the engine path (trtllm-build engines, ReDrafter) is 1.2.x


def trtllm_install_cell() -> dict:
    """Install TensorRT-LLM from the dataset's wheel set, offline, with the dependencies in that set."""
    return _cell("code", f"""
# TensorRT-LLM 1.2.x for the trtllm engine: from wheels/{TRTLLM_WHEELS_DIR}/ only, with its dependencies
TRTLLM_WHEELS = os.path.join(DATASET, "wheels", "{TRTLLM_WHEELS_DIR}")
subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", TRTLLM_WHEELS, "--quiet",
                "--target", SITE, "{TRTLLM_REQUIREMENT}"], check=True)
import importlib.metadata
print("tensorrt-llm", importlib.metadata.version("tensorrt-llm"), "installed into", SITE)
""")


def notebook(dataset_name: str, problems: int, competition: str, trtllm: bool = False,
             answer_range: Optional[int] = None) -> dict:
    """The notebook as nbformat 4 JSON. Paths come from the environment where the test sets them."""
    comp = COMPETITIONS[competition]
    cells = [
        _cell("markdown", f"""
# aimo-trt: TIR solver ({competition.upper()} inference API)

Offline: imports the competition's `kaggle_evaluation` first (its startup clock starts there),
finds the `{dataset_name}` dataset wherever it is mounted, installs its wheels with
`pip --no-index`, loads the engine lazily inside the first `predict` call (the inference server
must answer the gateway fast), and serves `predict` with Kaggle's inference server, or with the
local gateway off Kaggle. In the scored rerun a missing `kaggle_evaluation` is an error.
"""),
        _cell("code", f"""
import time
T0 = time.time()  # the notebook's start: the time to the first predict is measured from here
import glob, os, subprocess, sys
RERUN = bool(os.getenv("KAGGLE_IS_COMPETITION_RERUN"))
KAGGLE_INPUT = os.environ.get("AIMO_KAGGLE_INPUT", "/kaggle/input")  # where Kaggle mounts data and datasets
for _init in sorted(glob.glob(os.path.join(KAGGLE_INPUT, "*", "kaggle_evaluation", "__init__.py"))
                    + glob.glob(os.path.join(KAGGLE_INPUT, "*", "*", "kaggle_evaluation", "__init__.py")))[:1]:
    sys.path.append(os.path.dirname(os.path.dirname(_init)))  # the competition's data, wherever mounted
try:
    import {comp.server_module}  # early, as Kaggle asks: the 900 s startup limit counts from here
    print("kaggle_evaluation:", os.path.dirname({comp.server_module}.__file__))
except (ImportError, SystemExit) as e:
    if RERUN:
        raise RuntimeError(f"the scored rerun needs kaggle_evaluation (and grpc): {{e!r}}") from None
    print(f"no kaggle_evaluation ({{e!r}}): the project's local gateway will run")


def find_dataset(name):
    \"\"\"The dataset folder: AIMO_TRT_DATASET, else the folder with our dataset.json and engine/ under
    KAGGLE_INPUT at any depth Kaggle mounts datasets (/kaggle/input/<slug>, .../datasets/<user>/<slug>).\"\"\"
    if os.environ.get("AIMO_TRT_DATASET"):
        return os.environ["AIMO_TRT_DATASET"]
    found = sorted(os.path.dirname(p) for depth in ("*", "*/*", "*/*/*", "*/*/*/*")
                   for p in glob.glob(os.path.join(KAGGLE_INPUT, depth, "dataset.json"))
                   if os.path.isfile(os.path.join(os.path.dirname(p), "engine", "engine.json")))
    if not found:
        raise FileNotFoundError(f"dataset {{name!r}} not found under {{KAGGLE_INPUT}} (add it to the notebook)")
    return ([f for f in found if os.path.basename(f) == name] or found)[0]


DATASET = find_dataset("{dataset_name}")
SITE = os.environ.get("AIMO_TRT_SITE", "/kaggle/tmp/aimo-trt-site")
wheels = sorted(glob.glob(os.path.join(DATASET, "wheels", "*.whl")))
assert wheels, f"no wheels in {{DATASET}}/wheels"
subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", "--upgrade",
                "--target", SITE, *wheels], check=True)
sys.path.insert(0, SITE)
print(f"dataset {{DATASET}}: installed {{len(wheels)}} wheels into {{SITE}}")
"""),
        *([trtllm_install_cell()] if trtllm else []),
        _cell("code", f"""
from server.kaggle.predict import Predictor

predictor = Predictor(os.path.join(DATASET, "engine"), serving=os.path.join(DATASET, "{SERVING_FILE}"),
                      problems=int(os.environ.get("AIMO_PROBLEMS", "{problems}")),
                      samples=int(os.environ["AIMO_SAMPLES"]) if os.environ.get("AIMO_SAMPLES") else None,
                      competition="{competition}", answer_range={answer_range!r}, started_at=T0)


def predict(*row):
    \"\"\"Called by the inference server with one single-row polars Series per CSV column (id, problem,
    ...); returns DataFrame(id, answer), the id as given.\"\"\"
    return predictor.predict(*row)
"""),
        _cell("code", f"""
from server.kaggle.runner import serve

report = serve(predict, os.path.join(DATASET, "problems.csv"), out=os.environ.get("AIMO_OUT", "/kaggle/working"),
               competition="{competition}", started_at=T0)
report and print({{k: v for k, v in report.items() if k != "results"}})
print("timings (s since the notebook started):", predictor.timings)
import json
with open("aimo_trt_timings.json", "w") as f:  # the working folder, beside submission.parquet
    json.dump(predictor.timings, f)
"""),
    ]
    for i, cell in enumerate(cells):
        cell["id"] = f"aimo-trt-{i}"
    return {"cells": cells, "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                                        "name": "python3"},
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


def trtllm_wheel_set(folder: Optional[Path]) -> list[Path]:
    """The user's TensorRT-LLM wheels; a clear error when there is no folder or no 1.2.x wheel in it."""
    if folder is None or not Path(folder).is_dir():
        raise ValueError(f"a trtllm engine needs TensorRT-LLM's wheels (got {folder}): set TRTLLM_WHEELS to a folder "
                         "holding tensorrt_llm-1.2.x-*.whl and its dependencies' wheels (e.g. `pip download "
                         "tensorrt-llm==1.2.1 -d DIR` where NVIDIA's index is reachable)")
    wheels = sorted(Path(folder).glob("*.whl"))
    if not any(w.name.startswith("tensorrt_llm-1.2.") for w in wheels):
        raise ValueError(f"{folder}: no tensorrt_llm-1.2.x-*.whl among {len(wheels)} wheels (TRTLLM_WHEELS)")
    return wheels


DATASET_NAME = re.compile(r"[a-z0-9][a-z0-9-]{1,48}[a-z0-9]")  # a Kaggle dataset slug
# The Python of Kaggle's notebook image, which the binary wheels must match (KAGGLE_PYTHON overrides it
# for another image); the notebook installs them with `pip --no-index`, so a mismatch cannot be fixed there.
KAGGLE_PYTHON = "3.11"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")  # Kaggle: x86-64 Linux


def python_tag(version: str) -> str:
    """'3.11' -> 'cp311' (the CPython ABI the wheels are fetched for); ValueError naming a malformed value."""
    m = re.fullmatch(r"3\.(0|[1-9][0-9]?)", str(version))
    if not m:
        raise ValueError(f"python version {version!r}: use 3.MINOR, e.g. {KAGGLE_PYTHON}, the Python "
                         "of Kaggle's image (KAGGLE_PYTHON / --python-version)")
    return f"cp3{m.group(1)}"


def download_command(pinned: list[str], dest: Path, python_version: str = KAGGLE_PYTHON) -> list[str]:
    """`pip download` of the pinned wheels for Kaggle's interpreter rather than this one: binary wheels only,
    for `python_version`'s CPython ABI on x86-64 Linux, without resolving again (the pins are complete)."""
    tag = python_tag(python_version)
    return [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "cp", "--abi", tag,
            *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(dest), *pinned]


def copy_engine(engine_dir: Path, dest: Path, keep_cpu_weights: bool) -> None:
    """The engine folder as the notebook loads it. The weights that `build.cpu_quantization` packs for
    CPUs (a GGUF beside the main weights) stay behind unless the notebook serves on the CPU: Kaggle's
    AIMO notebooks run on GPUs, and a dataset's every byte is uploaded and mounted."""
    spec_file = engine_dir / ENGINE_FILE
    spec = json.loads(spec_file.read_text()) if spec_file.is_file() else {}
    cpu_dir = spec.get("cpu_model_dir")
    drop = not keep_cpu_weights and cpu_dir and cpu_dir != spec.get("model_dir")
    skip = {"manifest.json"} | ({str(cpu_dir)} if drop else set())
    shutil.copytree(engine_dir, dest, ignore=lambda folder, names: [
        n for n in names if n in skip and Path(folder) == engine_dir])
    if drop:
        spec = {k: v for k, v in spec.items() if k not in ("cpu_model_dir", "cpu_quantization")}
        (dest / ENGINE_FILE).write_text(json.dumps(spec, indent=2) + "\n")


def build(engine_dir: Path, out: Path, problems_csv: Path, serving: ServingSpec, wheels: str = "project",
          dataset_name: str = "aimo-trt", problems: int = 50, competition: str = "aimo3",
          python_version: str = KAGGLE_PYTHON, trtllm_wheels: Optional[Path] = None,
          answer_range: Optional[int] = None) -> dict:
    """Write the dataset folder `out` (its name on Kaggle: `dataset_name`) for `engine_dir` served with
    `serving` (the recipe's section, as written: the notebook's environment may override it there);
    checks first, so a bad input leaves nothing half-written."""
    from server.engine_check import check_engine_folder
    from server.problems import read_problems

    if not DATASET_NAME.fullmatch(dataset_name):
        raise ValueError(f"dataset name {dataset_name!r}: use 3-50 lowercase letters, digits and '-' (Kaggle's slug)")
    if competition not in COMPETITIONS:
        raise ValueError(f"competition {competition!r}: one of {', '.join(COMPETITIONS)}")
    python_tag(python_version)
    trtllm = check_engine_folder(engine_dir).get("backend") == "trtllm"
    read_problems(problems_csv)  # a CSV the gateway could not read fails here, with its line
    trt_set = trtllm_wheel_set(trtllm_wheels) if trtllm else []
    if trtllm:
        wheels = "project"  # the TensorRT-LLM set brings its own pinned dependencies (transformers 4.57, ...)
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out / "wheels"), str(ROOT)], check=True)
    pinned: list[str] = []
    if wheels == "runtime":
        pinned = runtime_requirements()
        subprocess.run(download_command(pinned, out / "wheels", python_version), check=True)
    if trt_set:
        (out / "wheels" / TRTLLM_WHEELS_DIR).mkdir()
        for w in trt_set:
            shutil.copy(w, out / "wheels" / TRTLLM_WHEELS_DIR / w.name)
    copy_engine(engine_dir, out / "engine", keep_cpu_weights=serving.device == "cpu")
    (out / SERVING_FILE).write_text(json.dumps(to_data(serving), indent=2) + "\n")
    shutil.copy(problems_csv, out / "problems.csv")
    (out / "aimo_trt.ipynb").write_text(json.dumps(notebook(dataset_name, problems, competition, trtllm, answer_range),
                                                   indent=1) + "\n")
    info = {"project": "aimo-trt", "dataset": dataset_name, "answer_range": answer_range,
            "wheels": sorted(p.name for p in (out / "wheels").glob("*.whl")), "pinned": pinned, "mode": wheels,
            "backend": "trtllm" if trtllm else "embedded", "trtllm_wheels": [w.name for w in trt_set],
            "engine": str(engine_dir), "competition": competition, "python": python_version, "size_bytes": sum(
                p.stat().st_size for p in out.rglob("*") if p.is_file())}
    (out / "dataset.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
