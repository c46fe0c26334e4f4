"""The API the TIR harness uses: a warm pool for stateless cells, and stateful sessions.

    pool = SandboxPool()                      # warm workers, sized to the machine
    r = pool.run("print(sp.factorint(2**32 + 1))")
    r = await pool.arun(code)                 # same, from asyncio
    with pool.session() as s:                 # later cells see earlier variables
        s.run("x = 21"); s.run("print(2 * x)")

Nothing a cell does raises here: every outcome is a CellResult (ok | error | timeout | killed |
output_truncated). Crashed or hung workers are replaced; the pool keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from sandbox import isolation
from sandbox.config import SandboxConfig
from sandbox.result import CellResult, Stream, from_reply
from sandbox.worker import Worker, WorkerDied


def _lost(e: WorkerDied, seconds: float, queue_seconds: float, total: float) -> CellResult:
    status = "timeout" if e.hung else "killed"
    return CellResult(status, Stream.empty(), Stream.empty(), None, None, seconds, queue_seconds, total)


class SandboxPool:
    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.mechanism, self.isolation_reason = isolation.choose(self.config.isolation)
        self.size = self.config.resolved_pool_size()
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._slots = itertools.count(self.size)  # session slots come after the pool's
        self._lock = threading.Lock()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=max(64, 4 * self.size), thread_name_prefix="sandbox")
        starters = [self._executor.submit(Worker, self.config, self.mechanism, i) for i in range(self.size)]
        for f in starters:
            self._idle.put(f.result())
        self.restarts = 0

    # ---- stateless cells
    def run(self, code: str, timeout: float | None = None) -> CellResult:
        if self._closed:
            raise RuntimeError("sandbox pool is closed")
        timeout = float(timeout or self.config.limits.wall_seconds)
        t0 = time.monotonic()
        worker = self._idle.get()
        t1 = time.monotonic()
        try:
            reply = worker.request({"op": "run", "code": code, "timeout": timeout}, timeout)
            result = from_reply(reply, t1 - t0, time.monotonic() - t0)
        except WorkerDied as e:
            result = _lost(e, time.monotonic() - t1, t1 - t0, time.monotonic() - t0)
            worker = self._replace(worker)
        finally:
            if not self._closed:
                self._idle.put(worker)
        return result

    async def arun(self, code: str, timeout: float | None = None) -> CellResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.run, code, timeout)

    def _replace(self, worker: Worker) -> Worker:
        worker.close()
        with self._lock:
            self.restarts += 1
        return Worker(self.config, self.mechanism, worker.slot)

    # ---- stateful sessions
    def session(self) -> "Session":
        return Session(self.config, self.mechanism, next(self._slots) % 1000)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                break
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """One sample's python state across its cells, in a worker of its own.

    A cell that crashes the interpreter (os._exit, a hard memory kill, C code that ignores the
    timer) takes the worker with it: the session starts a new one and replays the cells that had
    completed, so the state comes back; the result says so (`restarted`, `note`).
    """

    def __init__(self, config: SandboxConfig, mechanism: str, slot: int):
        self.config, self.mechanism, self.slot = config, mechanism, slot
        self._history: list[tuple[str, float]] = []
        self._worker = Worker(config, mechanism, slot, mode="inline")
        self.restarts = 0

    def run(self, code: str, timeout: float | None = None) -> CellResult:
        timeout = float(timeout or self.config.limits.wall_seconds)
        t0 = time.monotonic()
        try:
            reply = self._worker.request({"op": "run", "code": code, "timeout": timeout}, timeout)
        except WorkerDied as e:
            result = _lost(e, time.monotonic() - t0, 0.0, time.monotonic() - t0)
            return replace(result, restarted=True, note=self._restart())
        result = from_reply(reply, 0.0, time.monotonic() - t0)
        if result.status != "timeout":
            self._history.append((code, timeout))
        return result

    def _restart(self) -> str:
        self._worker.close()
        self.restarts += 1
        self._worker = Worker(self.config, self.mechanism, self.slot, mode="inline")
        for i, (code, timeout) in enumerate(self._history):
            try:
                self._worker.request({"op": "run", "code": code, "timeout": timeout}, timeout)
            except WorkerDied:
                lost = len(self._history) - i
                self._history = self._history[:i]
                self._worker.close()
                self._worker = Worker(self.config, self.mechanism, self.slot, mode="inline")
                return (f"[the python session crashed and was restarted; {lost} earlier cell(s) could not be "
                        "re-run, so their variables are gone]")
        n = len(self._history)
        return f"[the python session crashed and was restarted; {n} earlier cell(s) were re-run]"

    async def arun(self, code: str, timeout: float | None = None) -> CellResult:
        return await asyncio.to_thread(self.run, code, timeout)

    def close(self) -> None:
        self._worker.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
