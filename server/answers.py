"""Final answers: the last \\boxed{...} of a reply, normalised to an integer.

A boxed answer casts a vote only when it means exactly one integer. Plain forms ("12", "-5",
"1,000", "12.0", "$12$", "\\text{12}") are read here with a regular expression; anything else
that is short enough goes to `server.answer_latex` (math-verify's LaTeX parser, bounded), which
accepts what a grader accepts: "\\dfrac{84}{2}", "10^3", "x = 42", "42^\\circ", "42\\text{ cm}",
"\\mathbf{42}". A comma is a thousands separator only in groups of three digits ("1,000",
"1{,}000"); any other comma separates values ("2, 3", "3, 5, 7"), and a list is no integer answer.
"""

from __future__ import annotations

import re
from typing import Optional

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"^[+-]?\d+(?:\.0*)?$")
# digits grouped by a thousands separator: 1,000 | 1{,}000 | 1\,000 | 12 345 (groups of exactly three)
_GROUPED = re.compile(r"^[+-]?\d{1,3}(?:(?:,|\{,\}|\\,|\\ | )\d{3})+(?:\.0*)?$")
_WRAPPERS = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")


def _last_complete_box(text: str) -> Optional[tuple[int, int, int]]:
    """(start of `\\boxed{`, start of its content, end after its closing brace) of the last
    \\boxed{...} whose braces balance, or None."""
    found = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = (m.start(), m.end(), i)
    return found


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete \\boxed{...} (braces balanced), or None."""
    box = _last_complete_box(text)
    return None if box is None else text[box[1]:box[2] - 1]


def boxed_span(text: str) -> Optional[tuple[int, int]]:
    """(start, end) character offsets of the last complete \\boxed{...} in `text`, or None."""
    box = _last_complete_box(text)
    return None if box is None else (box[0], box[2])


def plain_integer(answer: str) -> Optional[int]:
    """The integer of a plain answer, or None when it is not plain (then the LaTeX reader may try)."""
    s = answer.strip().strip("$").strip()
    s = _WRAPPERS.sub(r"\1", s).strip().rstrip(".").strip()
    if _NUMBER.match(s):
        return int(s.split(".")[0])
    if _GROUPED.match(s):
        return int(re.sub(r"[^\d+-]|\.0*$", "", s.split(".")[0]))
    return None


_SPACED = re.compile(r"\d(?:\s|\\[,;: !]|\\q?quad)+[+-]?\d")


def is_list(answer: str) -> bool:
    """True when `answer` holds several values: a comma that is no thousands separator ("2, 3"), or
    numbers side by side ("2 3", "2 \\quad 3"; a plain "12 345" was already read as grouped)."""
    s = answer.replace("{,}", "")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    return "," in s or bool(_SPACED.search(s))


def normalize(answer: Optional[str], modulus: Optional[int] = None) -> Optional[int]:
    """An integer answer, or None when the boxed text is not exactly one integer (see module doc)."""
    if answer is None:
        return None
    value = plain_integer(answer)
    if value is None and not is_list(answer):
        from server.answer_latex import latex_integer

        value = latex_integer(answer)
    if value is None:
        return None
    return value % modulus if modulus else value
