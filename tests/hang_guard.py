"""A test that runs past its time fails, with every thread's stack dumped, instead of hanging CI.

conftest.py gives every test of the suite one (`hang_guard`, 600 s). A module that starts servers narrows it
with its own fixture of that name: `hang_guard = fail_after(120)` (importing the name from a helper does too).
A second, wider one (`protocol_guard`, conftest's pytest_runtest_protocol) covers what the fixture cannot:
the module- and session-scoped fixtures set up before it and torn down after it.

The clock is a watchdog thread, not SIGALRM: libraries take SIGALRM for their own timeouts and end with
`alarm(0)`, which cancelled the guard unseen (math_verify's parse timeout, under every LaTeX answer read on
the main thread). On expiry the watchdog dumps the stacks and sends the main thread SIGUSR1, whose handler
raises HangGuardExpired in the test (nothing in the product takes SIGUSR1), again every RESEND_SECONDS
until the test ends: a BaseException, so product code that catches Exception (or TimeoutError) around
what hung cannot swallow it and carry on.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator

import pytest

EXPIRED = signal.SIGUSR1
RESEND_SECONDS = 30


class HangGuardExpired(BaseException):
    """The test ran past its hang guard (pytest reports it as the test's failure)."""


@contextlib.contextmanager
def deadline(seconds: int, what: str) -> Iterator[None]:
    """Past `seconds` inside the block, the stacks are dumped and HangGuardExpired("<what> exceeded ...") is
    raised in the main thread, again every RESEND_SECONDS until the block ends. Nested deadlines restore
    each other's handler on the way out."""
    import faulthandler

    def expire(signum, frame):
        raise HangGuardExpired(f"{what} exceeded {seconds}s")

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


def fail_after(seconds: int) -> Callable[..., Any]:
    """An autouse fixture: after `seconds` the stacks are dumped and HangGuardExpired is raised in the test."""

    @pytest.fixture(autouse=True)
    def hang_guard():
        with deadline(seconds, "test"):
            yield
    return hang_guard


def protocol_guard(seconds: int) -> Callable[..., Any]:
    """A `pytest_runtest_protocol` hook wrapper: a deadline around each test's setup, call and teardown,
    module- and session-scoped fixtures included (they start servers and build models before the
    function-scoped `hang_guard` is armed, and are torn down after it is gone)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
        with deadline(seconds, f"{item.nodeid} with its fixtures"):
            yield
    return pytest_runtest_protocol
