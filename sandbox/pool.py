"""The API the TIR harness uses: a warm pool for stateless cells, and stateful sessions.

    pool = SandboxPool()                      # warm workers, sized to the machine
    r = pool.run("print(sp.factorint(2**32 + 1))")
    r = await pool.arun(code)                 # same, from asyncio
    with pool.session() as s:                 # later cells see earlier variables
        s.run("x = 21"); s.run("print(2 * x)")

Nothing a cell does raises here: every outcome is a CellResult (ok | error | timeout | killed |
output_truncated). A worker that crashed, hung, answered nonsense or could not clean up after a
cell is never handed another cell: it is replaced in the background, and a slot whose replacement
failed stays vacant (never a dead worker in the idle queue) until a later caller starts it again.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from sandbox import cgroup, isolation
from sandbox.config import SandboxConfig
from sandbox.result import CellResult, Stream, from_reply
from sandbox.worker import Worker, WorkerDied

SESSION_MIN_SECONDS = 0.05  # a session cell needs at least this much of its time limit left to start


class MemoryLimitWarning(isolation.IsolationWarning):
    """The memory limit binds per process only (no writable memory cgroup)."""


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


def _lost(e: WorkerDied, seconds: float, queue_seconds: float, total: float) -> CellResult:
    status = "timeout" if e.hung else "killed"
    return CellResult(status, Stream.empty(), Stream.empty(), None, None, seconds, queue_seconds, total,
                      reason="" if e.hung else "the sandbox worker running it failed and was replaced",
                      fault="" if e.hung else "worker lost")


def _result(worker: Worker, reply: dict, queue_seconds: float, total: float) -> CellResult:
    limits = worker.config.limits
    return from_reply(reply, queue_seconds, total, worker.new_oom_kills(), limits.memory_mb,
                      worker.new_task_limit_hits(), limits.max_processes)


def _memory_check(mechanism: str) -> str:
    """How the memory limit binds here; warns when it is per process only."""
    if mechanism != "namespaces":
        return "memory limit per process (RLIMIT_AS)"
    version, _, reason = cgroup.available()
    if version is None:
        import warnings

        warnings.warn(f"sandbox: {reason}; the memory limit binds per process only, so a cell's forked "
                      "children can together exceed it", MemoryLimitWarning, stacklevel=3)
        return "memory limit per process (RLIMIT_AS)"
    return reason


class SandboxPool:
    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.mechanism, self.isolation_reason = isolation.choose(self.config.isolation)
        self.memory_limit = _memory_check(self.mechanism)
        self.size = self.config.resolved_pool_size()
        self._idle: queue.Queue[Worker | int] = queue.Queue()  # an int is a vacant slot
        self._lock = threading.Lock()
        self._closed = False
        self._sessions: set[Session] = set()  # strong: an unclosed session is closed with the pool
        self.restarts = 0
        self._slots = [SLOTS.take() for _ in range(self.size)]
        self._executor = ThreadPoolExecutor(max_workers=max(64, 4 * self.size), thread_name_prefix="sandbox")
        starters = [self._executor.submit(Worker, self.config, self.mechanism, s) for s in self._slots]
        try:
            for f in starters:
                self._idle.put(f.result())
        except BaseException:
            self.close()
            raise

    # ---- stateless cells
    def run(self, code: str, timeout: float | None = None) -> CellResult:
        if self._closed:
            raise RuntimeError("sandbox pool is closed")
        timeout = float(timeout or self.config.limits.wall_seconds)
        t0 = time.monotonic()
        item = self._idle.get()
        worker = self._usable(item)
        t1 = time.monotonic()
        if isinstance(worker, str):
            return CellResult("killed", Stream.empty(), Stream.empty(), None, None, 0.0, t1 - t0, t1 - t0,
                              reason=f"no sandbox worker could be started: {worker}", fault="no worker")
        keep = False
        try:
            reply = worker.request({"op": "run", "code": code, "timeout": timeout}, timeout)
            result = _result(worker, reply, t1 - t0, time.monotonic() - t0)
            keep = reply["clean"] and worker.alive()
        except WorkerDied as e:
            result = _lost(e, time.monotonic() - t1, t1 - t0, time.monotonic() - t0)
        finally:
            if keep and not self._closed:
                self._idle.put(worker)
            else:
                self._retire(worker)
        return result

    async def arun(self, code: str, timeout: float | None = None) -> CellResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.run, code, timeout)

    def _usable(self, item: Worker | int) -> Worker | str:
        """A live worker for `item`, checked before it gets a cell; else why none could be started.

        A vacant slot or a worker found dead is (re)started here; if that fails the slot goes back
        vacant, so the pool keeps its size and a later caller tries again.
        """
        if isinstance(item, int):
            slot = item
        else:
            if item.alive():
                return item
            slot = item.slot
            item.close()
            with self._lock:
                self.restarts += 1
        try:
            return Worker(self.config, self.mechanism, slot)
        except Exception as e:  # noqa: BLE001 - reported to the caller as a result
            self._idle.put(slot)
            return f"{type(e).__name__}: {e}"

    def _retire(self, worker: Worker) -> None:
        """Close a worker that must not get another cell and start its replacement in the background."""
        worker.close()
        if self._closed:
            return
        with self._lock:
            self.restarts += 1
        try:
            self._executor.submit(self._refill, worker.slot)
        except RuntimeError:  # executor shut down: the pool is closing
            pass

    def _refill(self, slot: int) -> None:
        try:
            w = Worker(self.config, self.mechanism, slot)
        except Exception:  # noqa: BLE001 - the slot stays vacant; the next caller retries
            self._idle.put(slot)
            return
        if self._closed:
            w.close()
        else:
            self._idle.put(w)

    # ---- stateful sessions
    def session(self) -> "Session":
        if self._closed:
            raise RuntimeError("sandbox pool is closed")
        slot = SLOTS.take()
        try:
            s = Session(self.config, self.mechanism, slot, on_close=self._session_closed)
        except BaseException:
            SLOTS.give(slot)
            raise
        with self._lock:
            self._sessions.add(s)
        return s

    def _session_closed(self, session: "Session") -> None:
        with self._lock:
            self._sessions.discard(session)
        SLOTS.give(session.slot)

    def close(self) -> None:
        """Close every idle worker and every open session of this pool; in-flight cells finish first."""
        self._closed = True
        with self._lock:
            sessions = list(self._sessions)
        for s in sessions:
            s.close()
        while True:
            try:
                item = self._idle.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, int):
                item.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for slot in self._slots:
            SLOTS.give(slot)
        self._slots = []

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """One sample's python state across its cells, in a worker of its own.

    A cell that crashes its interpreter (os._exit, a signal, a hard memory kill, code that ignores
    the timer, or anything that breaks the protocol with the worker) returns at once, bounded by
    its own time limit, marked `restarted`. The session is then restored in the background: a fresh
    interpreter (forked from the warm worker, or a new worker if that one is gone) re-runs the cells
    that had completed, within a replay budget of `limits.wall_seconds` in all. The next call waits
    for that restore, and the wait counts against its own time limit (`queue_seconds` says how
    long), so no call ever takes longer than its timeout plus a fixed grace. If the restore could
    not re-run every cell, the next result's note says which state is gone.

    Between cells every process a cell started is killed; threads are part of the interpreter's
    state and keep running until the session ends (their output lands in the cell running then).
    The memory limit covers the session's interpreter and all it started, across its cells.
    """

    def __init__(self, config: SandboxConfig, mechanism: str, slot: int, on_close=None):
        self.config, self.mechanism, self.slot = config, mechanism, slot
        self._on_close = on_close
        self._history: list[tuple[str, float]] = []
        self._worker: Worker | None = Worker(config, mechanism, slot, mode="session")
        self._run_lock = threading.Lock()  # one cell at a time
        self._wlock = threading.Lock()  # guards _worker and _closed against the restore thread
        self._restore: threading.Thread | None = None
        self._restore_note = ""
        self._closed = False
        self.restarts = 0

    def run(self, code: str, timeout: float | None = None) -> CellResult:
        timeout = float(timeout or self.config.limits.wall_seconds)
        t0 = time.monotonic()
        deadline = t0 + timeout
        with self._run_lock:
            if self._closed:
                raise RuntimeError("sandbox session is closed")
            waited = self._wait_restore(deadline)
            t1 = time.monotonic()
            note = self._take_restore_note()
            if waited is None or deadline - t1 < SESSION_MIN_SECONDS:
                msg = ("[the python session is still being restored after a crash (its earlier cells are being "
                       "re-run); this cell did not run, try it again]" if waited is None else
                       "[this cell's time limit was used up waiting for the python session to be restored]")
                return CellResult("timeout", Stream.empty(), Stream.empty(), None, None, 0.0, t1 - t0, t1 - t0,
                                  note="\n".join(n for n in (note, msg) if n), fault="session restoring")
            worker = self._worker or self._start_worker()
            if isinstance(worker, str):
                return CellResult("killed", Stream.empty(), Stream.empty(), None, None, 0.0, t1 - t0, t1 - t0,
                                  reason=f"the python session could not be restarted: {worker}",
                                  fault="session lost")
            left = deadline - t1
            try:
                reply = worker.request({"op": "run", "code": code, "timeout": left}, left)
            except WorkerDied as e:
                result = _lost(e, time.monotonic() - t1, t1 - t0, time.monotonic() - t0)
                return replace(result, restarted=True, note=self._crashed(fresh_worker=True))
            result = _result(worker, reply, t1 - t0, time.monotonic() - t0)
            if reply.get("crashed") or not reply["clean"]:
                return replace(result, restarted=True, note="\n".join(
                    n for n in (note, result.note, self._crashed(fresh_worker=not reply["clean"])) if n))
            if result.status != "timeout":
                self._history.append((code, timeout))
            return replace(result, note="\n".join(n for n in (note, result.note) if n)) if note else result

    def _start_worker(self) -> Worker | str:
        try:
            w = Worker(self.config, self.mechanism, self.slot, mode="session")
        except Exception as e:  # noqa: BLE001 - reported as a result
            return f"{type(e).__name__}: {e}"
        with self._wlock:
            if self._closed:
                w.close()
                return "the session was closed"
            self._worker = w
        return w

    def _crashed(self, fresh_worker: bool) -> str:
        """Start the background restore; the note for the crashed cell."""
        self.restarts += 1
        n = len(self._history)
        t = threading.Thread(target=self._restore_job, args=(list(self._history), fresh_worker), daemon=True,
                             name=f"sandbox-session-{self.slot}-restore")
        self._restore = t
        t.start()
        return (f"[the python session crashed and is being restarted; its {n} earlier cell(s) are re-run in the "
                "background, so their variables come back]")

    def _wait_restore(self, deadline: float) -> float | None:
        """Seconds waited for a running restore (0 if none), or None if it is still running at the deadline."""
        t = self._restore
        if t is None:
            return 0.0
        t0 = time.monotonic()
        t.join(max(0.0, deadline - t0))
        if t.is_alive():
            return None
        self._restore = None
        return time.monotonic() - t0

    def _take_restore_note(self) -> str:
        note, self._restore_note = self._restore_note, ""
        return note

    def _restore_job(self, history: list[tuple[str, float]], fresh_worker: bool) -> None:
        """Run `_restore` in the background thread; a failure becomes a note, never a traceback."""
        try:
            self._rebuild(history, fresh_worker)
        except Exception as e:  # noqa: BLE001 - e.g. the session was closed under it
            if not self._closed:
                self._history = []
                self._restore_note = f"[the python session could not be restored ({type(e).__name__}); its variables are gone]"

    def _rebuild(self, history: list[tuple[str, float]], fresh_worker: bool) -> None:
        """Bring back the state of `history` within the replay budget; record what could not be."""
        budget_end = time.monotonic() + float(self.config.limits.wall_seconds)
        target = history
        while True:
            if not self._fresh_interpreter(fresh_worker):
                self._history, self._restore_note = [], (
                    f"[the python session could not be restored; the variables of {len(history)} earlier cell(s) are gone]")
                return
            done, crashed = self._replay(target, budget_end)
            if done == len(target) or not crashed:
                break
            target, fresh_worker = target[:done], False  # the crash took the state: rebuild the prefix
        self._history = target[:done]
        if done < len(history):
            self._restore_note = (f"[after the crash only {done} of {len(history)} earlier cell(s) could be re-run "
                                  "within the replay budget; the variables of the others are gone]")

    def _fresh_interpreter(self, fresh_worker: bool) -> bool:
        """An empty session interpreter: reset the worker's child, or start a new worker."""
        with self._wlock:
            if self._closed:
                return False
            w = self._worker
        if w is not None and not fresh_worker and w.alive():
            try:
                if w.request({"op": "reset"}, 10.0).get("reset") is True:
                    return True
            except WorkerDied:
                pass
        with self._wlock:
            old, self._worker = self._worker, None
        if old is not None:
            old.close()
        return not isinstance(self._start_worker(), str)

    def _replay(self, cells: list[tuple[str, float]], budget_end: float) -> tuple[int, bool]:
        """(cells re-run, whether the interpreter crashed doing so)."""
        for i, (code, timeout) in enumerate(cells):
            left = budget_end - time.monotonic()
            w = self._worker
            if left < SESSION_MIN_SECONDS or w is None or self._closed:
                return i, False
            try:
                reply = w.request({"op": "run", "code": code, "timeout": min(timeout, left)}, min(timeout, left))
            except WorkerDied:
                return i, True
            w.new_oom_kills(), w.new_task_limit_hits()  # the replayed cell's, reported with it already: not the next cell's
            if reply.get("crashed") or not reply["clean"]:
                return i, True
            if reply["status"]["kind"] == "timeout":
                return i, False
        return len(cells), False

    async def arun(self, code: str, timeout: float | None = None) -> CellResult:
        return await asyncio.to_thread(self.run, code, timeout)

    def close(self) -> None:
        """Kill the session's worker and everything in it now (a running restore stops with it)."""
        with self._wlock:
            if self._closed:
                return
            self._closed = True
            w, self._worker = self._worker, None
        if w is not None:
            w.close()
        t = self._restore
        if t is not None:
            t.join(KILL_JOIN_SECONDS)
        if self._on_close is not None:
            self._on_close(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


KILL_JOIN_SECONDS = 10.0
