"""The server's engine through its life: loading (in a thread, so the server answers 503 meanwhile),
serving, failed, draining. `/health` reports it and every API route asks it for the Api.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from server.openai.api import Api
from server.openai.api_error import ApiError

LOADING_RETRY_SECONDS = 5  # Retry-After of a 503 while the engine loads (a load takes seconds to minutes)


class State:
    """The engine as it loads (in a thread, so the server answers 503 meanwhile), serves, and drains."""

    def __init__(self, load: Callable[[], Any], model_name: str,
                 on_failure: Optional[Callable[[BaseException], None]] = None):
        self.model_name = model_name
        self.api: Optional[Api] = None
        self.error: Optional[str] = None
        self.draining = False
        self.active = 0  # HTTP requests being answered now: the drain ends when none is left
        self.started = time.monotonic()
        self.loaded_seconds: Optional[float] = None
        self._load, self._on_failure = load, on_failure
        self._thread = threading.Thread(target=self._run, name="openai-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            engine = self._load()
            self.api = Api(engine, self.model_name)
            self.loaded_seconds = time.monotonic() - self.started
        except BaseException as e:  # noqa: BLE001 - reported by /health and the log
            self.error = f"{type(e).__name__}: {e}"
            if self._on_failure is not None:
                self._on_failure(e)

    def serving(self) -> Api:
        """The Api, or the 503 that says why there is none now (draining, failed, loading)."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", type_="service_unavailable", code="draining")
        if self.api is None:
            if self.error:
                raise ApiError(503, f"the engine failed to load: {self.error}", type_="service_unavailable",
                               code="engine_failed")
            raise ApiError(503, f"the engine is loading ({time.monotonic() - self.started:.0f}s so far)",
                           type_="service_unavailable", code="engine_loading", retry_after=LOADING_RETRY_SECONDS)
        return self.api

    async def close(self) -> None:
        self._thread.join(timeout=600)
        if self.api is not None:
            self.api.close()
            await self.api.engine.close()
