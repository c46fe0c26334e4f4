"""Evaluation arithmetic: exact maj@k / pass@k, accuracy at a budget, the report, and run replay."""

from __future__ import annotations

import itertools
import json
import math
import random
from types import SimpleNamespace

import pytest

from server.evaluate import budget_curve, markdown, parse_tool_settings, plots, summarize
from server.metrics import accuracy_at_budget, maj_at_k, majority, pass_at_k
from server.replay import parse_rule, play_problem, replay, vote_accuracy
from server.toolerrors import error_table, exception_kind


def test_majority_ties_go_to_the_first_answer():
    assert majority([3, 5, 5, 3]) == 3 and majority([None, 5, 3, 3]) == 3 and majority([None, None]) is None


def test_maj_at_k_is_exact_over_subsets():
    answers = [1, 1, 2, 3, None]
    assert maj_at_k(answers, 1, 1) == pytest.approx(2 / 5)
    assert maj_at_k(answers, 1, 5) == 1.0
    # k = 2: subsets {1,1} win; {1,x} wins only when 1 comes first (ties go to the first sample)
    wins = sum(majority([answers[i] for i in c]) == 1 for c in itertools.combinations(range(5), 2))
    assert maj_at_k(answers, 1, 2) == pytest.approx(wins / 10)
    with pytest.raises(ValueError):
        maj_at_k(answers, 1, 6)


def test_pass_at_k_matches_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 8)
        answers = [rng.choice([7, 8, None]) for _ in range(n)]
        for k in range(1, n + 1):
            brute = sum(7 in [answers[i] for i in c] for c in itertools.combinations(range(n), k)) / math.comb(n, k)
            assert pass_at_k(answers, 7, k) == pytest.approx(brute)


def test_accuracy_at_budget_counts_only_finished_samples():
    samples = [(5, 1.0), (6, 2.0), (6, 3.0), (5, 10.0)]
    assert accuracy_at_budget(samples, 5, 1.5) and not accuracy_at_budget(samples, 5, 3.5)
    assert not accuracy_at_budget(samples, 5, 0.5)


def synthetic(k=4):
    def sample(answer, t, tokens=50, calls=1, errors=0):
        return {"answer": answer, "tokens": tokens, "finish": "stop", "seconds": t, "finished_at": t,
                "code_calls": calls, "tool_errors": errors, "tool_timeouts": 0,
                "error_kinds": ["NameError: sp"] * errors}
    return [{"id": "a", "truth": 1, "seconds": 4.0,
             "samples": [sample(1, 1.0), sample(1, 2.0), sample(2, 3.0), sample(None, 4.0, errors=1)]},
            {"id": "b", "truth": 9, "seconds": 2.0,
             "samples": [sample(3, 0.5), sample(9, 1.0), sample(9, 1.5), sample(9, 2.0)]}]


def test_summary_report_and_plots(tmp_path):
    results = synthetic()
    s = summarize(results, 4)
    assert s["maj_at_k"]["4"] == 1.0 and s["pass_at_k"]["1"] == pytest.approx((2 / 4 + 3 / 4) / 2)
    assert s["no_answer_rate"] == 1 / 8 and s["tool_error_rate"] == 1 / 8 and s["code_calls_per_solution"] == 1.0
    grid = [0.6, 1.2, 2.5, 5.0]
    assert budget_curve(results, grid) == [0.0, 0.5, 1.0, 1.0]  # b: a 3-vs-9 tie at 1.2 s goes to 3
    report = {"recipe": "r.yaml", "data": "p.csv", "k": 4, "problems": 2, "date": "2026-12-03", "machine": "test",
              "budget_grid": grid, "variants": {"x": {"results": results, "summary": s,
                                                      "budget_curve": budget_curve(results, grid)}}}
    files = plots(report, tmp_path)
    assert all((tmp_path / f).stat().st_size > 1000 for f in files) and len(files) == 3
    md = markdown(report, files)
    assert "| maj@4 | 1.000 |" in md and "![accuracy_vs_k.png](accuracy_vs_k.png)" in md


def test_replay_rules_budget_and_scores():
    samples = [(a, t, None, None) for a, t in [(1, 1.0), (1, 2.0), (2, 3.0), (1, 4.0), (1, 5.0)]]
    assert play_problem(samples, parse_rule("2of3"), 100.0) == (1, 2.0)  # 2 of the first 3 agree at t=2
    assert play_problem(samples, parse_rule("all"), 100.0) == (1, 5.0)
    assert play_problem(samples, parse_rule("all"), 2.5) == (1, 2.5)  # cut by the allowance
    assert play_problem([(None, 1.0, None, None)], parse_rule("all"), 9.0) == (None, 1.0)
    problems = synthetic()
    spec = SimpleNamespace(policy="fixed", total_seconds=None, base_seconds=1.2, max_extra_seconds=0.0,
                           low_seconds=1.0, high_seconds=2.0)
    r = replay(problems, spec, parse_rule("all"), runs=10)
    assert r["expected_score"] == 1.0 and r["mean_time_left"] == pytest.approx(0.0, abs=1e-9)  # b cut at a tie
    spec.base_seconds = 10.0
    r = replay(problems, spec, parse_rule("2of3"), runs=10)
    assert r["expected_score"] == 2.0 and r["mean_time_left"] == pytest.approx(20.0 - 2.0 - 1.5)


def test_replay_cli_on_a_recorded_eval(tmp_path, capsys):
    from small_recipes import write_recipe

    from server.programs.replay import main

    recipe = write_recipe(tmp_path, "rp", {"cot": {"kind": "hf", "path": "a"}, "tir": {"kind": "hf", "path": "b"}})
    data = {"recipe": str(recipe), "variants": {"mix": {"results": synthetic()}}}
    (tmp_path / "eval.json").write_text(json.dumps(data))
    assert main(["--eval", str(tmp_path / "eval.json"), "--runs", "5", "--out", str(tmp_path / "replay.json")]) == 0
    out = json.loads((tmp_path / "replay.json").read_text())
    assert {r["policy"] for r in out["rows"]} == {"aimo2", "aimo3", "fixed"} and len(out["rows"]) == 27
    assert {r["vote"] for r in out["rows"]} == {"majority", "entropy", "local_entropy"}
    assert [v["vote"] for v in out["votes"]] == ["majority", "entropy", "local_entropy"]
    text = capsys.readouterr().out
    assert "expected score" in text and "differs from majority" in text
    assert main(["--eval", str(tmp_path / "eval.json"), "--votes", "median"]) == 2


def test_replay_shows_which_vote_wins():
    def s(answer, mean, local, t=1.0):
        return {"answer": answer, "finished_at": t, "mean_entropy": mean, "local_entropy": local}
    # a: the wrong sample is sure only where it writes its answer; b: a confident loop against agreement
    problems = [{"truth": 4, "samples": [s(9, 2.0, 0.01), s(4, 0.1, 0.5, 2.0), s(4, 0.1, 0.5, 3.0)]},
                {"truth": 5, "samples": [s(8, 1e-5, 1e-5)] + [s(5, 0.1, 0.1, 2.0 + i) for i in range(11)]}]
    acc = {v: vote_accuracy(problems, v)["accuracy"] for v in ("majority", "entropy", "local_entropy")}
    assert acc == {"majority": 1.0, "entropy": 1.0, "local_entropy": 0.5}
    assert vote_accuracy(problems, "local_entropy")["differs_from_majority"] == 1
    assert vote_accuracy(problems, "entropy", cap=1e9)["accuracy"] == 0.5  # uncapped, the loop wins b


def test_tool_error_kinds_table_and_report():
    assert exception_kind("Traceback (most recent call last):\n  File \"<cell>\", line 1\n"
                          "NameError: name 'sp' is not defined") == "NameError: sp"
    assert exception_kind("ModuleNotFoundError: No module named 'sympy.foo'") == "ImportError: sympy"
    assert (exception_kind("ImportError: cannot import name 'isprime' from 'math' (unknown location)")
            == "ImportError: math.isprime")
    assert exception_kind('  File "<cell>", line 1\n    x = (\n        ^\nSyntaxError: bad') == "SyntaxError"
    assert exception_kind("numpy.linalg.LinAlgError: Singular matrix") == "LinAlgError"
    assert error_table(["timeout", "NameError: sp", "timeout", ""], 8) == [("timeout", 2, 0.25),
                                                                           ("NameError: sp", 1, 0.125)]
    results = synthetic()
    results[1]["samples"][0]["output_cut"] = 2
    s = summarize(results, 4)
    assert s["tool_error_kinds"] == [("output cut", 2, 0.25), ("NameError: sp", 1, 0.125)] and s["code_calls"] == 8
    report = {"recipe": "r.yaml", "data": "p.csv", "k": 4, "problems": 2, "date": "2026-12-03", "machine": "test",
              "variants": {"x@before": {"summary": s}, "x@after": {"summary": summarize(synthetic()[1:], 4)}}}
    assert s["output_cut_rate"] == 0.25
    md = markdown(report, [])
    assert "| NameError: sp | 1 (12.5%) | 0 |" in md and "| code calls | 8 | 4 |" in md


def test_tool_settings_parse_and_errors():
    assert parse_tool_settings("before=stateless/200/5,after=stateful/1000/10") == {
        "before": (False, 200, 5.0), "after": (True, 1000, 10.0)}
    assert parse_tool_settings("") == {}
    for bad in ("x=jupyter/200/5", "x=stateful/200", "=stateful/1/1", "x=stateful/0/5", "x=stateful/9/zero"):
        with pytest.raises(ValueError, match="--tool-settings"):
            parse_tool_settings(bad)
