"""What went wrong in a code call, as one short kind, for the tool-error table of `make eval`.

Kinds: `NameError: <name>` (a missing preimport or a variable of an earlier block), `ImportError:
<module>` (ModuleNotFoundError included), `timeout`, `killed`, another exception's type name
(`ZeroDivisionError`, `SyntaxError`), or "" when the code ran fine. The kind is read from the
cell's full stderr, not from the capped text the model got, so the table does not depend on the cap.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Iterable

from sandbox.result import split_error

_NAME = re.compile(r"^NameError: name '([^']+)' is not defined")
_MODULE = re.compile(r"^(?:ModuleNotFoundError|ImportError): No module named '([^'.]+)")
_IMPORT_NAME = re.compile(r"^ImportError: cannot import name '([^']+)' from '([^']+)'")
_TYPE = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def error_kind(result: Any) -> str:
    """The kind of a CellResult's failure (see module doc); "" for ok and output_truncated."""
    if result.status == "timeout":
        return "timeout"
    if result.status == "killed":
        return "killed"
    if result.status != "error":
        return ""
    return exception_kind(result.stderr.text)


def exception_kind(stderr: str) -> str:
    """The kind of the python error text `stderr` (its last exception line)."""
    _, exc = split_error(stderr.strip())
    line = exc.split("\n", 1)[0]
    for pattern, fmt in ((_NAME, "NameError: {}"), (_MODULE, "ImportError: {}"),
                         (_IMPORT_NAME, "ImportError: {1}.{0}")):
        m = pattern.match(line)
        if m:
            return fmt.format(*m.groups())
    m = _TYPE.match(line)
    return m.group(1).rsplit(".", 1)[-1] if m else "exit code"


def error_table(kinds: Iterable[str], calls: int) -> list[tuple[str, int, float]]:
    """(kind, count, share of all code calls), most frequent first; ties by name."""
    counts = Counter(k for k in kinds if k)
    return [(k, n, round(n / max(1, calls), 4)) for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
