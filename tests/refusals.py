"""Inputs that must be refused: a file with these bytes fails to load with an error naming what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest


def assert_refused(path: Path, content: bytes, load: Callable[[Path], Any], error: type[Exception], words: str) -> None:
    """`content` written to `path` makes `load(path)` raise `error` with a message matching `words` (a regex)."""
    path.write_bytes(content)
    with pytest.raises(error, match=words):
        load(path)
