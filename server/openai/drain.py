"""SIGTERM's drain under uvicorn: the listener stays open, `/health` and new requests get 503
`draining`, running requests get `drain_seconds` to finish; at the deadline this server cancels
their engine requests itself, so each one still ends properly (a stream with its finish chunk,
`finish_reason` "abort", and `[DONE]`; a whole response as a 200), and only then does uvicorn shut down.

Its own module because uvicorn's own shutdown does none of that: on a signal it closes the listener at
once (a load balancer polling `/health` saw the port vanish, not 503 `draining`), and at its graceful
timeout it cancels the request tasks, which cut streams with no final chunk and no `[DONE]` and logged
a CancelledError traceback for the documented normal path.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Optional

import uvicorn

# after the deadline's cancel, how long the cut requests get to send their last events before uvicorn
# shuts down anyway (a client that never reads its stream must not hold the process)
CUT_GRACE_SECONDS = 10.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server with this project's drain (see the module doc). `state` is the app's State
    (`app.state.serving`); `drain()` is what the first SIGTERM or Ctrl-C does; a second one cuts it
    short, a third exits at once."""

    def __init__(self, config: uvicorn.Config, state: Any, drain_seconds: float,
                 log: Callable[[str], None]):
        super().__init__(config)
        self.state, self.drain_seconds, self.log = state, drain_seconds, log
        self.deadline: Optional[float] = None
        self.cut = False
        self.signals = 0  # counted, not read off the drain's state (a quick third was taken for a second)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """Drain on the first signal; on the second, cut the drain short (the running requests are
        cancelled now, so they still end properly and the engine still closes); a third exits at once,
        as it is. The signal is not re-raised after the shutdown (uvicorn's own handler does, which would
        end the process by it instead of status 0)."""
        self.signals += 1
        if self.signals >= 3:
            # "at once": uvicorn's own force_exit is not looked at once its shutdown waits on the engine's
            # close (a thread join of up to minutes, in the lifespan shutdown)
            self.log(f"signal {sig} a third time: exiting now, as things are")
            os._exit(1)
        if self.signals == 2:
            self.log(f"signal {sig} again: cancelling the running requests now")
            now = time.monotonic()
            self.deadline = now if self.deadline is None else min(self.deadline, now)
            return
        self.log(f"signal {sig}: draining (running requests get {self.drain_seconds:g}s), then exit")
        self.drain()

    def drain(self) -> None:
        """Start the drain: from now on `/health` and new requests get 503 `draining`."""
        self.state.draining = True
        self.deadline = time.monotonic() + self.drain_seconds

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s on uvicorn's loop: end the drain once no request is left, cancel at the deadline."""
        if self.deadline is not None and not self.should_exit:
            now, api = time.monotonic(), self.state.api
            if self.state.active == 0:
                self.should_exit = True
            elif now >= self.deadline + CUT_GRACE_SECONDS:
                self.log(f"{self.state.active} request(s) still open {CUT_GRACE_SECONDS:g}s after the drain's "
                         "cancel; shutting down anyway")
                self.should_exit = True
            elif now >= self.deadline:
                if not self.cut:
                    self.log(f"drain deadline ({self.drain_seconds:g}s): cancelling "
                             f"{api.running if api else 0} running engine request(s)")
                    self.cut = True
                if api is not None:  # again every tick: a request parsed meanwhile is cut as it starts
                    api.cancel_running()
        return await super().on_tick(counter)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything says "listening" (uvicorn binds only after its
    startup, and a taken port then failed after that line). OSError when it cannot be had."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock
