"""A cell's outcome as the CellResult its caller gets: the worker's reply, or the worker lost under it.

Shared by the pool (stateless cells) and sessions, which both turn a worker's answer, or its
death, into a result the same way.
"""

from __future__ import annotations

from sandbox.result import CellResult, Stream, from_reply
from sandbox.worker import Worker, WorkerDied


def lost_result(e: WorkerDied, seconds: float, queue_seconds: float, total: float) -> CellResult:
    """The result of a cell whose worker died or hung under it (timeout if hung, else killed)."""
    status = "timeout" if e.hung else "killed"
    return CellResult(status, Stream.empty(), Stream.empty(), None, None, seconds, queue_seconds, total,
                      reason="" if e.hung else "the sandbox worker running it failed and was replaced",
                      fault="" if e.hung else "worker lost")


def reply_result(worker: Worker, reply: dict, queue_seconds: float, total: float) -> CellResult:
    """The result of a worker's reply, with the memory and task-limit hits of its cell."""
    limits = worker.config.limits
    return from_reply(reply, queue_seconds, total, worker.new_oom_kills(), limits.memory_mb,
                      worker.new_task_limit_hits(), limits.max_processes)
