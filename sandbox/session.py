"""Stateful python sessions: one sample's variables across its cells, restored after a crash.

Its own module because a session lives apart from the pool's warm workers (a worker and slot of
its own, recycled by the pool once the session ends) and carries the crash-restore machinery
stateless cells do not need.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

from sandbox.config import SandboxConfig
from sandbox.isolation import slot_uid
from sandbox.outcome import lost_result, reply_result
from sandbox.result import CellResult, Stream
from sandbox.worker import Worker, WorkerDied

SESSION_MIN_SECONDS = 0.05  # a session cell needs at least this much of its time limit left to start
KILL_JOIN_SECONDS = 10.0
PARK_SECONDS = 5.0  # for a worker to kill what an ended session left running


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

    Between cells every process a cell started is killed and the interpreter is stopped (SIGSTOP, every
    thread): threads are part of its state and run on only while a cell runs (their output lands in
    that cell), so one left spinning costs no CPU between cells.
    The memory limit covers the session's interpreter and all it started, across its cells.
    """

    def __init__(self, config: SandboxConfig, mechanism: str, slot: int, on_close=None,
                 worker: Worker | None = None):
        """`worker`: a session worker of `slot` whose interpreter was just reset (`SandboxPool` recycles
        the workers of closed sessions); None starts a new one. `on_close(session, worker)` gets the
        worker back when it can serve another session (no cell running, no restore), else None."""
        self.config, self.mechanism, self.slot = config, mechanism, slot
        self._on_close = on_close
        self._history: list[tuple[str, float]] = []
        self._worker: Worker | None = worker or Worker(config, mechanism, slot, mode="session")
        self._run_lock = threading.Lock()  # one cell at a time
        self._wlock = threading.Lock()  # guards _worker and _closed against the restore thread
        self._restore: threading.Thread | None = None
        self._restore_note = ""
        self._threads: set[int] = set()  # ids of the threads the cells so far left running (listed after each cell)
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
                result = lost_result(e, time.monotonic() - t1, t1 - t0, time.monotonic() - t0)
                if self._closed:  # killed by `close` under the cell: nothing to restore
                    return result
                return replace(result, restarted=True, note="\n".join(
                    n for n in (self._threads_suspected(), self._crashed(fresh_worker=True)) if n))
            result = reply_result(worker, reply, t1 - t0, time.monotonic() - t0)
            if self._closed:
                return result
            if reply.get("crashed") or not reply["clean"]:
                return replace(result, restarted=True, note="\n".join(
                    n for n in (note, result.note, self._threads_suspected(),
                                self._crashed(fresh_worker=not reply["clean"])) if n))
            if result.status != "timeout":
                self._history.append((code, timeout))
            note = "\n".join(n for n in (note, result.note, self._threads_started(reply)) if n)
            return replace(result, note=note) if note != result.note else result

    def _threads_started(self, reply: dict) -> str:
        """The note for a cell that left threads running: they run on in later cells (the interpreter is
        stopped between cells) and what they print or do lands there."""
        threads = set(reply.get("threads") or ())
        started, self._threads = len(threads - self._threads), threads
        if not started:
            return ""
        return (f"[this cell left {started} thread(s) running; they go on running during later cells, and what they "
                "print or do lands in those cells]")

    def _threads_suspected(self) -> str:
        """For a crash while threads of earlier cells ran: those threads, not this cell's code, may be the
        cause (a timer that exits the interpreter fired in whichever cell came next)."""
        if not self._threads:
            return ""
        return (f"[{len(self._threads)} thread(s) that earlier cells left running were running too: one of them, "
                "rather than this cell's code, may have ended the session]")

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
        # started before it is published: `close`, from another thread (a sample cancelled while its cell
        # crashed), joins whatever `_restore` holds, and joining a thread not started yet raises (it ended a
        # `make solve` run); a close that sees none leaves the job to find the session closed
        t.start()
        self._restore = t
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
                self._restore_note = (f"[the python session could not be restored ({type(e).__name__}); "
                                      "its variables are gone]")

    def _rebuild(self, history: list[tuple[str, float]], fresh_worker: bool) -> None:
        """Bring back the state of `history` within the replay budget; record what could not be."""
        budget_end = time.monotonic() + float(self.config.limits.wall_seconds)
        target = history
        while True:
            if not self._fresh_interpreter(fresh_worker):
                self._history, self._restore_note = [], (
                    f"[the python session could not be restored; the variables of {len(history)} earlier cell(s) "
                    "are gone]")
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
        self._threads = set()  # the replay lists those the re-run cells leave
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
            # the replayed cell's, reported with it already: not the next cell's
            w.new_oom_kills(), w.new_task_limit_hits()
            if reply.get("crashed") or not reply["clean"]:
                return i, True
            self._threads = set(reply.get("threads") or ())
            if reply["status"]["kind"] == "timeout":
                return i, False
        return len(cells), False

    async def arun(self, code: str, timeout: float | None = None) -> CellResult:
        return await asyncio.to_thread(self.run, code, timeout)

    def close(self) -> None:
        """End the session: everything its code started is killed now. Its worker, emptied (`park`),
        goes back to `on_close` for another session when it was idle (no cell running, no restore)
        and its cells ran as the slot's uid in namespaces of their own (not isolation 'none', not user
        namespaces alone, where cells are root inside theirs); else the worker is killed with
        everything in it (a running restore stops with it)."""
        with self._wlock:
            if self._closed:
                return
            self._closed = True
            w, self._worker = self._worker, None
        idle = self._run_lock.acquire(blocking=False)  # no cell of this session is running
        if idle:
            self._run_lock.release()
        t = self._restore  # read once: a cell's thread may clear it meanwhile
        restoring = t is not None and t.is_alive()
        # recycled only where cells run as the slot's own uid (root host + namespaces): with user
        # namespaces alone they are root inside theirs, and what such a cell changes there could outlive it
        spare = w if (w is not None and idle and not restoring and self._on_close is not None
                      and slot_uid(self.slot, self.mechanism) is not None and _park(w)) else None
        if w is not None and spare is None and not (idle and not restoring):
            # a cell's thread or the restore still reads from it (a sample cancelled mid-cell): kill it
            # now, and free its descriptors only once they have seen it die and let go (closed under a
            # reader, a descriptor number could be reused by another session's worker and read there)
            w.kill()
            if t is not None:
                t.join(KILL_JOIN_SECONDS)
            if not idle and self._run_lock.acquire(timeout=KILL_JOIN_SECONDS):
                self._run_lock.release()
        if w is not None and spare is None:
            w.close()
        if self._on_close is not None:
            self._on_close(self, spare)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _park(worker: Worker) -> bool:
    """Kill what the ended session left in its worker; True when the worker is empty and alive."""
    try:
        return worker.alive() and worker.request({"op": "park"}, PARK_SECONDS).get("parked") is True
    except WorkerDied:
        return False
