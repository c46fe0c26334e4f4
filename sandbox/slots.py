"""Sandbox slots: the numbers (hence cell uids) that workers and sessions run under, handed out uniquely.

Its own module because pools, sessions and the sandbox benchmark all take slots from the one
process-wide SLOTS, and uniqueness reaches past this process (flocks, as root).
"""

from __future__ import annotations

import fcntl
import os
import threading

from sandbox import isolation


class Slots:
    """Slot numbers (hence cell uids) in use: unique across all pools and sessions, and, as root,
    across harness processes on the host.

    Sessions used `count() % 1000`, which wrapped onto the pool's slots, so a session and a pool
    worker could share a uid (and its RLIMIT_NPROC budget). Slots are now taken and given back;
    with `lock_dir`, each taken slot also holds an flock on `<lock_dir>/sandbox-slot-<n>.lock`, so
    two harnesses on one host never hand out the same uid (the kernel drops the lock if the
    process dies).
    """

    def __init__(self, n: int, lock_dir: str | None = None):
        self._free = list(range(n - 1, -1, -1))
        self._lock = threading.Lock()
        self._lock_dir = lock_dir
        self._held: dict[int, int] = {}  # slot -> fd of its lock file

    def take(self) -> int:
        with self._lock:
            skipped = []
            try:
                while self._free:
                    slot = self._free.pop()
                    if self._claim(slot):
                        return slot
                    skipped.append(slot)  # another harness holds it
            finally:
                self._free.extend(skipped)
                self._free.sort(reverse=True)
            raise RuntimeError(f"all {len(skipped)} sandbox slots are in use")

    def _claim(self, slot: int) -> bool:
        if self._lock_dir is None:
            return True
        try:
            fd = os.open(os.path.join(self._lock_dir, f"sandbox-slot-{slot}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return True  # no lock folder: unique within this process only
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._held[slot] = fd
        return True

    def give(self, slot: int) -> None:
        with self._lock:
            fd = self._held.pop(slot, None)
            if fd is not None:
                os.close(fd)
            if slot not in self._free:
                self._free.append(slot)
                self._free.sort(reverse=True)


def _lock_dir() -> str | None:
    """Where slot locks live: only as root (only then are uids dropped), in /run/lock if writable."""
    if os.geteuid() != 0:
        return None
    for d in ("/run/lock", "/var/lock", "/tmp"):
        if os.path.isdir(d) and os.access(d, os.W_OK):
            return d
    return None


SLOTS = Slots(isolation.MAX_SLOTS, _lock_dir())
