"""Driving an engine's stream the same way in every backend's tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, AsyncIterator

from aimo_spec.protocol import Event, Request


async def cancel_after(engine: Any, request: Request, n: int) -> list[Event]:
    """Stream `request`, cancel it once `n` events have arrived, and return every event it sent (a
    well-behaved engine ends with exactly one Final)."""
    events: list[Event] = []
    async for ev in engine.generate(request):
        events.append(ev)
        if len(events) == n:
            engine.cancel(request.request_id)
    return events


@contextlib.asynccontextmanager
async def engine_thread_held(engine: Any, queued: int, seconds: float = 60.0) -> AsyncIterator[None]:
    """An embedded engine's thread parked between steps while the block submits (and cancels) requests; on
    leaving, once `queued` items wait in its inbox, it is let go and takes them all in one drain, in order.
    Without it a test racing the engine thread with sleeps failed, or hung, on a loaded box."""
    entered, gate = threading.Event(), threading.Event()
    held = threading.Thread(target=engine.call_in_engine_thread, args=(lambda: entered.set() or gate.wait(),),
                            daemon=True, name="engine-held")
    held.start()
    try:
        assert await asyncio.to_thread(entered.wait, seconds), "the engine thread never reached the gate"
        yield
        for _ in range(int(seconds * 100)):  # each submission is queued as its task first runs
            if engine._inbox.qsize() >= queued:
                break
            await asyncio.sleep(0.01)
        assert engine._inbox.qsize() >= queued, f"{engine._inbox.qsize()} of {queued} items reached the inbox"
    finally:
        gate.set()
        held.join(seconds)
