"""How a sandbox worker is wrapped: Linux namespaces via util-linux `unshare`, or nothing.

`namespaces` (default where it works): new network namespace (no interfaces up: no network at all,
loopback included), new pid namespace (the worker is its pid 1, the harness is invisible, killing
the worker kills every descendant), new mount namespace with every existing mount remounted
read-only and private tmpfs on /tmp, /var/tmp, /dev/shm and /run/lock. As root, cells also drop to
a per-slot unprivileged uid, which makes RLIMIT_NPROC bind and keeps them from signalling or
tracing the worker. Without root, an unprivileged user namespace is used instead (no uid drop).

`none`: rlimits, timeouts and process-group kills only; chosen with a loud warning when namespaces
are unavailable, or explicitly for debugging.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import warnings

UID_BASE = 61000  # slot k runs cells as uid UID_BASE + k (root only)

_REMOUNT_READ_ONLY = r"""
for mp in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do
  case "$mp" in /proc|/proc/*) continue;; esac
  mount -o remount,bind,ro "$mp" 2>/dev/null || true
done
mount -t tmpfs -o size=${SANDBOX_TMPFS_MB}m,mode=1777,nosuid,nodev tmpfs /dev/shm
"""
PRIVATE_TMP = ("/tmp", "/var/tmp", "/run/lock")  # each gets a private tmpfs (and /dev/shm above)


def _runtime_dirs() -> list[str]:
    """Folders the cell's interpreter must read: its prefixes and package folders."""
    paths = {sys.base_prefix, sys.prefix, *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    return sorted(os.path.realpath(p) for p in paths if os.path.isdir(p))


def _exposures() -> dict[str, list[str]]:
    """{hidden ancestor: [runtime dirs under it]} for dirs the unprivileged uid cannot reach.

    pyenv puts Python under /root (mode 700): the cell could run but not import anything that the
    worker had not already loaded. Inside the mount namespace such an ancestor is covered by an
    empty tmpfs and only the runtime dirs are bound back (read-only).
    """
    out: dict[str, list[str]] = {}
    for d in _runtime_dirs():
        parts = d.strip("/").split("/")
        for i in range(1, len(parts)):
            anc = "/" + "/".join(parts[:i])
            if not os.stat(anc).st_mode & stat.S_IXOTH:
                out.setdefault(anc, [])
                if not any(d.startswith(q + "/") or d == q for q in out[anc]):
                    out[anc] = [q for q in out[anc] if not q.startswith(d + "/")] + [d]
                break
    return out


def _covered_runtime() -> list[str]:
    """Runtime folders that a private tmpfs would hide (a checkout or venv under /tmp, say)."""
    needed = {os.path.realpath(p) for p in (*_runtime_dirs(), os.path.dirname(os.path.abspath(__file__)))}
    needed.add(os.path.abspath(sys.prefix))  # the venv itself, whose bin/python may be a symlink
    return sorted(p for p in needed if any(p == t or p.startswith(t + "/") for t in PRIVATE_TMP))


def _rebind(stage: str, target: str) -> list[str]:
    q = shlex.quote(target)
    return [f"mkdir -p {q}", f"mount --bind {stage} {q}", f"mount -o remount,bind,ro {q}", f"umount {stage}"]


def mount_script() -> str:
    """Shell run as the namespace's first process, before the worker is exec'd."""
    lines = ["set -e", _REMOUNT_READ_ONLY]
    covered = _covered_runtime()
    for k, d in enumerate(covered):  # stage on the fresh /dev/shm before /tmp is covered
        lines += [f"mkdir -p /dev/shm/.keep-{k}", f"mount --bind {shlex.quote(d)} /dev/shm/.keep-{k}"]
    for t in PRIVATE_TMP:
        lines.append(f'if [ -d {t} ]; then mount -t tmpfs -o size=${{SANDBOX_TMPFS_MB}}m,mode=1777,nosuid,nodev tmpfs {t}; fi')
    for k, d in enumerate(covered):
        lines += _rebind(f"/dev/shm/.keep-{k}", d) + [f"rmdir /dev/shm/.keep-{k}"]
    for i, (anc, dirs) in enumerate(sorted(_exposures().items())):
        for j, d in enumerate(dirs):
            lines += [f"mkdir -p /dev/shm/.expose-{i}-{j}", f"mount --bind {shlex.quote(d)} /dev/shm/.expose-{i}-{j}"]
        lines.append(f"mount -t tmpfs -o size=1m,mode=755 tmpfs {shlex.quote(anc)}")
        for j, d in enumerate(dirs):
            lines += _rebind(f"/dev/shm/.expose-{i}-{j}", d) + [f"rmdir /dev/shm/.expose-{i}-{j}"]
    lines.append('exec "$@"')
    return "\n".join(lines)


class IsolationWarning(UserWarning):
    pass


@functools.lru_cache(maxsize=1)
def probe() -> tuple[str, str]:
    """('namespaces' | 'none', reason). Tries the real thing once: a no-op inside the namespaces."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "none", "util-linux `unshare` not found"
    argv = _unshare_argv(unshare) + ["sh", "-c", mount_script(), "probe", "true"]
    try:
        r = subprocess.run(argv, capture_output=True, timeout=10, env={**os.environ, "SANDBOX_TMPFS_MB": "1"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return "none", f"unshare failed: {e}"
    if r.returncode != 0:
        return "none", f"unshare failed: {r.stderr.decode(errors='replace').strip()[:200]}"
    return "namespaces", "unshare: net + pid + mount namespaces" + (", uid drop" if os.geteuid() == 0 else ", user namespace")


def _unshare_argv(unshare: str) -> list[str]:
    argv = [unshare, "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--propagation", "private"]
    if os.geteuid() != 0:
        argv.insert(1, "--map-root-user")
    return argv


def wrap(argv: list[str], mechanism: str) -> list[str]:
    """The command that starts `argv` under `mechanism`."""
    if mechanism == "none":
        return argv
    unshare = shutil.which("unshare")
    assert unshare is not None
    return _unshare_argv(unshare) + ["sh", "-c", mount_script(), "sandbox"] + argv


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
    return UID_BASE + slot if mechanism == "namespaces" and os.geteuid() == 0 else None
