"""Stage bookkeeping primitives: fingerprints, file hashes, atomic output folders, `manifest.json`,
the check of a finished folder against its manifest, and the lock of a model's output folder.

The rules that use them (when a stage is stale, the skip / scratch / rename guard) live in
`trtbuild.stages`, once.

What a manifest's `verify` block records, and why it stays cheap for large models: the size of
every file in the stage folder (checked on every run: a stat per file, and it catches the usual
damage, a copy or write cut short by a full disk or a Ctrl-C), and the sha256 of files up to
VERIFY_HASH_BYTES (configs, tokenizers, small drafters and test models: a few MB read per run).
Large weights are not re-hashed on every run (a 14B checkpoint would cost minutes); their bytes
changing in place at the same size is not detected: `FORCE=<stage>` rebuilds such a stage.
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

from aimo_spec.atomic import write_atomic

MANIFEST = "manifest.json"
VERIFY_HASH_BYTES = 8 << 20  # files up to this size are hashed at build time and checked on every run
LOCK = ".lock"
TRACKED_LIBRARIES = (
    "numpy", "pyyaml", "torch", "transformers", "mergekit", "nvidia-modelopt", "safetensors",
    "peft", "accelerate", "gguf", "tokenizers", "tensorrt-llm",
    "llama-cpp-python",  # its version pins the llama.cpp converter gguf_* formats are made with
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


def hash_tree(root: Path,
              suffixes: tuple[str, ...] = (".safetensors", ".json", ".jinja", ".txt", ".model")) -> dict[str, str]:
    """sha256 of each weight/config file under `root` (relative path -> digest)."""
    return {
        str(p.relative_to(root)): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix in suffixes and p.name != MANIFEST
    }


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(src, dst)
    return dst


def links_work(folder: Path) -> bool:
    """Whether `folder`'s file system (that of its nearest existing ancestor) takes hard links: tried."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    probe = folder / f".link-probe-{os.getpid()}"
    try:
        probe.touch()
        os.link(probe, probe.with_suffix(".linked"))
        return True
    except OSError:
        return False
    finally:
        for f in (probe, probe.with_suffix(".linked")):
            f.unlink(missing_ok=True)


def link_tree(src: Path, dst: Path, *ignore: str) -> None:
    """`src` copied to `dst` (without its manifest and the `ignore` patterns), each file hard-linked where
    the filesystem allows, else copied.

    Why links: the build packs the quantized weights into the engine folder, and a copy doubles them on disk
    (28 GB more at 14B; at 135M the test suite's copies filled a CI machine's disk). Safe because no stage
    output is ever written in place: each stage writes a scratch folder and renames it (`stage_dir`), so a
    rerun makes new files and the engine keeps the ones it was built from."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(MANIFEST, *ignore), copy_function=_link_or_copy)


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


def load_manifest(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None), (None, None) when there is none, or (None, why) when it cannot be read."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{type(e).__name__}: {e}"
    if not isinstance(data, dict):
        return None, f"a JSON {type(data).__name__}, not an object"
    return data, None


def read_manifest(folder: Path) -> dict[str, Any] | None:
    return load_manifest(folder)[0]


def is_current(folder: Path, fp: str) -> bool:
    m = read_manifest(folder)
    return m is not None and m.get("fingerprint") == fp and m.get("status") == "done"


def _listing(folder: Path) -> list[Path]:
    """The files a stage folder holds (its own manifest and hidden entries, e.g. locks, left out)."""
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and str(rel) != MANIFEST and not any(part.startswith(".") for part in rel.parts):
            out.append(p)
    return out


def record_files(folder: Path) -> dict[str, Any]:
    """The `verify` block: every file's size, and the sha256 of the small ones (see the module doc)."""
    sizes, hashes = {}, {}
    for p in _listing(folder):
        rel, size = str(p.relative_to(folder)), p.stat().st_size
        sizes[rel] = size
        if size <= VERIFY_HASH_BYTES:
            hashes[rel] = sha256_file(p)
    return {"sizes": sizes, "sha256": hashes, "hash_limit_bytes": VERIFY_HASH_BYTES}


def verify(folder: Path, manifest: dict[str, Any]) -> str | None:
    """What in `folder` no longer matches its manifest (None: all of it does, or nothing is recorded)."""
    rec = manifest.get("verify")
    if not isinstance(rec, dict):
        return None  # a manifest from before verification: trusted as it was
    for rel, size in (rec.get("sizes") or {}).items():
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != size:
            return f"{rel} is {p.stat().st_size} bytes but was {size} when built (truncated or changed)"
    for rel, digest in (rec.get("sha256") or {}).items():
        if sha256_file(folder / rel) != digest:
            return f"{rel} changed since it was built (sha256)"
    return None


@contextlib.contextmanager
def folder_lock(folder: Path, wait_log: Any = None) -> Iterator[None]:
    """Exclusive use of a model's output folder across processes (flock on `<folder>/.lock`): a second
    `make engine` waits for the first, then finds its stages current instead of redoing them."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            (wait_log or (lambda m: log("lock", m)))(f"{folder} is in use by {holder}; waiting for it to finish ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)


def touch(folder: Path) -> None:
    """Refresh the manifest's mtime (a finished stage reads as newer than what it was built from)."""
    (folder / MANIFEST).touch()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale(final: Path) -> list[Path]:
    """Remove the scratch folders of `final` that a stage killed by a signal left (a segfault or the OOM
    killer runs no cleanup; a 14B export's scratch is ~15 GB a try): those named for a process that
    no longer runs. A concurrent build's are kept; a previous output set aside (`.old-`) when `final`
    is missing (killed between stage_dir's two renames) is put back. Returns what was removed."""
    removed = []
    for kind in ("partial", "old"):
        for path in sorted(final.parent.glob(f".{final.name}.{kind}-*")):
            pid = path.name.rpartition("-")[2]
            if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                continue
            if kind == "old" and not final.exists():  # killed between its two renames: the last good output
                path.rename(final)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def stage_dir(final: Path) -> Iterator[Path]:
    """Yield a scratch folder that replaces `final` only if the block succeeds (scratch folders that
    dead runs left beside it are removed first, `sweep_stale`)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    for path in sweep_stale(final):
        log("manifest", f"removed {path.name}, left by a run that ended without cleaning up")
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
        "verify": record_files(folder),
    }
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n")
    return manifest
