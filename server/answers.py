"""Final answers: the last \\boxed{...} of a reply, normalised to an integer."""

from __future__ import annotations

import re
from typing import Optional

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"^[+-]?\d+(?:\.0*)?$")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete \\boxed{...} (braces balanced), or None."""
    found = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end():i - 1]
    return found


def normalize(answer: Optional[str], modulus: Optional[int] = None) -> Optional[int]:
    """An integer answer, or None when it is not one ("12", "1,000", "$12$", "12.0", "\\text{12}")."""
    if answer is None:
        return None
    s = answer.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\,", "").replace("\\!", "").replace("{,}", "").replace(",", "").replace(" ", "")
    s = s.rstrip(".")
    if not _NUMBER.match(s):
        return None
    value = int(s.split(".")[0])
    return value % modulus if modulus else value
