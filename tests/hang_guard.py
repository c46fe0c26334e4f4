"""A test that runs past its time fails, with every thread's stack dumped, instead of hanging CI.

conftest.py gives every test of the suite one (`hang_guard`, 600 s). A module that starts servers narrows it
with its own fixture of that name: `hang_guard = fail_after(120)` (importing the name from a helper does too).
A second, wider one (`phase_guards`, conftest's setup/call/teardown hook wrappers) covers what the fixture
cannot: the module- and session-scoped fixtures set up before it and torn down after it.

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
from _pytest.outcomes import Failed

EXPIRED = signal.SIGUSR1
RESEND_SECONDS = 30


class HangGuardExpired(Failed):
    """The test (or a phase of it) ran past its hang guard. pytest's own failure outcome: a BaseException, so
    product code that catches Exception cannot swallow it, and one pytest handles where a fixture's setup or
    teardown raises it (the failure is cached for the module's later tests, the other finalizers still run),
    where any other BaseException would leave later tests a pytest internal error."""


_expired: list[str] = []  # the messages of the deadlines that ran out and have not ended, newest last


def _expire(signum: int, frame: Any) -> None:
    raise HangGuardExpired(_expired[-1] if _expired else "hang guard expired")


@contextlib.contextmanager
def deadline(seconds: int, what: str) -> Iterator[None]:
    """Past `seconds` inside the block, the stacks are dumped and HangGuardExpired("<what> exceeded ...") is
    raised in the main thread, again every RESEND_SECONDS until the block ends. Deadlines nest: one
    handler serves them all and raises with the message of the one that ran out."""
    import faulthandler

    message = f"{what} exceeded {seconds}s"

    def watchdog() -> None:
        if done.wait(seconds):
            return
        faulthandler.dump_traceback(all_threads=True)
        _expired.append(message)
        while True:
            signal.pthread_kill(threading.main_thread().ident, EXPIRED)
            if done.wait(RESEND_SECONDS):
                return
    if signal.getsignal(EXPIRED) is not _expire:  # the suite's for its whole run (nothing else takes SIGUSR1)
        signal.signal(EXPIRED, _expire)
    done = threading.Event()
    dog = threading.Thread(target=watchdog, name=f"hang-guard-{seconds}s", daemon=True)
    dog.start()
    try:
        yield
    finally:
        done.set()
        dog.join()
        if message in _expired:
            _expired.remove(message)


def fail_after(seconds: int) -> Callable[..., Any]:
    """An autouse fixture: after `seconds` the stacks are dumped and HangGuardExpired is raised in the test."""

    @pytest.fixture(autouse=True)
    def hang_guard():
        with deadline(seconds, "test"):
            yield
    return hang_guard


def phase_guards(seconds: int) -> tuple[Callable[..., Any], ...]:
    """`pytest_runtest_setup`, `_call` and `_teardown` hook wrappers: a deadline around each phase of each
    test, module- and session-scoped fixtures included (they start servers and build models before the
    function-scoped `hang_guard` is armed, and are torn down after it is gone). A phase at a time, so
    that nothing is armed while pytest itself reports between phases."""

    def guard(phase: str) -> Callable[..., Any]:
        @pytest.hookimpl(hookwrapper=True)
        def wrapper(item: Any, *args: Any) -> Iterator[None]:
            with deadline(seconds, f"{item.nodeid} ({phase})"):
                yield
        wrapper.__name__ = f"pytest_runtest_{phase}"
        return wrapper
    return guard("setup"), guard("call"), guard("teardown")
