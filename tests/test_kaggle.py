"""The Kaggle runner: predict (always an integer, lazy load, engine restart), the local gateway, and the
generated notebook executed headlessly offline (nbclient) on a tiny model with the local gateway."""

from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path

import polars as pl
import pytest

from engine_double import ScriptedEngine
from server.kaggle import gateway
from server.kaggle.predict import Predictor
from server.protocol import Final
from small_recipes import write_recipe
from trtbuild.build import engine_config
from trtbuild.core.recipe import load_recipe


def engine_folder(tmp_path: Path, tiny_models=None, **serving) -> Path:
    """An engine folder like build/embedded/: engine.json (+ the tiny model when given)."""
    sources = {"cot": {"kind": "hf", "path": str(tiny_models["llama-cot"]) if tiny_models else "a"},
               "tir": {"kind": "hf", "path": str(tiny_models["llama-tir"]) if tiny_models else "b"}}
    serving = {"sampling": {"max_tokens": 24}, "solver": {"samples": 2, "early_stop_first": 2,
                                                          "early_stop_agree": 2, "enough_finished": 2,
                                                          "vote": "majority"},
               "budget": {"policy": "aimo2", "base_seconds": 20, "max_extra_seconds": 10}, **serving}
    recipe = load_recipe(write_recipe(tmp_path, "kg", sources, serving=serving), check_paths=False)
    out = tmp_path / "engine"
    out.mkdir()
    (out / "engine.json").write_text(json.dumps(engine_config(recipe, "embedded")))
    if tiny_models:
        shutil.copytree(tiny_models["llama-tir"], out / "model")
    return out


def boxed(answer: str):
    return lambda prompt, request: [f"\\boxed{{{answer}}}"]  # short: one character per token, max_tokens 24


def series(pid: str, text: str):
    return pl.Series("id", [pid]), pl.Series("problem", [text])


def test_predict_returns_the_vote_as_a_one_row_frame_and_loads_lazily(tmp_path):
    made = []

    def factory():
        made.append(ScriptedEngine(boxed("1042")))
        return made[-1]
    p = Predictor(engine_folder(tmp_path, solver={"modulus": 1000, "samples": 2, "early_stop_first": 2,
                                                  "early_stop_agree": 2, "enough_finished": 2}),
                  problems=3, engine_factory=factory)
    assert not made  # nothing loaded before the first call
    df = p.predict(*series("q1", "What is 6 times 7?"))
    assert df.columns == ["id", "answer"] and df.shape == (1, 2)
    assert df["id"][0] == "q1" and df["answer"][0] == 42 and isinstance(df["answer"][0], int)  # 1042 mod 1000
    p.predict(*series("q2", "again"))
    assert len(made) == 1 and p.budget.done == 2
    p.close()


def test_predict_answers_even_when_everything_fails(tmp_path):
    def broken():
        raise RuntimeError("CUDA out of memory")
    p = Predictor(engine_folder(tmp_path, solver={"default_answer": 7, "samples": 2, "early_stop_first": 2,
                                                  "early_stop_agree": 2, "enough_finished": 2}),
                  problems=2, engine_factory=broken, log=lambda m: None)
    df = p.predict(*series("q1", "x"))
    assert df["answer"][0] == 7
    p.close()


class DyingEngine(ScriptedEngine):
    """Test double: its first life fails every request and reports itself dead."""

    def __init__(self, die: bool):
        super().__init__(boxed("5"))
        self.die = die

    @property
    def ready(self) -> bool:
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
    p = Predictor(engine_folder(tmp_path), problems=2, engine_factory=factory, log=logs.append)
    assert p.predict(*series("q1", "x"))["answer"][0] == 5
    assert len(lives) == 2 and p.restarts == 1 and any("restarting" in m for m in logs)
    p.close()


def test_gateway_shuffles_checks_and_scores(tmp_path):
    problems = tmp_path / "p.csv"
    problems.write_text("id,problem,answer\na,one,1\nb,two,2\nc,three,3\n")
    seen = []

    def predict(id_, problem):
        seen.append(id_.item(0))
        return pl.DataFrame({"id": [id_.item(0)], "answer": [{"one": 1, "two": 2, "three": 0}[problem.item(0)]]})
    report = gateway.run(predict, problems, tmp_path / "out", seed=3, log=lambda m: None)
    assert sorted(seen) == ["a", "b", "c"] and report["correct"] == 2 and report["scored"] == 3
    rows = list(csv.DictReader((tmp_path / "out" / "submission.csv").open()))
    assert sorted(r["id"] for r in rows) == ["a", "b", "c"]

    for bad, words in [(lambda i, p: pl.DataFrame({"answer": [1]}), "columns id, answer"),
                       (lambda i, p: pl.DataFrame({"id": [i.item(0)], "answer": ["1"]}), "must be an integer"),
                       (lambda i, p: pl.DataFrame({"id": ["zz"], "answer": [1]}), "returned the id")]:
        with pytest.raises(gateway.GatewayError, match=words):
            gateway.run(bad, problems, tmp_path / "bad", log=lambda m: None)

    def slow(id_, problem):
        time.sleep(1.0)
        return pl.DataFrame({"id": [id_.item(0)], "answer": [0]})
    with pytest.raises(gateway.GatewayError, match="no answer within"):
        gateway.run(slow, problems, tmp_path / "slow", answer_timeout=0.2, log=lambda m: None)


def test_generated_notebook_runs_offline_end_to_end(tiny_models, tmp_path):
    """`make kaggle`'s folder, executed headlessly: pip --no-index install, predict, local gateway."""
    from server.kaggle.execute import execute
    from server.kaggle.package import build

    problems = tmp_path / "problems.csv"
    problems.write_text("id,problem,answer\np1,What is 6 times 7?,42\np2,What is 2 plus 3?,5\np3,Name a prime.,\n")
    dataset = tmp_path / "aimo-trt"
    info = build(engine_folder(tmp_path, tiny_models), dataset, problems, wheels="project", problems=3)
    assert [w.startswith("aimo_trt-") for w in info["wheels"]] == [True]
    out, site = tmp_path / "working", tmp_path / "site"
    report = execute(dataset, out, site=site, problems=3, samples=2, timeout=600)
    rows = list(csv.DictReader((out / "submission.csv").open()))
    assert sorted(r["id"] for r in rows) == ["p1", "p2", "p3"] and all(r["answer"].lstrip("-").isdigit() for r in rows)
    assert report["problems"] == 3 and report["scored"] == 2
    assert (site / "server" / "kaggle" / "predict.py").is_file()  # the notebook ran the installed wheel
    assert "installed 1 wheels" in report["printed"]
    assert (out / "aimo_trt.executed.ipynb").is_file()


# ------------------------------------------------------------------ make kaggle BACKEND=trtllm
def trtllm_engine_folder(tmp_path: Path) -> Path:
    """A build/trtllm/ folder as `make engine BACKEND=trtllm` leaves it (engine.json, engine/, model/)."""
    sources = {"cot": {"kind": "hf", "path": "a"}, "tir": {"kind": "hf", "path": "b"}}
    recipe = load_recipe(write_recipe(tmp_path, "kgt", sources, build={"backend": "trtllm"}), check_paths=False)
    out = tmp_path / "trtllm-engine"
    (out / "engine").mkdir(parents=True)
    (out / "engine" / "rank0.engine").write_bytes(b"plan")
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
        build(eng, tmp_path / "out", problems)
    with pytest.raises(ValueError, match="no tensorrt_llm-1.2.x"):
        build(eng, tmp_path / "out", problems, trtllm_wheels=wheel_set(tmp_path, ("torch-2.9.1-cp312-none.whl",)))
    assert not (tmp_path / "out").exists()


def test_trtllm_kaggle_folder_ships_the_wheel_set_and_the_notebook_installs_it_offline(tmp_path):
    from server.kaggle.package import build

    problems = tmp_path / "p.csv"
    problems.write_text("id,problem,answer\na,one,1\n")
    out = tmp_path / "aimo-trt"
    info = build(trtllm_engine_folder(tmp_path), out, problems, wheels="runtime", trtllm_wheels=wheel_set(tmp_path))
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
