"""What `predict` is given, normalised: the gateway's single-row Series, or a DataFrame, pandas,
plain values. Kept apart from the predictor so that every input shape has one tested path.

The real gateway calls `predict(*row)`: one single-row polars Series per CSV column, in column
order (id, problem, then e.g. answer, ignored here). Ids are returned exactly as given (same values
and dtype), because the gateway compares them with its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional


class PredictInputError(ValueError):
    """`predict` was called with something it cannot read as (id, problem) rows."""


@dataclass
class Rows:
    ids: Any  # a polars Series named "id": the ids exactly as given
    texts: list[Optional[str]]  # None: no problem text (null, NaN, empty)

    def __len__(self) -> int:
        return len(self.texts)


def _is_frame(x: Any) -> bool:
    return hasattr(x, "columns") and hasattr(x, "__getitem__") and not hasattr(x, "dtype")


def _values(x: Any) -> list[Any]:
    """The values of a polars or pandas Series, a list/tuple, or a single value."""
    if hasattr(x, "to_list"):
        return list(x.to_list())
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def _text(value: Any) -> Optional[str]:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (bytes, bytearray)):  # a binary column: its text, not its repr ("b'...'")
        value = bytes(value).decode("utf-8", errors="replace")
    text = value if isinstance(value, str) else str(value)
    return text if text.strip() else None


def read_rows(args: tuple[Any, ...]) -> Rows:
    """(id, problem, ...) Series or values, or one DataFrame with columns id and problem."""
    import polars as pl

    if not args:
        raise PredictInputError("predict needs the id and problem (got no arguments)")
    if len(args) == 1 and _is_frame(args[0]):
        frame = args[0]
        cols = [str(c) for c in frame.columns]
        if "id" not in cols or "problem" not in cols:
            raise PredictInputError(f"predict was given a DataFrame without columns id and problem (columns: {cols})")
        id_arg, problem_arg = frame["id"], frame["problem"]
    elif len(args) >= 2:
        id_arg, problem_arg = args[0], args[1]  # further columns (the CSV's answer) are not the model's business
    else:
        raise PredictInputError(f"predict needs the id and problem (got one argument of type {type(args[0]).__name__})")
    if isinstance(id_arg, pl.Series):
        ids = id_arg.alias("id")
    else:
        values = _values(id_arg)
        try:
            ids = pl.Series("id", values)
        except (TypeError, ValueError, pl.exceptions.PolarsError) as e:
            raise PredictInputError(f"predict could not read the ids {values!r:.200}: {e}") from None
    texts = [_text(v) for v in _values(problem_arg)]
    if len(ids) != len(texts):
        raise PredictInputError(f"predict was given {len(ids)} ids but {len(texts)} problems")
    return Rows(ids, texts)


def answer_frame(rows: Rows, answers: list[int]) -> Any:
    """DataFrame(id, answer): ids as given, answers as Int64 (never Int128, which the relay cannot send)."""
    import polars as pl

    return pl.DataFrame([rows.ids, pl.Series("answer", [int(a) for a in answers], dtype=pl.Int64)])
