"""The `openai` backend's HTTP connection pools: one httpx2 client per event loop.

A request runs in its caller's loop (no thread hop per token), and an httpx2 client belongs to
the loop it was made in, so each loop gets its own pool on first use and it goes with its loop.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any


class LoopClients:
    """The pools of every loop that sent requests, and how to close them."""

    def __init__(self, max_connections: int):
        self._max_connections = max_connections
        self._ssl: Any = None
        self._clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]" = weakref.WeakKeyDictionary()

    def new(self) -> Any:
        """A fresh client (the caller closes it)."""
        import httpx2 as httpx

        if self._ssl is None:  # built once: loading the trust store costs ~35 ms, too much for every loop
            import ssl

            self._ssl = ssl.create_default_context()
        return httpx.AsyncClient(timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None),
                                 verify=self._ssl,
                                 limits=httpx.Limits(max_connections=self._max_connections,
                                                     max_keepalive_connections=256))

    def current(self) -> Any:
        """The running loop's pool (made on first use; it goes with its loop)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = self.new()
        return client

    def pop(self, loop: asyncio.AbstractEventLoop) -> Any:
        """The pool of `loop`, no longer kept here (None if it has none); the caller closes it."""
        return self._clients.pop(loop, None)

    def close_all_soon(self) -> None:
        """Forget every pool; one whose loop still runs is closed there."""
        for loop, client in list(self._clients.items()):
            if loop.is_running():
                try:
                    loop.call_soon_threadsafe(lambda c=client, lp=loop: lp.create_task(c.aclose()))
                except RuntimeError:
                    pass
        self._clients.clear()
