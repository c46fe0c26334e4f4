"""`make kaggle`: the generated notebook executed headlessly offline (nbclient) on a tiny model against
the faithful test double of Kaggle's kaggle_evaluation (tests/kaggle_double), the TensorRT-LLM wheel
set and its offline install, input checks before anything is written, execute's temporary install
folder, and the wheels' target Python (KAGGLE_PYTHON). Predict itself is test_kaggle.py."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import polars as pl
import pytest
from kaggle_kit import ROOT, engine_folder, serving_spec
from small_recipes import write_recipe

from aimo_spec.recipe import load_recipe
from server.engine_check import EngineFolderError
from server.kaggle.predict import Predictor
from trtbuild.build import engine_config


def test_generated_notebook_runs_against_the_faithful_gateway_on_the_shipped_problems(tiny_models, tmp_path,
                                                                                      monkeypatch):
    """`make kaggle`'s folder, executed headlessly with the test double of Kaggle's kaggle_evaluation on
    the path: the notebook imports it, its run_local_gateway calls predict(*row) with the shipped CSV's
    three columns, validates each answer and writes submission.parquet."""
    from server.kaggle.execute import execute
    from server.kaggle.package import build

    shipped = ROOT / "engines" / "problems" / "smoke.csv"
    n = len(shipped.read_text().strip().splitlines()) - 1
    dataset = tmp_path / "input" / "datasets" / "someone" / "aimo-trt-smoke"  # found by the notebook, not told
    info = build(engine_folder(tmp_path, tiny_models), dataset, shipped, serving_spec(), wheels="project", problems=n,
                 dataset_name="aimo-trt-smoke")
    assert [w.startswith("aimo_trt-") for w in info["wheels"]] == [True] and info["dataset"] == "aimo-trt-smoke"
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests" / "kaggle_double"))
    monkeypatch.setenv("KAGGLE_DOUBLE_SEED", "1")
    out, site = tmp_path / "working", tmp_path / "site"
    report = execute(dataset, out, site=site, problems=n, samples=2, timeout=900,
                     env={"AIMO_TRT_DATASET": "", "AIMO_KAGGLE_INPUT": str(tmp_path / "input")})
    assert report["error"] is None, report["error"]
    assert "kaggle_evaluation:" in report["printed"] and str(ROOT / "tests" / "kaggle_double") in report["printed"]
    double = report["double_report"]
    assert double["error"] is None and len(double["calls"]) == n
    # under AIMO-3's rules (plain-function listener)
    assert double["core"] == "0.9.0" and double["competition"] == "aimo3"
    assert all(c["args"] == ["id", "problem", "answer"] for c in double["calls"])
    assert report["problems"] == n and not report["missing"] and report["scored"] == n
    sub = pl.read_parquet(out / "submission.parquet")
    assert sub.columns == ["id", "answer"] and sub["answer"].dtype == pl.Int64
    assert sub["answer"].is_between(0, 99999).all()
    assert (site / "server" / "kaggle" / "predict.py").is_file()  # the notebook ran the installed wheel
    first = double["calls"][0]["started_after_import"]
    times = report["aimo_trt_timings"]
    assert 0 < first < report["notebook_seconds"] and 0 < times["first_call"] <= times["first_answer"]
    assert double["startup_warning"] is False
    print(f"notebook: first predict {first}s after kaggle_evaluation was imported ({times['first_call']}s after the "
          f"first cell), first answer {times['first_answer']}s; {report['correct']}/{report['scored']} correct; "
          f"{report['notebook_seconds']}s in all")


def test_the_notebook_in_a_rerun_without_kaggle_evaluation_fails_at_its_first_cell(tmp_path, tiny_models,
                                                                                   monkeypatch):
    from server.kaggle.execute import execute
    from server.kaggle.package import build

    problems = tmp_path / "p.csv"
    problems.write_text("id,problem,answer\n1,one,1\n")
    dataset = tmp_path / "aimo-trt"
    build(engine_folder(tmp_path, tiny_models), dataset, problems, serving_spec(), wheels="project", problems=1)
    monkeypatch.setenv("KAGGLE_IS_COMPETITION_RERUN", "1")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    out = tmp_path / "working"
    report = execute(dataset, out, site=tmp_path / "site", timeout=120, env={"AIMO_KAGGLE_INPUT": str(tmp_path)})
    assert report["error"] and "the scored rerun needs kaggle_evaluation" in report["error"]
    assert not (out / "submission.parquet").exists() and "installed" not in report["printed"]


def test_the_dataset_carries_the_recipes_serving_settings_not_the_engine_folders(tmp_path, tiny_models, monkeypatch):
    """engine.json holds only what the build decided: `make kaggle` writes the recipe's serving section
    beside engine/ and the predictor reads it there; a stale copy in an old engine.json is ignored."""
    from server.embedded.settings import serving_settings
    from server.kaggle import package
    from server.kaggle.predict import SERVING_FILE

    problems = tmp_path / "p.csv"
    problems.write_text("id,problem,answer\na,one,1\n")
    engine = engine_folder(tmp_path, tiny_models)
    spec = json.loads((engine / "engine.json").read_text())
    (engine / "engine.json").write_text(json.dumps({**spec, "serving": {"solver": {"samples": 9}}}))
    monkeypatch.setattr(package.subprocess, "run", lambda *a, **kw: None)  # no wheels: not what is tested here
    dataset = tmp_path / "aimo-trt"
    serving = serving_spec(solver={"samples": 3, "early_stop_first": 2, "early_stop_agree": 2, "enough_finished": 3,
                                   "vote": "entropy"})
    package.build(engine, dataset, problems, serving)
    p = Predictor(dataset / "engine", serving=dataset / SERVING_FILE, problems=1, engine_factory=lambda: None)
    assert p.serving == serving_settings(serving) and p.serving.solver.samples == 3
    (dataset / SERVING_FILE).write_text('{"solver": {"vote": "median"}}')
    with pytest.raises(ValueError, match="serving.json: serving.solver.vote"):
        Predictor(dataset / "engine", serving=dataset / SERVING_FILE, problems=1)
    with pytest.raises(FileNotFoundError, match="make kaggle"):
        Predictor(dataset / "engine", serving=tmp_path / "nowhere.json", problems=1)


# ------------------------------------------------------------------ make kaggle BACKEND=trtllm
def trtllm_engine_folder(tmp_path: Path) -> Path:
    """A build/trtllm/ folder as `make engine BACKEND=trtllm` leaves it (engine.json, engine/, model/)."""
    sources = {"cot": {"kind": "hf", "path": "a"}, "tir": {"kind": "hf", "path": "b"}}
    recipe = load_recipe(write_recipe(tmp_path, "kgt", sources, build={"backend": "trtllm"}), check_paths=False)
    out = tmp_path / "trtllm-engine"
    (out / "engine").mkdir(parents=True)
    (out / "engine" / "rank0.engine").write_bytes(b"plan")
    (out / "engine" / "config.json").write_text("{}")
    (out / "model").mkdir()
    (out / "model" / "tokenizer.json").write_text("{}")
    (out / "engine.json").write_text(json.dumps(engine_config(recipe, "trtllm")))
    return out


def wheel_set(tmp_path: Path, names=("tensorrt_llm-1.2.1-cp312-cp312-linux_x86_64.whl",
                                     "transformers-4.57.3-py3-none-any.whl")) -> Path:
    d = tmp_path / "trtllm-wheels"
    d.mkdir()
    for n in names:
        (d / n).write_bytes(b"wheel")
    return d


def test_a_trtllm_engine_without_the_tensorrt_llm_wheels_fails_clearly(tmp_path):
    from server.kaggle.package import build

    problems = tmp_path / "p.csv"
    problems.write_text("id,problem,answer\na,one,1\n")
    eng = trtllm_engine_folder(tmp_path)
    with pytest.raises(ValueError, match="TRTLLM_WHEELS"):
        build(eng, tmp_path / "out", problems, serving_spec())
    with pytest.raises(ValueError, match="no tensorrt_llm-1.2.x"):
        build(eng, tmp_path / "out", problems, serving_spec(),
              trtllm_wheels=wheel_set(tmp_path, ("torch-2.9.1-cp312-none.whl",)))
    assert not (tmp_path / "out").exists()


def test_trtllm_kaggle_folder_ships_the_wheel_set_and_the_notebook_installs_it_offline(tmp_path):
    from server.kaggle.package import build

    problems = tmp_path / "p.csv"
    problems.write_text("id,problem,answer\na,one,1\n")
    out = tmp_path / "aimo-trt"
    info = build(trtllm_engine_folder(tmp_path), out, problems, serving_spec(), wheels="runtime",
                 trtllm_wheels=wheel_set(tmp_path))
    assert info["backend"] == "trtllm" and info["mode"] == "project"  # TensorRT-LLM's set brings its own pins
    assert sorted(p.name for p in (out / "wheels" / "trtllm").iterdir()) == [
        "tensorrt_llm-1.2.1-cp312-cp312-linux_x86_64.whl", "transformers-4.57.3-py3-none-any.whl"]
    assert [w.startswith("aimo_trt-") for w in info["wheels"]] == [True]
    assert json.loads((out / "engine" / "engine.json").read_text())["backend"] == "trtllm"
    assert (out / "engine" / "engine" / "rank0.engine").is_file()
    cells = ["".join(c["source"]) for c in json.loads((out / "aimo_trt.ipynb").read_text())["cells"]]
    install = [i for i, c in enumerate(cells) if "--find-links" in c]
    predictor = [i for i, c in enumerate(cells) if "Predictor(" in c]
    assert len(install) == 1 and install[0] < predictor[0]
    text = cells[install[0]]
    assert '"--no-index"' in text and '"wheels", "trtllm"' in text and "tensorrt-llm>=1.2,<1.3" in text
    assert '"--target", SITE' in text and "http" not in text


def test_make_kaggle_trtllm_without_wheels_stops_before_any_work():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["make", "-s", "kaggle", "BACKEND=trtllm", "TRTLLM_WHEELS="], cwd=root,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "set TRTLLM_WHEELS" in proc.stdout + proc.stderr


def test_make_kaggle_checks_its_inputs_before_writing_anything(tmp_path, tiny_models):
    from server.kaggle.package import build

    problems = tmp_path / "p.csv"
    problems.write_text("id,problem,answer\na,one,1\n")
    good = engine_folder(tmp_path, tiny_models)
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    shutil.rmtree(broken / "model")
    out = tmp_path / "out"
    with pytest.raises(EngineFolderError, match="model: missing"):
        build(broken, out, problems, serving_spec())
    with pytest.raises(ValueError, match="dataset name 'My Set!'"):
        build(good, out, problems, serving_spec(), dataset_name="My Set!")
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_bytes(b"id,problem\na,caf\xe9\n")
    with pytest.raises(ValueError, match="bad.csv: line 2: not UTF-8"):
        build(good, out, bad_csv, serving_spec())
    assert not out.exists()


# ------------------------------------------------------------------ execute: its temporary install folder
def small_notebook(folder: Path, *cells: str) -> Path:
    """A dataset folder whose aimo_trt.ipynb is just `cells` (what execute() runs; no wheels, no engine)."""
    import nbformat

    folder.mkdir(parents=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(nb, str(folder / "aimo_trt.ipynb"))
    return folder


def test_execute_removes_the_site_folder_it_made_also_when_the_run_fails(tmp_path, monkeypatch):
    """`make kaggle` once left a ~480 MB aimo-trt-site-* folder in /tmp on every run."""
    from server.kaggle.execute import SITE_PREFIX, execute

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp))  # where TemporaryDirectory/mkdtemp put folders
    fill = "import os; open(os.path.join(os.environ['AIMO_TRT_SITE'], 'wheel.bin'), 'wb').write(b'x' * 1000)"
    ok = small_notebook(tmp_path / "ok", fill, "print('site', os.environ['AIMO_TRT_SITE'])")
    bad = small_notebook(tmp_path / "bad", fill, "raise RuntimeError('the engine could not load')")
    report = execute(ok, tmp_path / "out-ok", timeout=120)
    assert report["error"] is None and f"site {tmp}{os.sep}{SITE_PREFIX}" in report["printed"]
    report = execute(bad, tmp_path / "out-bad", timeout=120)
    assert "the engine could not load" in report["error"]
    with pytest.raises(FileNotFoundError):
        execute(tmp_path / "no-notebook", tmp_path / "out-none", timeout=120)
    assert sorted(p.name for p in tmp.iterdir()) == []
    kept = tmp_path / "my-site"
    kept.mkdir()
    execute(ok, tmp_path / "out-kept", site=kept, timeout=120)
    assert (kept / "wheel.bin").is_file()  # a folder the caller passed is the caller's


# ------------------------------------------------------------------ the wheels' target Python (KAGGLE_PYTHON)
def fake_wheel(folder: Path, name: str, tag: str) -> None:
    """A minimal wheel file (metadata only): enough for pip to choose among wheels by their tags."""
    import zipfile

    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{name}-1.0-{tag}.whl", "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n")
        z.writestr(f"{info}/RECORD", "")


def test_the_wheels_are_downloaded_for_the_chosen_python(tmp_path):
    """The command carries the version and its ABI; run offline against a folder of wheels, pip picks the
    chosen Python's binary wheel (and pure-Python / abi3 ones), not this interpreter's."""
    import subprocess

    from server.kaggle.package import KAGGLE_PYTHON, download_command

    assert KAGGLE_PYTHON == "3.11"
    cmd = download_command(["foo==1.0"], tmp_path / "w")
    assert " --python-version 3.11 --implementation cp --abi cp311 " in " ".join(cmd)
    assert cmd[cmd.index("-d") + 1] == str(tmp_path / "w") and cmd[-1] == "foo==1.0"
    index = tmp_path / "index"
    index.mkdir()
    for minor in (11, 12):
        fake_wheel(index, "foo", f"cp3{minor}-cp3{minor}-manylinux_2_17_x86_64")
    fake_wheel(index, "bar", "py3-none-any")
    fake_wheel(index, "baz", "cp39-abi3-manylinux_2_28_x86_64")
    for version in ("3.11", "3.12"):
        cmd = download_command(["foo==1.0", "bar==1.0", "baz==1.0"], tmp_path / version, version)
        offline = [*cmd[:4], "--no-index", "--find-links", str(index), *cmd[4:]]
        subprocess.run(offline, check=True, capture_output=True)
        tag = "cp" + version.replace(".", "")
        assert sorted(p.name for p in (tmp_path / version).iterdir()) == [
            "bar-1.0-py3-none-any.whl", "baz-1.0-cp39-abi3-manylinux_2_28_x86_64.whl",
            f"foo-1.0-{tag}-{tag}-manylinux_2_17_x86_64.whl"]


@pytest.mark.parametrize("bad", ["3.x", "311", "3.11.4", "2.7", "", "3.011", " 3.11"])
def test_a_malformed_python_version_is_refused_before_anything_is_written(tmp_path, bad):
    from server.kaggle.package import build, download_command

    problems = tmp_path / "p.csv"
    problems.write_text("id,problem,answer\na,one,1\n")
    with pytest.raises(ValueError, match=rf"python version {re.escape(repr(bad))}: use 3.MINOR, e.g. 3.11"):
        build(engine_folder(tmp_path), tmp_path / "out", problems, serving_spec(), python_version=bad)
    with pytest.raises(ValueError, match="use 3.MINOR"):
        download_command([], tmp_path, bad)
    assert not (tmp_path / "out").exists()


def test_make_kaggle_passes_kaggle_python_and_refuses_a_malformed_one_before_any_work():
    import subprocess

    dry = subprocess.run(["make", "-n", "kaggle", "KAGGLE_PYTHON=3.12"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0 and "--python-version 3.12" in dry.stdout
    assert "--python-version 3.11" in subprocess.run(["make", "-n", "kaggle"], cwd=ROOT, capture_output=True,
                                                     text=True).stdout
    proc = subprocess.run(["make", "-s", "kaggle", "KAGGLE_PYTHON=3.x"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "KAGGLE_PYTHON must be 3.MINOR" in proc.stdout + proc.stderr


@pytest.mark.parametrize("device", ["auto", "cuda", "cpu"])
def test_the_package_leaves_the_cpu_weights_behind_unless_the_notebook_serves_on_the_cpu(tmp_path, device):
    from server.kaggle.package import copy_engine

    engine = tmp_path / "embedded"
    for folder in ("model", "cpu_model", "drafter"):
        (engine / folder).mkdir(parents=True)
        (engine / folder / "weights.bin").write_bytes(b"w")
    (engine / "manifest.json").write_text("{}")
    spec = {"backend": "embedded", "model_dir": "model", "cpu_model_dir": "cpu_model",
            "cpu_quantization": "gguf_q8_0", "drafter_dir": "drafter"}
    (engine / "engine.json").write_text(json.dumps(spec))
    copy_engine(engine, tmp_path / "out", keep_cpu_weights=device == "cpu")
    copied = json.loads((tmp_path / "out" / "engine.json").read_text())
    assert (tmp_path / "out" / "model" / "weights.bin").is_file() and (tmp_path / "out" / "drafter").is_dir()
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert (tmp_path / "out" / "cpu_model").is_dir() == (device == "cpu")
    assert ("cpu_model_dir" in copied) == (device == "cpu") and copied["model_dir"] == "model"
    assert json.loads((engine / "engine.json").read_text()) == spec  # the source folder is untouched
