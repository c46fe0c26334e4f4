"""Fixed-width text tables: how the benchmarks and programs print their summaries.

One place for the alignment rule (a header takes its column's alignment and width, without the
number format), so that a table is declared as its columns rather than written as two f-strings
that must be kept in step by hand.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

Column = tuple[str, str, str]  # (header, row key, format spec such as ">12", "<14" or ">9.2f")

_SPEC = re.compile(r"^(?P<align>[<>^]?)(?P<width>\d*)(?P<rest>.*)$")


def format_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """The header line and one line a row; a missing or None value prints as '-' in its column."""
    layout = []
    for header, key, spec in columns:
        m = _SPEC.match(spec)
        if m is None:  # the pattern matches any string; kept for type checkers
            raise ValueError(f"column {header!r}: bad format spec {spec!r}")
        layout.append((header, key, spec, f"{m['align'] or '>'}{m['width']}"))
    lines = [" ".join(f"{header:{box}}" for header, _, _, box in layout)]
    for row in rows:
        cells = []
        for _, key, spec, box in layout:
            value = row.get(key)
            cells.append(f"{'-':{box}}" if value is None else format(value, spec))
        lines.append(" ".join(cells))
    return "\n".join(lines)
