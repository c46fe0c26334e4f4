"""Shared by the sandbox attack tests (tests/test_sandbox_attacks*.py): the time bound every attack test
runs under, the one-worker pool, and the host checks (`ps`, survivors, a session's uid).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sandbox import SandboxConfig, SandboxPool, isolation
from sandbox.config import Limits

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(preimports=("import math",))
TEST_BOUND_SECONDS = 30


@pytest.fixture(autouse=True)
def bounded():
    """No attack test may run longer than TEST_BOUND_SECONDS (no pytest-timeout here: SIGALRM)."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"attack test ran past {TEST_BOUND_SECONDS} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TEST_BOUND_SECONDS)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def pool():
    """One worker, so consecutive cells are known to share it (the worst case for leftovers)."""
    p = SandboxPool(SandboxConfig(pool_size=1, limits=Limits(wall_seconds=5, memory_mb=256), **FAST))
    yield p
    p.close()


def healthy(p: SandboxPool) -> None:
    r = p.run("print(6 * 7)")
    assert r.status == "ok" and r.stdout.text == "42\n", r


def idle_worker(p: SandboxPool):
    """The pool's idle worker, once there is one (a replacement may still be starting)."""
    w = p._idle.get(timeout=30)
    p._idle.put(w)
    assert not isinstance(w, int), "vacant slot"
    return w


def ps() -> list[tuple[int, int, str]]:
    """(pid, uid, whole command line) of every process on the host, from `ps` (-ww: never cut to the
    terminal's width, which a COLUMNS variable would set, so a marker at the end is always seen)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,uid=,args="], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        pid, uid, *args = line.split(None, 2)
        rows.append((int(pid), int(uid), args[0] if args else ""))
    return rows


def survivors(uid: int | None = None, marker: str | None = None) -> list[tuple[int, int, str]]:
    """Host processes running as `uid` or whose command line holds `marker`."""
    me = os.getpid()
    return [r for r in ps() if r[0] != me and "ps -eo" not in r[2]
            and ((uid is not None and r[1] == uid) or (marker is not None and marker in r[2]))]


def wait_gone(uid: int | None = None, marker: str | None = None, seconds: float = 3.0) -> list:
    deadline = time.monotonic() + seconds
    while (left := survivors(uid, marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def session_uid(s) -> int:
    uid = isolation.slot_uid(s.slot, s.mechanism)
    assert uid is not None, "these tests run as root with namespaces, like CI"
    return uid


SPINNER = ("import os, signal, sys, time\ntry:\n    os.setsid()\nexcept OSError:\n    pass\n"
           "signal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass")


def detached_spinner(marker: str) -> str:
    """Cell code starting a setsid() child that ignores SIGALRM, SIGTERM and SIGHUP, and spins."""
    child = ("import os, signal\nos.setsid()\nfor s in (signal.SIGALRM, signal.SIGTERM, signal.SIGHUP):\n"
             "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass")
    return (f"import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', {child!r}, {marker!r}], start_new_session=True)\n")
