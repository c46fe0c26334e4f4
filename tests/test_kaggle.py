"""The Kaggle runner: predict (the real gateway's calling convention and types, answers in range, input
robustness, loud start failures, engine liveness and restart), broken engine folders, and the
generated notebook executed headlessly offline (nbclient) on a tiny model against the faithful test
double of Kaggle's kaggle_evaluation (tests/kaggle_double)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from pathlib import Path

import polars as pl
import pytest

from engine_double import ScriptedEngine
from server.engine_check import EngineFolderError
from server.kaggle.predict import EngineStartError, Predictor
from aimo_spec.protocol import Final
from small_recipes import write_recipe
from trtbuild.build import engine_config
from aimo_spec.recipe import ServingSpec, load_recipe, parse_section

ROOT = Path(__file__).resolve().parents[1]


def serving_spec(**serving) -> ServingSpec:
    """The serving settings these tests run with: short replies, two samples, a short budget."""
    data = {"sampling": {"max_tokens": 24}, "solver": {"samples": 2, "early_stop_first": 2, "early_stop_agree": 2,
                                                       "enough_finished": 2, "vote": "majority"},
            "budget": {"policy": "aimo2", "base_seconds": 20, "max_extra_seconds": 10}, **serving}
    return parse_section(data, ServingSpec, "serving", "<test>")


def engine_folder(tmp_path: Path, tiny_models=None) -> Path:
    """An engine folder like build/embedded/: engine.json (+ the tiny model when given)."""
    sources = {"cot": {"kind": "hf", "path": str(tiny_models["llama-cot"]) if tiny_models else "a"},
               "tir": {"kind": "hf", "path": str(tiny_models["llama-tir"]) if tiny_models else "b"}}
    recipe = load_recipe(write_recipe(tmp_path, "kg", sources), check_paths=False)
    out = tmp_path / "engine"
    out.mkdir()
    (out / "engine.json").write_text(json.dumps(engine_config(recipe, "embedded")))
    if tiny_models:
        shutil.copytree(tiny_models["llama-tir"], out / "model")
    return out


def boxed(answer: str):
    return lambda prompt, request: [f"\\boxed{{{answer}}}"]  # short: one character per token, max_tokens 24


def csv_row(tmp_path: Path, text: str = "id,problem,answer\n7,What is 6 times 7?,42\n"):
    """One row as the real gateway passes it: polars' inferred types, one Series per column."""
    f = tmp_path / "row.csv"
    f.write_text(text)
    return list(next(pl.read_csv(f).iter_slices(n_rows=1)))


def series(pid, text):
    return pl.Series("id", [pid]), pl.Series("problem", [text])


def scripted(tmp_path, answer="1042", logs=None, **kw):
    made = []

    def factory():
        made.append(ScriptedEngine(boxed(answer)))
        return made[-1]
    p = Predictor(engine_folder(tmp_path), serving=serving_spec(), problems=3, engine_factory=factory,
                  log=(logs.append if logs is not None else lambda m: None), **kw)
    return p, made


def test_predict_takes_one_series_per_csv_column_and_returns_the_id_as_given(tmp_path):
    made = []

    def factory():
        made.append(ScriptedEngine(boxed("1042")))
        return made[-1]
    p = Predictor(engine_folder(tmp_path), serving=serving_spec(solver={"modulus": 1000, "samples": 2,
                                                                        "early_stop_first": 2, "early_stop_agree": 2,
                                                                        "enough_finished": 2}),
                  problems=3, engine_factory=factory, log=lambda m: None)
    assert not made  # nothing loaded before the first call
    row = csv_row(tmp_path)
    assert [s.name for s in row] == ["id", "problem", "answer"] and row[0].dtype == pl.Int64
    df = p.predict(*row)  # three positional Series: the answer column is ignored
    assert df.columns == ["id", "answer"] and df.shape == (1, 2)
    assert df["id"].dtype == pl.Int64 and df["id"].equals(row[0])  # AIMO-2's gateway compares the ids
    assert df["answer"].dtype == pl.Int64 and df["answer"][0] == 42  # 1042 mod 1000
    p.predict(*series("q2", "again"))
    assert len(made) == 1 and p.budget.done == 2
    assert set(p.timings) == {"first_call", "first_answer"}
    p.close()


@pytest.mark.parametrize("competition,answer_range,raw,expected", [
    ("aimo3", None, str(10 ** 30), 10 ** 30 % 100000), ("aimo2", None, "123456", 456),
    ("aimo3", 1000, "-3", 997), ("aimo3", None, "99999", 99999)])
def test_answers_are_in_the_competitions_range_and_never_wider_than_int64(tmp_path, competition, answer_range, raw,
                                                                         expected):
    p, _ = scripted(tmp_path, answer=raw, competition=competition, answer_range=answer_range)
    df = p.predict(*series("q", "x"))
    assert df["answer"][0] == expected and df["answer"].dtype == pl.Int64
    df.to_arrow()  # what the relay does: an Int128 column fails here
    p.close()


def test_predict_reads_frames_pandas_and_plain_values(tmp_path):
    import pandas as pd

    p, made = scripted(tmp_path, answer="5")
    frame = pl.DataFrame({"id": ["a", "b"], "problem": ["one", "two"], "answer": [1, 2]})
    assert p.predict(frame).rows() == [("a", 5), ("b", 5)]
    assert p.predict(pd.DataFrame({"id": [3], "problem": ["three"]})).rows() == [(3, 5)]
    assert p.predict(pd.Series([4], name="id"), pd.Series(["four"], name="problem")).rows() == [(4, 5)]
    assert p.predict("e", "five").rows() == [("e", 5)]
    empty = p.predict(pl.Series("id", [], dtype=pl.Int64), pl.Series("problem", [], dtype=pl.String))
    assert empty.shape == (0, 2) and empty.columns == ["id", "answer"]
    with pytest.raises(ValueError, match="without columns id and problem"):
        p.predict(pl.DataFrame({"x": [1]}))
    with pytest.raises(ValueError, match="2 ids but 1 problems"):
        p.predict(pl.Series("id", [1, 2]), pl.Series("problem", ["a"]))
    p.close()


def test_a_null_or_oversized_problem_is_answered_by_default_without_the_engine(tmp_path):
    logs = []
    p, made = scripted(tmp_path, answer="5", logs=logs)
    assert p.predict(pl.Series("id", [1]), pl.Series("problem", [None], dtype=pl.String))["answer"][0] == 0
    assert any("null or empty" in m for m in logs)
    huge = "x" * 1_000_000  # a 1 MB problem: over max_input_len (256 in the test recipes)
    assert p.predict(*series("big", huge))["answer"][0] == 0
    assert any("over the engine's max_input_len 256" in m for m in logs)
    assert len(made) == 1 and p.restarts == 0 and not made[0].requests  # never asked, never restarted
    assert p.predict(*series("ok", "fine"))["answer"][0] == 5
    p.close()


def test_an_engine_that_cannot_load_fails_loudly_instead_of_answering_zeros(tmp_path):
    def broken():
        raise RuntimeError("CUDA out of memory")
    p = Predictor(engine_folder(tmp_path), serving=serving_spec(), problems=2, engine_factory=broken,
                  log=lambda m: None)
    with pytest.raises(EngineStartError, match="could not be loaded: RuntimeError: CUDA out of memory"):
        p.predict(*series("q1", "x"))
    p.close()


def test_a_sandbox_that_cannot_start_is_reported_as_the_sandbox(tmp_path, monkeypatch):
    import server.assembly

    def no_pool(tool, **config):
        raise OSError("bwrap: permission denied")
    monkeypatch.setattr(server.assembly, "sandbox_for", no_pool)
    p, made = scripted(tmp_path)
    with pytest.raises(EngineStartError, match="sandbox pool could not start: OSError: bwrap"):
        p.predict(*series("q1", "x"))
    assert not made  # not misreported as "no engine"


def test_broken_engine_folders_fail_when_the_predictor_is_made(tmp_path, tiny_models):
    good = engine_folder(tmp_path, tiny_models)
    Predictor(good, problems=1)  # checks only: nothing loads

    def broken(name, damage):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        damage(folder)
        return folder
    weights = sorted((good / "model").glob("*.safetensors"))[0].name
    cases = [
        (broken("json", lambda f: (f / "engine.json").write_text('{"backend": "emb')), "engine.json: not valid JSON"),
        (broken("nomodel", lambda f: shutil.rmtree(f / "model")), "model: missing"),
        (broken("trunc", lambda f: (f / "model" / weights).write_bytes((f / "model" / weights).read_bytes()[:-100])),
         "truncated or corrupt copy"),
        (broken("header", lambda f: (f / "model" / weights).write_bytes(b"\x10\x00")), "truncated safetensors"),
    ]
    for folder, words in cases:
        with pytest.raises(EngineFolderError, match=words):
            Predictor(folder, problems=1)
    trt = broken("trt", lambda f: None)
    spec = json.loads((trt / "engine.json").read_text())
    (trt / "engine.json").write_text(json.dumps({**spec, "backend": "trtllm", "engine_dir": "engine"}))
    with pytest.raises(EngineFolderError, match="engine/config.json: missing"):
        Predictor(trt, problems=1)


class DyingEngine(ScriptedEngine):
    """Test double: its first life fails every request and reports itself dead."""

    def __init__(self, die: bool):
        super().__init__(boxed("5"))
        self.die = die

    @property
    def alive(self) -> bool:
        return not self.die

    async def generate(self, request):
        if self.die:
            yield Final(request.request_id, "error", "", (), 1, error="engine thread crashed")
            return
        async for ev in super().generate(request):
            yield ev


def test_a_dead_engine_is_restarted_and_the_problem_continues_from_fresh_samples(tmp_path):
    lives = []

    def factory():
        lives.append(DyingEngine(die=not lives))
        return lives[-1]
    logs = []
    p = Predictor(engine_folder(tmp_path), serving=serving_spec(), problems=2, engine_factory=factory,
                  log=logs.append)
    assert p.predict(*series("q1", "x"))["answer"][0] == 5
    assert len(lives) == 2 and p.restarts == 1 and any("restarting" in m for m in logs)
    p.close()


def kill_engine_thread(engine) -> None:
    """A fault inside the scheduler thread outside its per-step guard (a malformed inbox message)."""
    engine._inbox.put(("call", None))
    engine._thread.join(timeout=10)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the test
def test_the_embedded_engine_reports_a_dead_thread_and_fails_its_requests_at_once(tiny_models):
    from server.embedded.engine import EmbeddedEngine
    from aimo_spec.protocol import Request, SamplingParams

    engine = EmbeddedEngine.from_dir(tiny_models["llama-tir"], max_seq_len=128, device="cpu")
    assert engine.alive and engine.ready
    kill_engine_thread(engine)
    assert not engine._thread.is_alive() and not engine.alive and not engine.ready

    async def one():
        req = Request("hello", SamplingParams(max_tokens=8), "r1")
        return [ev async for ev in engine.generate(req)][-1]
    t0 = time.monotonic()
    final = asyncio.run(asyncio.wait_for(one(), timeout=10))
    assert final.finish_reason == "error" and "engine thread" in final.error and time.monotonic() - t0 < 5
    asyncio.run(engine.close())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_predictor_restarts_an_embedded_engine_whose_thread_died(tmp_path, tiny_models):
    from server.embedded.engine import EmbeddedEngine

    lives = []

    def factory():
        lives.append(EmbeddedEngine.from_dir(tiny_models["llama-tir"], max_seq_len=128, device="cpu"))
        return lives[-1]
    logs = []
    p = Predictor(engine_folder(tmp_path), serving=serving_spec(), problems=3, engine_factory=factory,
                  log=logs.append)
    p.predict(*series("q1", "What is 1 plus 1?"))
    kill_engine_thread(lives[0])
    t0 = time.monotonic()
    p.predict(*series("q2", "What is 2 plus 2?"))
    assert len(lives) == 2 and p.restarts == 1 and any("found dead" in m for m in logs)
    assert time.monotonic() - t0 < p.serving.budget.base_seconds  # not a wait for the deadline
    p.close()


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
    assert double["core"] == "0.9.0" and double["competition"] == "aimo3"  # under AIMO-3's rules (plain-function listener)
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


def test_an_engine_that_dies_and_cannot_be_restarted_fails_loudly(tmp_path):
    lives = []

    def factory():
        if lives:
            raise RuntimeError("CUDA error: an illegal memory access")
        lives.append(DyingEngine(die=False))
        return lives[-1]
    p = Predictor(engine_folder(tmp_path), serving=serving_spec(), problems=3, engine_factory=factory,
                  log=lambda m: None)
    assert p.predict(*series("q1", "x"))["answer"][0] == 5
    lives[0].die = True  # found dead before the next problem
    with pytest.raises(EngineStartError, match="illegal memory access"):
        p.predict(*series("q2", "x"))
    p.close()


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
