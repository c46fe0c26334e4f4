"""Integer answers written in LaTeX, read by math-verify (the grader the AIMO-2 winners' toolkit
uses), with a bound on the work.

Why a library: a grader accepts "\\dfrac{84}{2}", "10^3", "x = 42", "42^\\circ", "42\\text{ cm}"
and "\\mathbf{42}" as 42 (or 1000); a sample that writes them must cast the same vote as one that
writes "42". Text is never evaluated: math-verify parses it into an unevaluated sympy tree, and
`exact_value` walks that tree with exact fractions, refusing anything but numbers, + - * /, integer
powers and exact roots, and refusing a power whose result would exceed `MAX_BITS` before computing
it (so "9^{9^{9^9}}" costs nothing). Input longer than `MAX_CHARS` is not parsed at all; in the main
thread math-verify's own alarm bounds the parse to `PARSE_SECONDS` as well.

math-verify and sympy are imported on first use only; without math-verify these forms give None
(a warning says so once) and plain integers still work (`server.answers`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from fractions import Fraction
from functools import lru_cache
from typing import Any, Optional

MAX_CHARS = 80  # a boxed integer in another form is short; longer text is no single integer
MAX_BITS = 4096  # largest intermediate value the tree walk computes
MAX_NODES = 200
PARSE_SECONDS = 2  # math-verify's alarm (main thread only: signals work nowhere else)
_missing_warned = False


class _TooBig(Exception):
    pass


@lru_cache(maxsize=4096)
def latex_integer(answer: str) -> Optional[int]:
    """The one integer `answer` means, or None (not an integer, a list, too long, unparseable)."""
    s = answer.strip()
    if not s or len(s) > MAX_CHARS:
        return None
    tree = _parse(s)
    if tree is None:
        return None
    try:
        v = exact_value(tree)
    except (_TooBig, RecursionError, ValueError, TypeError, ZeroDivisionError, OverflowError):
        return None
    return int(v) if v is not None and v.denominator == 1 else None


def _parse(s: str) -> Any:
    global _missing_warned
    try:
        from math_verify import LatexExtractionConfig, parse
    except ImportError:
        if not _missing_warned:
            _missing_warned = True
            warnings.warn("math-verify is not installed (make setup): boxed answers in LaTeX forms such as "
                          "\\dfrac{84}{2} or 10^3 cast no vote", RuntimeWarning, stacklevel=3)
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its once-only notice that we bound the work ourselves
    main = threading.current_thread() is threading.main_thread()
    try:
        found = parse(f"${s}$", extraction_config=[LatexExtractionConfig()], fallback_mode="no_fallback",
                      parsing_timeout=PARSE_SECONDS if main else None)
    except Exception:  # noqa: BLE001 - the library's trouble with model text: no vote, never a crash
        return None
    import sympy

    return next((f for f in found if isinstance(f, sympy.Basic)), None)


def exact_value(e: Any, budget: Optional[list[int]] = None) -> Optional[Fraction]:
    """The exact rational value of an unevaluated sympy tree, or None when it has no single one."""
    budget = budget if budget is not None else [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooBig
    if e.is_Rational:
        return Fraction(int(e.p), int(e.q))
    if e.is_Float:
        f = float(e)
        return Fraction(f) if f == f and abs(f) < 2.0 ** 53 else None
    if e.is_Symbol:  # \mathbf{42} and \text{42} arrive as a symbol named "42"
        name = e.name.replace(",", "")
        return Fraction(int(name)) if name.isdigit() else None
    if e.is_Relational:  # x = 42: the value of the side that is not a bare name
        if getattr(e, "rel_op", "") != "==":
            return None
        lhs, rhs = e.args
        if lhs.is_Symbol and exact_value(lhs, budget) is None:
            return exact_value(rhs, budget)
        return None
    if e.is_Add or e.is_Mul:
        vals = [exact_value(a, budget) for a in e.args]
        if any(v is None for v in vals):
            return None
        out = Fraction(0) if e.is_Add else Fraction(1)
        for v in vals:
            out = out + v if e.is_Add else out * v
            _check_size(out)
        return out
    if e.is_Pow:
        base, exp = (exact_value(a, budget) for a in e.args)
        if base is None or exp is None:
            return None
        return _power(base, exp)
    return None


def _check_size(v: Fraction) -> None:
    if v.numerator.bit_length() > MAX_BITS or v.denominator.bit_length() > MAX_BITS:
        raise _TooBig


def _power(base: Fraction, exp: Fraction) -> Optional[Fraction]:
    """base ** exp when it is rational and small enough; checked before it is computed."""
    if exp.denominator != 1:  # an exact root only: sqrt(16), 8^{1/3}
        n = exp.denominator
        if n > 64 or base < 0:
            return None
        roots = [_iroot(x, n) for x in (base.numerator, base.denominator)]
        if None in roots:
            return None
        base, exp = Fraction(roots[0], roots[1]), Fraction(exp.numerator)
    k = int(exp)
    if abs(base) not in (0, 1):
        bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
        if bits * abs(k) > MAX_BITS:
            raise _TooBig
    if base == 0 and k < 0:
        return None
    return base ** k


def _iroot(x: int, n: int) -> Optional[int]:
    """The exact integer n-th root of x >= 0, or None."""
    if x.bit_length() > 1000:  # beyond float range: no answer needs a root of such a number
        return None
    r = round(x ** (1.0 / n))
    for c in (r - 1, r, r + 1):
        if c >= 0 and c ** n == x:
            return c
    return None
