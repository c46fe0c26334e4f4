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

This module is the pool; a session is `sandbox.session`, its uid slot `sandbox.slots`, and how the
memory limit binds on this host `sandbox.memory_limit`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from sandbox import isolation
from sandbox.config import SandboxConfig
from sandbox.memory_limit import memory_limit_scope
from sandbox.outcome import lost_result, reply_result
from sandbox.result import CellResult, Stream
from sandbox.session import Session
from sandbox.slots import SLOTS
from sandbox.worker import Worker, WorkerDied

SESSION_SPARES = 16  # closed sessions' workers kept for new ones (at least the pool's size): a problem's samples
SESSION_RESET_SECONDS = 10.0


class SandboxPool:
    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.mechanism, self.isolation_reason = isolation.choose(self.config.isolation)
        self.memory_limit = memory_limit_scope(self.mechanism)
        self.size = self.config.resolved_pool_size()
        self._idle: queue.Queue[Worker | int] = queue.Queue()  # an int is a vacant slot
        self._lock = threading.Lock()
        self._closed = False
        self._sessions: set[Session] = set()  # strong: an unclosed session is closed with the pool
        # workers of closed sessions (each with its slot), reset when the next session takes one
        self._spare_sessions: list[Worker] = []
        self.session_spares = max(SESSION_SPARES, self.size)
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
            result = reply_result(worker, reply, t1 - t0, time.monotonic() - t0)
            keep = reply["clean"] and worker.alive()
        except WorkerDied as e:
            result = lost_result(e, time.monotonic() - t1, t1 - t0, time.monotonic() - t0)
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
        """A fresh session: on the worker of a closed one, reset (its interpreter killed with all it
        started, fresh temporary folders and IPC namespace, a new child forked from the preimported
        worker: what stateless cells get between samples, in milliseconds), else on a new worker
        (a new interpreter importing the preimports: about 0.5 CPU-seconds, measured on 2 cores, which
        a TIR run starting a dozen sessions a problem took from the engine)."""
        if self._closed:
            raise RuntimeError("sandbox pool is closed")
        while True:
            with self._lock:
                spare = self._spare_sessions.pop() if self._spare_sessions else None
            if spare is None:
                break
            if self._reset(spare):
                spare.new_oom_kills(), spare.new_task_limit_hits()  # the last session's, not the next cell's
                return self._register(Session(self.config, self.mechanism, spare.slot,
                                              on_close=self._session_closed, worker=spare))
            spare.close()
            SLOTS.give(spare.slot)
        slot = SLOTS.take()
        try:
            s = Session(self.config, self.mechanism, slot, on_close=self._session_closed)
        except BaseException:
            SLOTS.give(slot)
            raise
        return self._register(s)

    def _register(self, s: Session) -> Session:
        with self._lock:
            closed = self._closed
            if not closed:
                self._sessions.add(s)
        if closed:  # the pool closed while this session started: it must not outlive the pool
            s.close()
            raise RuntimeError("sandbox pool is closed")
        return s

    @staticmethod
    def _reset(worker: Worker) -> bool:
        try:
            return worker.alive() and worker.request({"op": "reset"}, SESSION_RESET_SECONDS).get("reset") is True
        except WorkerDied:
            return False

    def _session_closed(self, session: "Session", worker: Worker | None = None) -> None:
        """A session ended; its worker (when it can serve another) is kept for the next session."""
        with self._lock:
            self._sessions.discard(session)
            keep = worker is not None and not self._closed and len(self._spare_sessions) < self.session_spares
            if keep:
                self._spare_sessions.append(worker)
        if worker is not None and not keep:
            worker.close()
        if not keep:
            SLOTS.give(session.slot)

    def close(self) -> None:
        """Close every idle worker and every open session of this pool; in-flight cells finish first."""
        self._closed = True
        with self._lock:
            sessions = list(self._sessions)
        for s in sessions:
            s.close()
        with self._lock:
            spares, self._spare_sessions = self._spare_sessions, []
        for w in spares:
            w.close()
            SLOTS.give(w.slot)
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
