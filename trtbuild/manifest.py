"""Stage bookkeeping primitives: fingerprints, file hashes, atomic output folders, `manifest.json`.

The rules that use them (when a stage is stale, the skip / scratch / rename guard) live in
`trtbuild.stages`, once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

MANIFEST = "manifest.json"
TRACKED_LIBRARIES = (
    "numpy", "pyyaml", "torch", "transformers", "mergekit", "nvidia-modelopt", "safetensors",
    "peft", "accelerate", "gguf", "tokenizers", "tensorrt-llm",
)


def log(stage: str, msg: str) -> None:
    """Progress lines go to stderr so stdout stays clean for machine-readable output."""
    print(f"[{stage}] {msg}", file=sys.stderr, flush=True)


def fingerprint(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_tree(root: Path, suffixes: tuple[str, ...] = (".safetensors", ".json", ".jinja", ".txt", ".model")) -> dict[str, str]:
    """sha256 of each weight/config file under `root` (relative path -> digest)."""
    return {
        str(p.relative_to(root)): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix in suffixes and p.name != MANIFEST
    }


def dir_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for lib in TRACKED_LIBRARIES:
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_current(folder: Path, fp: str) -> bool:
    m = read_manifest(folder)
    return m is not None and m.get("fingerprint") == fp and m.get("status") == "done"


def touch(folder: Path) -> None:
    """Refresh the manifest's mtime (a finished stage reads as newer than what it was built from)."""
    (folder / MANIFEST).touch()


@contextlib.contextmanager
def stage_dir(final: Path) -> Iterator[Path]:
    """Yield a scratch folder that replaces `final` only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def write_manifest(folder: Path, stage: str, fp: str, started: float, **fields: Any) -> dict[str, Any]:
    manifest = {
        "stage": stage,
        "status": "done",
        "fingerprint": fp,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - started, 2),
        "size_bytes": dir_size(folder),
        "libraries": library_versions(),
        **fields,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n")
    return manifest
