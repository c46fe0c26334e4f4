"""One memory cgroup per sandbox worker: a limit on all of a cell's processes together, and a kill
switch that reaches every process in it.

RLIMIT_AS binds one process at a time, so a cell that forks N children could use N x `memory_mb`
(and SysV shared memory or tmpfs files were charged to nothing). A memory cgroup charges every
page that any process of the worker touches, shared memory and tmpfs included, and the kernel's
OOM killer acts inside it only.

Two layouts are supported, both host side only (the sandbox never sees /sys):
- cgroup v2 where the memory controller is delegated to our cgroup (`memory.max`,
  `memory.swap.max`, `memory.events`, `cgroup.kill`);
- cgroup v1 where the memory controller is mounted and our cgroup in it is writable
  (`memory.limit_in_bytes`, `memory.memsw.limit_in_bytes`, `memory.oom_control`).
Elsewhere `available()` says why not and the pool warns: the limit then stays per process.

Where the pids controller is available too (v2: delegated like memory; v1: mounted, ours
writable), the worker also gets a pids group: `pids.max` caps the threads and processes of a cell
and all it starts, and `pids.events` counts every fork or thread start it refused, so a result can
say that a cell ran into that limit (RLIMIT_NPROC refuses just the same, but counts nothing).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import signal
import threading
import time
import uuid

_counter = itertools.count()
PREFIX = "sandbox-"


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of every mount this process sees."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) >= 5 and len(rest) >= 3:
                out.append((fields[4].replace("\\040", " "), rest[0], rest[2]))
    return out


def _own_paths() -> dict[str, str]:
    """{controller list or '' for v2: path} from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrl, path = line.rstrip("\n").split(":", 2)
            out[ctrl] = path
    return out


def _v2_base(controller: str = "memory") -> str | None:
    own = _own_paths().get("")
    for mp, fstype, _ in _mounts():
        if fstype == "cgroup2" and own is not None:
            base = os.path.join(mp, own.lstrip("/"))
            try:
                with open(os.path.join(base, "cgroup.subtree_control")) as f:
                    if controller in f.read().split() and os.access(base, os.W_OK):
                        return base
            except OSError:
                pass
    return None


def _v1_base(controller: str = "memory", marker: str = "memory.limit_in_bytes") -> str | None:
    paths = _own_paths()
    own = next((p for c, p in paths.items() if controller in c.split(",")), None)
    for mp, fstype, opts in _mounts():
        if fstype == "cgroup" and controller in opts.split(",") and own is not None:
            base = os.path.join(mp, own.lstrip("/"))
            if os.path.isfile(os.path.join(base, marker)) and os.access(base, os.W_OK):
                return base
    return None


def _probe_name(base: str) -> str:
    """A test group's path no other probe uses: the cached probes below may run at once in two threads (a
    pool starting workers), and a name of the pid alone made the second fail (EEXIST) and conclude, for
    the life of the process, that the controller was not writable."""
    return os.path.join(base, f"{PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:12]}")


_PROBES = threading.Lock()  # one probe at a time: the first caller's result is cached for the rest


@functools.lru_cache(maxsize=1)
def available() -> tuple[str | None, str, str]:
    """(version 'v2' | 'v1' | None, base folder, reason). Probed once: makes and removes a test group."""
    with _PROBES:
        return _available()


def _available() -> tuple[str | None, str, str]:
    for version, base in (("v2", _v2_base()), ("v1", _v1_base())):
        if base is None:
            continue
        probe = _probe_name(base)
        try:
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError as e:
            return None, "", f"cgroup {version} memory controller at {base} is not writable: {e}"
        _remove_stale(base)
        return version, base, f"cgroup {version} memory limit per worker"
    return None, "", "no writable cgroup memory controller (neither v2 with memory delegated nor v1 memory)"


@functools.lru_cache(maxsize=1)
def pids_available() -> tuple[str | None, str, str]:
    """(version 'v2' | 'v1' | None, base folder, reason) for the pids controller, probed like `available()`."""
    with _PROBES:
        return _pids_available()


def _pids_available() -> tuple[str | None, str, str]:
    for version, base in (("v2", _v2_base("pids")), ("v1", _v1_base("pids", "cgroup.procs"))):
        if base is None:
            continue
        probe = _probe_name(base)
        try:
            os.mkdir(probe)
            try:
                ok = (_write(os.path.join(probe, "pids.max"), "max")
                      and os.path.isfile(os.path.join(probe, "pids.events")))
            finally:
                os.rmdir(probe)
        except OSError as e:
            return None, "", f"cgroup {version} pids controller at {base} is not writable: {e}"
        if not ok:
            return None, "", f"cgroup {version} pids controller at {base} has no writable pids.max and pids.events"
        _remove_stale(base)
        return version, base, f"cgroup {version} thread and process limit per worker"
    return None, "", "no writable cgroup pids controller"


def _remove_stale(base: str) -> None:
    """Groups left by a harness that died (its pid is gone): kill what is inside, remove them."""
    for name in os.listdir(base):
        m = re.fullmatch(rf"{PREFIX}(\d+)-\d+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _kill_members(os.path.join(base, name))
            try:
                os.rmdir(os.path.join(base, name))
            except OSError:
                pass


def _read_procs(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _kill_members(path: str, rounds: int = 100) -> bool:
    """SIGKILL every process in the group until it is empty (new forks are caught next round)."""
    for _ in range(rounds):
        pids = _read_procs(path)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return not _read_procs(path)


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def _read_int(path: str, key: str | None = None) -> int:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return 0
    if key is None:
        return int(text.split()[0]) if text.split() and text.split()[0].isdigit() else 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


class CellGroup:
    """The cgroup of one worker: everything its namespace runs is charged and killed here.

    `pids_path` is its pids group (the same folder on v2, one in the pids hierarchy on v1), or None
    where the pids controller is unavailable.
    """

    def __init__(self, version: str, path: str, pids_path: str | None = None):
        self.version, self.path, self.pids_path = version, path, pids_path
        self.limit_bytes = 0

    @classmethod
    def create(cls) -> "CellGroup | None":
        version, base, _ = available()
        if version is None:
            return None
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        path = os.path.join(base, name)
        try:
            os.mkdir(path)
        except OSError:
            return None
        pids_version, pids_base, _ = pids_available()
        pids_path = os.path.join(pids_base, name) if pids_version is not None else None
        if pids_path is not None and pids_path != path:
            try:
                os.mkdir(pids_path)
            except OSError:
                pids_path = None
        return cls(version, path, pids_path)

    @property
    def procs_file(self) -> str:
        """The file a process writes `0` into to join the group (done before the worker starts)."""
        return os.path.join(self.path, "cgroup.procs")

    @property
    def pids_procs_file(self) -> str:
        """The same for the pids group where that is a group of its own (v1), else ''."""
        return os.path.join(self.pids_path, "cgroup.procs") if self.pids_path not in (None, self.path) else ""

    def usage(self) -> int:
        return _read_int(os.path.join(self.path, "memory.current" if self.version == "v2" else "memory.usage_in_bytes"))

    def peak(self) -> int:
        """Highest usage seen (v1 always; v2 where the kernel has memory.peak); 0 if unknown."""
        return _read_int(os.path.join(self.path,
                                      "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"))

    def limit_memory(self, extra_bytes: int) -> bool:
        """Cap the group at what the warm worker uses now plus `extra_bytes`, swap included."""
        limit = self.usage() + extra_bytes
        if self.version == "v2":
            ok = _write(os.path.join(self.path, "memory.max"), str(limit))
            _write(os.path.join(self.path, "memory.swap.max"), "0")
        else:
            ok = _write(os.path.join(self.path, "memory.limit_in_bytes"), str(limit))
            memsw = os.path.join(self.path, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):
                _write(memsw, str(limit))
        self.limit_bytes = limit if ok else 0
        return ok

    def limit_tasks(self, extra: int) -> bool:
        """Cap the group's threads and processes at what the warm worker runs now plus `extra`."""
        if self.pids_path is None:
            return False
        limit = _read_int(os.path.join(self.pids_path, "pids.current")) + extra
        return _write(os.path.join(self.pids_path, "pids.max"), str(limit))

    def task_limit_hits(self) -> int:
        """How many forks and thread starts the task limit refused in this group so far (0 without one)."""
        return _read_int(os.path.join(self.pids_path, "pids.events"), "max") if self.pids_path else 0

    def oom_kills(self) -> int:
        """How many processes the kernel killed in this group for exceeding the limit so far."""
        if self.version == "v2":
            return _read_int(os.path.join(self.path, "memory.events"), "oom_kill")
        return _read_int(os.path.join(self.path, "memory.oom_control"), "oom_kill")

    def kill(self) -> bool:
        """Kill every process in the group (and in its pids group, which holds the same ones); True when empty."""
        if self.pids_procs_file:
            _kill_members(self.pids_path)
        if self.version == "v2" and _write(os.path.join(self.path, "cgroup.kill"), "1"):
            for _ in range(200):
                if not _read_procs(self.path):
                    return True
                time.sleep(0.005)
        return _kill_members(self.path)

    def remove(self) -> None:
        self.kill()
        for path in [self.path] + ([self.pids_path] if self.pids_procs_file else []):
            for _ in range(50):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)  # the last member is still exiting
