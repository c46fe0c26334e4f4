"""Boxed answers to integers: lists are no integer, LaTeX forms a grader accepts are, the work is bounded."""

from __future__ import annotations

import time

import pytest

from server import answer_latex
from server.answers import boxed_span, is_list, last_boxed, normalize


@pytest.mark.parametrize("boxed", ["2, 3", "3, 5, 7", "2,3", "(2, 3)", "\\{2,3\\}", "1, 000", "2 3", "2 \\quad 3",
                                   "12,34", "x = 3, 4"])
def test_a_list_of_values_is_no_integer(boxed):
    # issue 19 bug 1: commas were stripped, so 2, 3 read as 23 and 3, 5, 7 as 357
    assert normalize(boxed) is None


@pytest.mark.parametrize("boxed,value", [("1,000", 1000), ("1{,}000", 1000), ("1\\,000", 1000), ("1,000,000", 10**6),
                                         ("12 345", 12345), ("-2,500", -2500), ("1,000.0", 1000)])
def test_a_comma_groups_thousands(boxed, value):
    assert normalize(boxed) == value


@pytest.mark.parametrize("boxed,value", [
    ("\\dfrac{84}{2}", 42), ("\\frac{84}{2}", 42), ("10^3", 1000), ("10^{3}", 1000), ("x = 42", 42), ("n=7", 7),
    ("42^\\circ", 42), ("42\\text{ cm}", 42), ("\\mathbf{42}", 42), ("\\sqrt{16}", 4), ("2^{10}", 1024),
    ("0.5 \\cdot 4", 2), ("-3 + 5", 2)])
def test_latex_forms_a_grader_accepts(boxed, value):
    assert normalize(boxed) == value


@pytest.mark.parametrize("boxed", ["\\frac{1}{2}", "x^2", "\\pi", "3.5", "\\sqrt{2}", "x = 3 \\text{ or } x = 4",
                                   "10!" + "0" * 100, "\\infty", "\\frac{1}{0}"])
def test_non_integers_cast_no_vote(boxed):
    assert normalize(boxed) is None


@pytest.mark.parametrize("boxed", ["9^{9^{9^{9}}}", "10^{10^{10}}", "2^{100000}", "(10^{100})^{100}",
                                   "\\sqrt[3]{10^{9000}}"])
def test_huge_powers_are_refused_without_being_computed(boxed):
    t0 = time.monotonic()
    assert normalize(boxed) is None
    assert time.monotonic() - t0 < 2.0


def test_long_text_is_not_parsed(monkeypatch):
    calls = []
    monkeypatch.setattr(answer_latex, "_parse", lambda s: calls.append(s))
    answer_latex.latex_integer.cache_clear()
    assert answer_latex.latex_integer("1+" * 50 + "1") is None and calls == []
    assert answer_latex.latex_integer("1+1") is None and calls == ["1+1"]
    answer_latex.latex_integer.cache_clear()


def test_modulus_and_plain_forms():
    assert normalize("2024", 1000) == 24 and normalize("\\dfrac{4048}{2}", 1000) == 24
    assert normalize("$12$") == 12 and normalize("\\text{7}") == 7 and normalize("12.") == 12


def test_boxed_span_and_is_list():
    text = "so \\boxed{1} and finally \\boxed{\\frac{84}{2}} done"
    start, end = boxed_span(text)
    assert text[start:end] == "\\boxed{\\frac{84}{2}}" and last_boxed(text) == "\\frac{84}{2}"
    assert is_list("2, 3") and not is_list("1,000") and not is_list("1{,}000")


def test_without_math_verify_latex_forms_give_no_vote_and_one_warning(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails as if not installed
    monkeypatch.setattr(answer_latex, "_missing_warned", False)
    answer_latex.latex_integer.cache_clear()
    with pytest.warns(RuntimeWarning, match="math-verify is not installed"):
        assert normalize("\\dfrac{84}{2}") is None
    assert normalize("1,000") == 1000  # plain forms never need it
    answer_latex.latex_integer.cache_clear()
