"""Driving an engine's stream the same way in every backend's tests."""

from __future__ import annotations

from typing import Any

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
