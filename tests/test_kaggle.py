"""The Kaggle runner's predict: the real gateway's calling convention and types, answers in range, input
robustness, loud start failures, engine liveness and restart, and broken engine folders. What `make
kaggle` ships (the generated notebook executed headlessly offline against the faithful test double of
Kaggle's kaggle_evaluation, the TensorRT-LLM wheel set, the wheels' target Python) is in
test_kaggle_package.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import polars as pl
import pytest
from engine_double import ScriptedEngine
from kaggle_kit import engine_folder, serving_spec

from aimo_spec.protocol import Final
from server.engine_check import EngineFolderError
from server.kaggle.predict import EngineStartError, Predictor


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
    p = Predictor(engine_folder(tmp_path),
                  serving=serving_spec(solver={"modulus": 1000, "samples": 2, "early_stop_first": 2,
                                               "early_stop_agree": 2, "enough_finished": 2}),
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
    p = Predictor(engine_folder(tmp_path), serving=serving_spec(), problems=2, engine_factory=factory, log=logs.append)
    assert p.predict(*series("q1", "x"))["answer"][0] == 5
    assert len(lives) == 2 and p.restarts == 1 and any("restarting" in m for m in logs)
    p.close()


def kill_engine_thread(engine) -> None:
    """A fault inside the scheduler thread outside its per-step guard (a malformed inbox message)."""
    engine._inbox.put(("call", None))
    engine._thread.join(timeout=10)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the test
def test_the_embedded_engine_reports_a_dead_thread_and_fails_its_requests_at_once(tiny_models):
    from aimo_spec.protocol import Request, SamplingParams
    from server.embedded.engine import EmbeddedEngine

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
    # a deadline far from what the restart and a two-sample solve take even on a loaded box
    budget = {"policy": "aimo2", "base_seconds": 300, "max_extra_seconds": 10}
    p = Predictor(engine_folder(tmp_path), serving=serving_spec(budget=budget), problems=3, engine_factory=factory,
                  log=logs.append)
    p.predict(*series("q1", "What is 1 plus 1?"))
    kill_engine_thread(lives[0])
    t0 = time.monotonic()
    p.predict(*series("q2", "What is 2 plus 2?"))
    assert len(lives) == 2 and p.restarts == 1 and any("found dead" in m for m in logs)
    assert time.monotonic() - t0 < p.serving.budget.base_seconds  # not a wait for the deadline
    p.close()


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


def test_with_the_runs_time_spent_a_problem_is_answered_at_once(tmp_path):
    """Samples started with no time left only overrun the run (35 s a problem with an engine that ignored its
    deadline): the default answer comes back without asking the engine, and the problem still counts as done."""
    logs = []
    p, made = scripted(tmp_path, logs=logs)
    p.predict(*series("q1", "first"))
    asked = len(made[0].finals)
    p.budget.allowance = lambda: 0.0
    df = p.predict(*series("q2", "second"))
    assert df["answer"][0] == p.clamp(p.serving.solver.default_answer) and len(made[0].finals) == asked
    assert p.budget.done == 2 and any("q2: no time left in the run" in m for m in logs)
    p.close()


def test_cancelled_samples_get_less_grace_once_the_deadline_has_passed():
    from server.solver import CANCEL_GRACE, LATE_CANCEL_GRACE, cancel_grace

    assert cancel_grace(None, 100.0) == CANCEL_GRACE and cancel_grace(1000.0, 100.0) == CANCEL_GRACE
    assert cancel_grace(110.0, 100.0) == 10.0  # no longer than the problem has left ...
    assert cancel_grace(90.0, 100.0) == LATE_CANCEL_GRACE < CANCEL_GRACE  # ... and only a little past it


def test_a_binary_problem_column_is_read_as_its_text():
    from server.kaggle.rows import read_rows

    rows = read_rows((pl.Series("id", ["a", "b"]), pl.Series("problem", [b"What is 2 + 2?", b"\xff1 + 1"])))
    assert rows.texts == ["What is 2 + 2?", "\ufffd1 + 1"]
