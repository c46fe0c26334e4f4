"""The gateways `predict` meets: the faithful test double of Kaggle's kaggle_evaluation
(tests/kaggle_double, facts in tests/upstream/kaggle_evaluation.json), this project's local gateway,
which must behave the same way, and the runner that picks between them (the rerun never falls back)."""

from __future__ import annotations

import errno
import functools
import json
import sys
import time
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOUBLE = ROOT / "tests" / "kaggle_double"
FACTS = json.loads((ROOT / "tests" / "upstream" / "kaggle_evaluation.json").read_text())


@pytest.fixture
def double(monkeypatch, tmp_path):
    """The double importable as `kaggle_evaluation`, run in tmp_path (it writes to the working folder)."""
    monkeypatch.syspath_prepend(str(DOUBLE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KAGGLE_DOUBLE_SEED", "0")
    for name in [m for m in sys.modules if m.startswith("kaggle_evaluation")]:
        monkeypatch.delitem(sys.modules, name)
    import kaggle_evaluation.aimo_2_inference_server as a2
    import kaggle_evaluation.aimo_3_inference_server as a3

    yield {"aimo2": a2.AIMO2InferenceServer, "aimo3": a3.AIMO3InferenceServer}
    for name in [m for m in sys.modules if m.startswith("kaggle_evaluation")]:
        del sys.modules[name]  # no other test may find the double by accident


def problems_csv(tmp_path: Path, rows: str = "1,one,1\n2,two,2\n3,three,3\n") -> Path:
    f = tmp_path / "test.csv"
    f.write_text("id,problem,answer\n" + rows)
    return f


def predict(*row):
    """Answers the problem's length; named `predict`, as the real server keys listeners by name."""
    id_, problem = row[0], row[1]
    return pl.DataFrame({"id": id_, "answer": [len(problem[0])]})


good_predict = predict


# ------------------------------------------------------------------ the facts and the double
def test_every_fact_names_its_repository_and_commit():
    assert all(len(s["commit"]) == 40 and s["repo"] and s["path"].startswith("kaggle_evaluation/")
               and s["competition"] in ("aimo2", "aimo3") for s in FACTS["sources"])
    core = {"kaggle_evaluation/core/templates.py", "kaggle_evaluation/core/relay.py",
            "kaggle_evaluation/core/base_gateway.py", "kaggle_evaluation/__init__.py"}
    for competition in ("aimo2", "aimo3"):  # each competition's own core, not one standing in for the other
        paths = {s["path"] for s in FACTS["sources"] if s["competition"] == competition}
        assert core | {f"kaggle_evaluation/{competition[:4]}_{competition[4]}_gateway.py",
                       f"kaggle_evaluation/{competition[:4]}_{competition[4]}_inference_server.py"} <= paths
    versions = {s["competition"]: s["package_version"] for s in FACTS["sources"]
                if s["path"] == "kaggle_evaluation/__init__.py"}
    assert versions == {"aimo2": "0.3.0", "aimo3": "0.9.0"} == {c: v["package_version"]
                                                                for c, v in FACTS["cores"].items()}
    assert FACTS["timeouts"]["response_timeout_seconds"] == {"aimo2": 1800, "aimo3": 32400}


def test_the_double_calls_predict_with_one_series_per_column_and_writes_submission_parquet(double, tmp_path):
    seen = []

    def predict(*row):
        seen.append([(s.name, s.dtype, len(s)) for s in row])
        return good_predict(*row)
    double["aimo3"](predict).run_local_gateway((str(problems_csv(tmp_path)),))
    assert len(seen) == 3 and all(c == [("id", pl.Int64, 1), ("problem", pl.String, 1), ("answer", pl.Int64, 1)]
                                  for c in seen)
    sub = pl.read_parquet(tmp_path / "submission.parquet")
    assert sorted(sub.rows()) == [(1, 3), (2, 3), (3, 5)]


@pytest.mark.parametrize("competition,bad,kind", [
    ("aimo2", lambda *row: pl.DataFrame({"id": [str(row[0][0])], "answer": [1]}), "INVALID_SUBMISSION"),  # str(id)
    ("aimo2", lambda *row: pl.DataFrame({"id": row[0], "answer": [10 ** 30]}), "SERVER_RAISED_EXCEPTION"),  # Int128
    ("aimo2", lambda *row: None, "INVALID_SUBMISSION"),
    ("aimo2", lambda *row: pl.DataFrame({"answer": [1]}), "INVALID_SUBMISSION"),
    ("aimo3", lambda *row: None, "INVALID_SUBMISSION"),
    ("aimo3", lambda *row: pl.DataFrame({"id": [1, 2], "answer": [1, 2]}), "INVALID_SUBMISSION"),  # two rows for one
    ("aimo3", lambda *row: pl.DataFrame({"id": row[0], "answer": [10 ** 30]}), "SERVER_RAISED_EXCEPTION"),  # Int128
    ("aimo3", lambda *row: 7, "GATEWAY_RAISED_EXCEPTION"),  # a bare int passes validation but not write_submission
])
def test_each_double_rejects_what_its_real_gateway_rejects(double, tmp_path, competition, bad, kind):
    """aimo2: what the real gateway rejects; aimo3: what its core rejects."""
    from kaggle_evaluation._double import GatewayRuntimeError

    def predict(*row):
        return bad(*row)
    with pytest.raises(GatewayRuntimeError) as e:
        double[competition](predict).run_local_gateway((str(problems_csv(tmp_path)),))
    assert e.value.kind.name == kind


def test_the_double_refuses_a_two_argument_predict_like_the_real_one(double, tmp_path):
    """The bug of issue 20: predict(id_, problem) given the CSV's three columns."""
    from kaggle_evaluation._double import GatewayRuntimeError

    def predict(id_, problem):
        return pl.DataFrame({"id": id_, "answer": [0]})
    with pytest.raises(GatewayRuntimeError, match="takes 2 positional arguments but 3 were given"):
        double["aimo3"](predict).run_local_gateway((str(problems_csv(tmp_path)),))


@pytest.mark.parametrize("competition,kind", [("aimo2", "SERVER_CONNECTION_FAILED"),
                                              ("aimo3", "GRPC_DEADLINE_EXCEEDED")])
def test_the_double_has_no_deadline_on_the_first_call_and_one_after(double, tmp_path, monkeypatch, competition, kind):
    """A late answer is SERVER_CONNECTION_FAILED in AIMO-2's core and its own GRPC_DEADLINE_EXCEEDED in AIMO-3's."""
    from kaggle_evaluation._double import GatewayRuntimeError

    monkeypatch.setenv("KAGGLE_DOUBLE_TIMEOUT", "0.3")
    calls = []

    def predict(*row):
        calls.append(1)
        time.sleep(0.6 if len(calls) in (1, 2) else 0)  # the first is slow and allowed; the second is late
        return good_predict(*row)
    with pytest.raises(GatewayRuntimeError) as e:
        double[competition](predict).run_local_gateway((str(problems_csv(tmp_path)),))
    assert len(calls) == 2 and e.value.kind.name == kind == FACTS["cores"][competition]["deadline_error"]


# ------------------------------------------------------------------ what AIMO-3's core does differently
class Solver:
    def predict(self, *row):
        return good_predict(*row)


def answer(*row, scale=1):
    return good_predict(*row)


class CallableSolver:
    def __call__(self, *row):
        return good_predict(*row)


@pytest.mark.parametrize("listener,kind", [(Solver().predict, "method"),
                                           (functools.partial(answer, scale=2), "partial"),
                                           (CallableSolver(), "CallableSolver")])
def test_the_aimo3_double_refuses_a_bound_method_or_partial_as_listener_like_the_real_one(double, listener, kind):
    assert FACTS["cores"]["aimo3"]["listeners"]["rule"] == "function"
    with pytest.raises(ValueError, match=f"Endpoint listeners passed to `serve` must be functions, got .*{kind}"):
        double["aimo3"](listener)


def test_the_aimo2_double_takes_any_named_callable_as_the_real_one_does(double, tmp_path):
    double["aimo2"](Solver().predict).run_local_gateway((str(problems_csv(tmp_path)),))  # a bound method serves
    assert pl.read_parquet(tmp_path / "submission.parquet").height == 3
    with pytest.raises(AttributeError):  # upstream reads the listener's __name__, which a partial lacks
        double["aimo2"](functools.partial(answer, scale=2))


def test_the_aimo3_double_overwrites_the_ids_instead_of_comparing_them(double, tmp_path):
    """AIMO-3's gateway puts its own ids into the submission: str(id), or no id column at all, is not refused."""
    def predict(*row):
        return pl.DataFrame({"answer": [len(row[1][0])], "id": [f"x{row[0][0]}"]})
    double["aimo3"](predict).run_local_gateway((str(problems_csv(tmp_path)),))
    sub = pl.read_parquet(tmp_path / "submission.parquet")
    assert sub.columns == ["id", "answer"] and sub["id"].dtype == pl.Int64 and sorted(sub.rows()) == [(1, 3), (2, 3),
                                                                                                      (3, 5)]

    def predict(*row):  # noqa: F811 - the listener must be named predict
        return pl.DataFrame({"answer": [0]})
    double["aimo3"](predict).run_local_gateway((str(problems_csv(tmp_path)),))
    assert sorted(pl.read_parquet(tmp_path / "submission.parquet")["id"].to_list()) == [1, 2, 3]


def test_the_aimo3_double_takes_the_first_free_port_of_its_fallbacks(double, tmp_path, monkeypatch):
    import kaggle_evaluation._double as core

    ports = FACTS["cores"]["aimo3"]["ports"]
    assert ports == [50051, *range(60053, 60063)] and FACTS["cores"]["aimo2"]["ports"] == [50051]
    monkeypatch.setattr(core, "port_is_free", lambda port: port not in (50051, 60053))
    double["aimo3"](good_predict).run_local_gateway((str(problems_csv(tmp_path)),))
    assert json.loads((tmp_path / "double_report.json").read_text())["port"] == 60054
    assert double["aimo2"](good_predict).relay.port == 50051  # AIMO-2 has no fallback
    monkeypatch.setattr(core, "port_is_free", lambda port: False)
    with pytest.raises(ValueError, match=r"None of the expected ports \[50051, 60053, .*60062\] are available"):
        double["aimo3"](good_predict)


@pytest.mark.parametrize("competition", ["aimo3", "aimo2"])
def test_the_runner_hands_the_server_a_plain_function_named_predict(double, tmp_path, competition):
    """So `serve(predictor.predict)` (a bound method) or a partial works under AIMO-3's rules too."""
    from server.kaggle import runner

    for listener in (Solver().predict, functools.partial(answer, scale=2), good_predict):
        (tmp_path / "submission.parquet").unlink(missing_ok=True)
        assert runner.serve(listener, str(problems_csv(tmp_path)), out=str(tmp_path / "ours"),
                            competition=competition) is None
        assert sorted(pl.read_parquet(tmp_path / "submission.parquet").rows()) == [(1, 3), (2, 3), (3, 5)]
    assert runner.as_listener(good_predict) is good_predict


def test_the_double_under_rerun_serves_and_writes_result_json(double, tmp_path, monkeypatch):
    monkeypatch.setenv("KAGGLE_IS_COMPETITION_RERUN", "1")
    monkeypatch.setenv("KAGGLE_DOUBLE_TEST_CSV", str(problems_csv(tmp_path)))
    double["aimo3"](good_predict).serve()
    assert json.loads((tmp_path / "result.json").read_text()) == {"Succeeded": True}


# ------------------------------------------------------------------ the runner
def test_the_rerun_without_kaggle_evaluation_is_an_error_not_the_local_gateway(tmp_path, monkeypatch):
    from server.kaggle import runner

    monkeypatch.setenv("KAGGLE_IS_COMPETITION_RERUN", "1")
    monkeypatch.setattr(runner, "add_kaggle_evaluation_path", lambda roots=(): None)
    for name in ("kaggle_evaluation", *FACTS["servers"]["aimo3"][:1], *FACTS["servers"]["aimo2"][:1]):
        monkeypatch.setitem(sys.modules, name, None)  # import fails (as without grpc)
    with pytest.raises(runner.KaggleServerError, match="must not fall back"):
        runner.serve(good_predict, str(problems_csv(tmp_path)), out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_runner_uses_the_competitions_server_when_it_imports(double, tmp_path, monkeypatch):
    from server.kaggle import runner

    csv = problems_csv(tmp_path)
    assert runner.serve(good_predict, str(csv), out=str(tmp_path / "ours")) is None  # its run_local_gateway ran
    assert (tmp_path / "submission.parquet").is_file() and not (tmp_path / "ours").exists()
    monkeypatch.setenv("KAGGLE_IS_COMPETITION_RERUN", "1")
    monkeypatch.setenv("KAGGLE_DOUBLE_TEST_CSV", str(csv))
    runner.serve(good_predict, str(csv), out=str(tmp_path / "ours"), competition="aimo2")  # serve()
    assert json.loads((tmp_path / "result.json").read_text())["Succeeded"] is True


def test_the_runner_finds_kaggle_evaluation_where_the_competition_data_is_mounted(tmp_path, monkeypatch):
    from server.kaggle import runner

    pkg = tmp_path / "input" / "ai-mathematical-olympiad-progress-prize-3" / "kaggle_evaluation"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert runner.add_kaggle_evaluation_path((str(tmp_path / "input"),)) == str(pkg.parent)
    assert str(pkg.parent) in sys.path


# ------------------------------------------------------------------ this project's local gateway
def test_our_gateway_calls_like_the_real_one_and_scores(tmp_path):
    from server.kaggle import gateway

    seen = []

    def predict(*row):
        seen.append([s.name for s in row])
        return pl.DataFrame({"id": row[0], "answer": [{"one": 1, "two": 2, "three": 0}[row[1][0]]]})
    report = gateway.run(predict, problems_csv(tmp_path), tmp_path / "out", seed=3, log=lambda m: None)
    assert seen == [["id", "problem", "answer"]] * 3 and report["correct"] == 2 and report["scored"] == 3
    sub = pl.read_parquet(tmp_path / "out" / "submission.parquet")
    assert sorted(sub["id"].to_list()) == [1, 2, 3] and sub["id"].dtype == pl.Int64


@pytest.mark.parametrize("bad,words", [
    (lambda *r: pl.DataFrame({"answer": [1]}), "columns id and answer"),
    (lambda *r: pl.DataFrame({"id": r[0], "answer": ["1"]}), "must be an integer"),
    (lambda *r: pl.DataFrame({"id": [str(r[0][0])], "answer": [1]}), "return the id as given"),
    (lambda *r: pl.DataFrame({"id": r[0], "answer": [10 ** 30]}), "cannot be sent back"),
    (lambda *r: pl.DataFrame({"id": r[0], "answer": [100000]}), "outside 0..99999"),
    (lambda *r: None, "returned None"),
])
def test_our_gateway_rejects_what_the_real_one_would(tmp_path, bad, words):
    from server.kaggle import gateway

    with pytest.raises(gateway.GatewayError, match=words):
        gateway.run(bad, problems_csv(tmp_path), tmp_path / "bad", log=lambda m: None)


def test_our_gateway_deadlines_follow_the_competition(tmp_path):
    from server.kaggle import gateway
    from server.kaggle.competitions import COMPETITIONS

    assert {k: c.answer_timeout_seconds for k, c in COMPETITIONS.items()} == \
        {k: float(v) for k, v in FACTS["timeouts"]["response_timeout_seconds"].items()}
    calls = []

    def slow(*row):
        calls.append(1)
        time.sleep(0.5 if len(calls) <= 2 else 0)
        return pl.DataFrame({"id": row[0], "answer": [0]})
    with pytest.raises(gateway.GatewayError, match="no answer within"):
        gateway.run(slow, problems_csv(tmp_path), tmp_path / "slow", answer_timeout=0.2, log=lambda m: None)
    assert len(calls) == 2  # the first call may take its time (the model loads there)


def test_a_full_disk_keeps_every_answer_in_the_log_and_says_so(tmp_path, monkeypatch):
    from server.kaggle import gateway

    def full(path, data):
        raise OSError(errno.ENOSPC, f"could not write {path}: No space left on device")
    monkeypatch.setattr(gateway, "write_atomic", full)
    logs = []
    with pytest.raises(gateway.GatewayError, match="every answer was computed.*No space left"):
        gateway.run(good_predict, problems_csv(tmp_path), tmp_path / "out", log=logs.append)
    failed = [m for m in logs if "WRITE FAILED" in m]
    assert len(failed) == 3 and all(a in failed[-1] for a in ("1=3", "2=3", "3=5"))


def test_our_gateway_writes_after_every_answer(tmp_path):
    from server.kaggle import gateway

    calls = []

    def crashing(*row):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the kernel died")
        return good_predict(*row)
    with pytest.raises(RuntimeError, match="kernel died"):
        gateway.run(crashing, problems_csv(tmp_path), tmp_path / "out", log=lambda m: None)
    assert pl.read_parquet(tmp_path / "out" / "submission.parquet").height == 2  # the answers before the crash
    assert json.loads((tmp_path / "out" / "gateway_report.json").read_text())["problems"] == 2


@pytest.mark.parametrize("content,words", [
    (b"id,problem\n1,ok\n2,caf\xe9\n", r"test.csv: line 3: not UTF-8 \(byte 0xe9"),
    (b"problem\nabc\n", "needs the columns id"),
])
def test_our_gateway_reads_csvs_as_the_real_one_and_names_bad_files(tmp_path, content, words):
    from server.kaggle import gateway

    f = tmp_path / "test.csv"
    f.write_bytes(content)
    with pytest.raises((gateway.GatewayError, ValueError), match=words):
        gateway.run(good_predict, f, tmp_path / "out", log=lambda m: None)


def test_our_gateway_reads_a_bom_and_a_1mb_field(tmp_path):
    from server.kaggle import gateway

    f = tmp_path / "test.csv"
    f.write_bytes(b"\xef\xbb\xbfid,problem\n1," + b"x" * 1_000_000 + b"\n")
    sizes = []

    def predict(*row):
        sizes.append((row[0].name, len(row[1][0])))
        return pl.DataFrame({"id": row[0], "answer": [7]})
    report = gateway.run(predict, f, tmp_path / "out", log=lambda m: None)
    assert sizes == [("id", 1_000_000)] and report["results"][0]["answer"] == 7


def test_the_double_warns_when_the_server_starts_after_the_startup_limit(double, tmp_path, monkeypatch):
    import kaggle_evaluation

    monkeypatch.setattr(kaggle_evaluation, "IMPORTED_AT", time.time() - FACTS["timeouts"]["startup_limit_seconds"] - 5)
    with pytest.warns(RuntimeWarning, match="seconds elapsed before server startup"):
        double["aimo3"](good_predict).run_local_gateway((str(problems_csv(tmp_path)),))
    assert json.loads((tmp_path / "double_report.json").read_text())["startup_warning"] is True


# ------------------------------------------------------------------ blank rows in the problems CSV
BLANK_ROWS = "1,one,1\n\n2,two,2\n\n\n"  # blank lines 3, 5 and 6 (the header is line 1)


def test_the_real_gateway_reads_blank_rows_as_problems_with_null_ids(double, tmp_path):
    """Why blank rows are refused: like the real gateway (polars.read_csv), the faithful double passes each one
    to predict as a problem and submits its answer under a null id."""
    seen = []

    def predict(*row):
        seen.append(row[0][0])
        return pl.DataFrame({"id": row[0], "answer": [0]})
    double["aimo2"](predict).run_local_gateway((str(problems_csv(tmp_path, BLANK_ROWS)),))
    assert len(seen) == 5 and seen.count(None) == 3
    assert pl.read_parquet(tmp_path / "submission.parquet")["id"].null_count() == 3


def test_blank_rows_are_refused_alike_by_the_check_our_gateway_and_the_runner(double, tmp_path):
    from server.kaggle import gateway, runner
    from server.problems import read_problems

    csv = problems_csv(tmp_path, BLANK_ROWS)
    words = r"test.csv: lines 3, 5, 6: blank rows: Kaggle's gateway"
    calls = []

    def predict(*row):
        calls.append(row)
        return good_predict(*row)
    with pytest.raises(ValueError, match=words):
        read_problems(csv)  # make kaggle's check
    with pytest.raises(gateway.GatewayError, match=words):
        gateway.run(predict, csv, tmp_path / "ours", log=lambda m: None)
    with pytest.raises(gateway.GatewayError, match=words):
        runner.serve(predict, str(csv), out=str(tmp_path / "ours"))  # the competition's local gateway
    assert not calls and not (tmp_path / "ours").exists() and not (tmp_path / "submission.parquet").exists()


def test_our_gateway_refuses_an_empty_id_with_its_line(tmp_path):
    from server.kaggle import gateway

    with pytest.raises(gateway.GatewayError, match="test.csv: line 3: empty id"):
        gateway.run(good_predict, problems_csv(tmp_path, "1,one,1\n,two,2\n"), tmp_path / "out", log=lambda m: None)
    assert not (tmp_path / "out").exists()
