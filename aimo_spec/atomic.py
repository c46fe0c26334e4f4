"""Write a file so that a reader sees the old content or the new, never half of it.

Outputs that hold finished work (results, submissions, manifests) are written through here: a full
disk or a Ctrl-C in the middle of a write keeps the previous version, and the error names the file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise OSError(e.errno, f"could not write {path}: {e.strerror or e}") from e
        raise
    return path
