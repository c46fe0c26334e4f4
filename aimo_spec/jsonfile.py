"""Read a JSON file that a step of the project wrote, with errors that say which file and what to run.

Engine files, Kaggle serving files and manifests are read by people's commands long after they were
written; a missing or damaged one should name the file and the command that makes it again, not end
in a traceback from the json module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path, missing: str, remake: str) -> Any:
    """The parsed content of `path`. FileNotFoundError "<path>: <missing>" when there is no file;
    ValueError "<path>: not valid JSON (...); <remake>" when it does not parse."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {missing}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); {remake}") from None
