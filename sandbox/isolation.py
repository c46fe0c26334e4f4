"""How a sandbox worker is wrapped: Linux namespaces via util-linux `unshare`, or nothing.

`namespaces` (default where it works), one set per worker:
- network namespace: no interface is up, so no network at all, loopback included, and its own
  abstract unix socket space;
- pid namespace: the worker is its pid 1 and the harness is invisible. The harness holds a pidfd
  on that pid 1 and SIGKILLs it to end the worker, which makes the kernel kill everything in the
  namespace: nothing a cell starts can outlive its worker, whatever it does with setsid(), process
  groups or signals (the uid drop clears the parent-death signal, so that is not relied on);
- IPC namespace: SysV shared memory, semaphores and message queues are the worker's own and die
  with it (after a pool cell that left any, the worker moves to a fresh one, see _worker.py);
  cells cannot create POSIX message queues (RLIMIT_MSGQUEUE 0);
- mount namespace with a new root built from nothing (see `mount_script`): only read-only system
  and interpreter folders, fresh tmpfs for every writable place, no host socket.
As root, cells also drop to a per-slot unprivileged uid, which makes RLIMIT_NPROC bind and keeps
them from signalling, tracing or reading the worker. Without root, an unprivileged user namespace
is used instead (no uid drop: weaker, cells are root inside it).

`none`: rlimits, timeouts and process-group kills only; chosen with a loud warning when namespaces
are unavailable, or explicitly for debugging.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import warnings

UID_BASE = 61000  # slot k runs cells as uid UID_BASE + k (root only)
MAX_SLOTS = 4000  # uids UID_BASE .. UID_BASE + MAX_SLOTS - 1 are the sandbox's

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
# Fresh tmpfs mounts, in mount order (a parent before what lies inside it). Pool workers mount them
# again after every cell, so each cell starts from empty ones; /run holds no host socket in here.
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/run/lock")
STAGING = ("/mnt", "/media", "/srv", "/opt", "/boot", "/home")  # where the new root is assembled
KEEP = "/.keep"  # root-only folder on the new root: runtime dirs to bind again under a fresh tmpfs


def _runtime_dirs(python: str = "") -> list[str]:
    """Folders the cell's interpreter must read: its prefixes and package folders, as real paths."""
    paths = {sys.base_prefix, sys.prefix,
             *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    if python:
        paths.add(os.path.dirname(os.path.dirname(os.path.realpath(python))))
    return sorted(os.path.realpath(p) for p in paths if os.path.isdir(p))


def _binds(python: str = "") -> list[tuple[str, str]]:
    """(source, target) read-only binds of the new root: system dirs, then the interpreter's dirs.

    A folder already inside another bound folder is left out; a venv whose path differs from its
    real path is bound at both, so `sys.executable` resolves either way.
    """
    targets: list[tuple[str, str]] = []
    for d in SYSTEM_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            targets.append((d, d))
    extra = set(_runtime_dirs(python))
    for p in (sys.prefix, os.path.dirname(os.path.abspath(sys.executable))):
        if os.path.isdir(p) and os.path.abspath(p) != os.path.realpath(p):
            targets.append((os.path.realpath(p), os.path.abspath(p)))
    for d in sorted(extra):
        targets.append((d, d))
    out: list[tuple[str, str]] = []
    for src, dst in sorted(set(targets), key=lambda t: (t[1].count("/"), t[1])):
        if not any(dst == o or dst.startswith(o.rstrip("/") + "/") for _, o in out):
            out.append((src, dst))
    return out


def _under_tmp(path: str) -> bool:
    return any(path == t or path.startswith(t + "/") for t in PRIVATE_TMP)


def _staging(python: str = "") -> str:
    """An existing folder, not holding any runtime dir, to assemble the new root on (old tree only)."""
    needed = [d for _, d in _binds(python)] + [os.path.realpath(s) for s, _ in _binds(python)]
    for c in STAGING:
        if os.path.isdir(c) and not os.path.islink(c) and not any(n == c or n.startswith(c + "/") for n in needed):
            return c
    raise RuntimeError(f"no folder to assemble the sandbox root on (tried {', '.join(STAGING)})")


def rebinds(python: str = "") -> list[tuple[str, str]]:
    """(kept copy, target) of runtime dirs that sit under a private tmpfs (a venv under /tmp, say).

    A pool worker re-binds them after it mounts that tmpfs afresh.
    """
    return [(f"{KEEP}/{k}", dst) for k, (_, dst) in enumerate(b for b in _binds(python) if _under_tmp(b[1]))]


@functools.lru_cache(maxsize=8)
def mount_script(python: str = "") -> str:
    """Shell run as the namespace's first process (root), before the worker is exec'd.

    It joins the worker's cgroups (memory, and pids where that is a hierarchy of its own), then
    builds a new root from nothing and pivots into it: a small tmpfs holding read-only binds of
    the system dirs and the interpreter's own dirs, a fresh /proc of the pid namespace, a /dev
    with only null/zero/full/random/urandom, and fresh tmpfs on /tmp, /var/tmp, /dev/shm, /run
    and /run/lock. Nothing else of the host exists in there: no
    /home, /root, /var, /srv, /sys or project folder, so no host unix socket (those live in /run,
    /tmp, /var and home folders) can be reached, whatever its permissions. The old root is
    detached, then the new root is made read-only.
    """
    q = shlex.quote
    r = _staging(python)
    lines = ["set -e", 'PATH="$PATH:/usr/sbin:/sbin:/usr/bin:/bin"',
             'if [ -n "$SANDBOX_CGROUP_PROCS" ]; then echo 0 > "$SANDBOX_CGROUP_PROCS"; fi',
             'if [ -n "$SANDBOX_PIDS_CGROUP_PROCS" ]; then echo 0 > "$SANDBOX_PIDS_CGROUP_PROCS"; fi',
             f"mount -t tmpfs -o size=4m,mode=755,nosuid,nodev tmpfs {r}",
             f"mkdir -p {r}/proc {r}/dev {r}/var {r}/old-root"]
    if rebinds(python):
        lines += [f"mkdir -p {r}{KEEP}", f"chmod 700 {r}{KEEP}"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            lines.append(f"ln -s {q(os.readlink(d))} {r}{d}")
    lines.append(f"mount -t tmpfs -o size=1m,mode=755,nosuid tmpfs {r}/dev")
    for dev in DEVICES:
        lines += [f"touch {r}/dev/{dev}", f"mount --bind /dev/{dev} {r}/dev/{dev}"]
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        lines.append(f"ln -s {target} {r}/dev/{name}")
    for t in PRIVATE_TMP:
        mode = "755" if t == "/run" else "1777"
        lines += [f"mkdir -p {r}{t}",
                  f"mount -t tmpfs -o size=${{SANDBOX_TMPFS_MB}}m,mode={mode},nosuid,nodev,noatime tmpfs {r}{t}"]
    keep = dict((dst, src) for src, dst in rebinds(python))
    for src, dst in _binds(python):
        lines += [f"mkdir -p {r}{q(dst)}", f"mount --bind {q(src)} {r}{q(dst)}",
                  f"mount -o remount,bind,ro {r}{q(dst)}"]
        if dst in keep:
            k = keep[dst]
            lines += [f"mkdir -p {r}{k}", f"mount --bind {q(src)} {r}{k}", f"mount -o remount,bind,ro {r}{k}"]
    lines += [f"mount -t proc -o nosuid,nodev,noexec proc {r}/proc",
              f"cd {r}", "pivot_root . old-root", "cd /", "umount -l /old-root", "rmdir /old-root",
              "mount -o remount,bind,ro /", 'exec "$@"']
    return "\n".join(lines)


class IsolationWarning(UserWarning):
    pass


@functools.lru_cache(maxsize=1)
def probe() -> tuple[str, str]:
    """('namespaces' | 'none', reason). Tries the real thing once: a no-op inside the namespaces."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "none", "util-linux `unshare` not found"
    tools = os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin"
    missing = [t for t in ("mount", "umount", "pivot_root") if shutil.which(t, path=tools) is None]
    if missing:
        return "none", f"util-linux {', '.join(missing)} not found"
    try:
        argv = _unshare_argv(unshare) + ["sh", "-c", mount_script(), "probe", sys.executable, "-I", "-c", "pass"]
        r = subprocess.run(argv, capture_output=True, timeout=20,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SANDBOX_TMPFS_MB": "1"})
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return "none", f"unshare failed: {e}"
    if r.returncode != 0:
        return "none", f"unshare failed: {r.stderr.decode(errors='replace').strip()[:200]}"
    return "namespaces", ("unshare: net + pid + ipc + mount namespaces, new root"
                          + (", uid drop" if os.geteuid() == 0 else ", user namespace"))


def _unshare_argv(unshare: str) -> list[str]:
    argv = [unshare, "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        argv.insert(1, "--map-root-user")
    return argv


def wrap(argv: list[str], mechanism: str, python: str = "") -> list[str]:
    """The command that starts `argv` under `mechanism`."""
    if mechanism == "none":
        return argv
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("util-linux `unshare` disappeared")
    return _unshare_argv(unshare) + ["sh", "-c", mount_script(python), "sandbox"] + argv


def choose(requested: str) -> tuple[str, str]:
    """Resolve 'auto' | 'namespaces' | 'none' to a usable mechanism, warning when isolation is lost."""
    if requested == "none":
        return "none", "isolation disabled by configuration"
    mech, reason = probe()
    if mech == "none":
        if requested == "namespaces":
            raise RuntimeError(f"sandbox isolation 'namespaces' unavailable: {reason}")
        warnings.warn(f"sandbox: running WITHOUT namespace isolation ({reason}); code can reach the network "
                      "and the file system", IsolationWarning, stacklevel=3)
    return mech, reason


def slot_uid(slot: int, mechanism: str) -> int | None:
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"sandbox slot {slot} outside 0..{MAX_SLOTS - 1}")
    return UID_BASE + slot if mechanism == "namespaces" and os.geteuid() == 0 else None
