"""A test that runs past its time fails, with every thread's stack dumped, instead of hanging CI.

conftest.py gives every test of the suite one (`hang_guard`, 600 s). A module that starts servers narrows it
with its own fixture of that name: `hang_guard = fail_after(120)` (importing the name from a helper does too).

The clock is a watchdog thread, not SIGALRM: libraries take SIGALRM for their own timeouts and end with
`alarm(0)`, which cancelled the guard unseen (math_verify's parse timeout, under every LaTeX answer read on
the main thread). On expiry the watchdog dumps the stacks and sends the main thread SIGUSR1, whose handler
raises HangGuardExpired in the test (nothing in the product takes SIGUSR1), again every RESEND_SECONDS
until the test ends: a BaseException, so product code that catches Exception (or TimeoutError) around
what hung cannot swallow it and carry on.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

import pytest

EXPIRED = signal.SIGUSR1
RESEND_SECONDS = 30


class HangGuardExpired(BaseException):
    """The test ran past its hang guard (pytest reports it as the test's failure)."""


def fail_after(seconds: int) -> Callable[..., Any]:
    """An autouse fixture: after `seconds` the stacks are dumped and HangGuardExpired is raised in the test."""

    @pytest.fixture(autouse=True)
    def hang_guard():
        import faulthandler

        def expire(signum, frame):
            raise HangGuardExpired(f"test exceeded {seconds}s")

        def watchdog() -> None:
            if done.wait(seconds):
                return
            faulthandler.dump_traceback(all_threads=True)
            while True:
                signal.pthread_kill(threading.main_thread().ident, EXPIRED)
                if done.wait(RESEND_SECONDS):
                    return
        old = signal.signal(EXPIRED, expire)
        done = threading.Event()
        dog = threading.Thread(target=watchdog, name=f"hang-guard-{seconds}s", daemon=True)
        dog.start()
        try:
            yield
        finally:
            done.set()
            dog.join()
            signal.signal(EXPIRED, old)
    return hang_guard
