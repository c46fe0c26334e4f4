"""A test that runs past its time fails, with every thread's stack dumped, instead of hanging CI.

conftest.py gives every test of the suite one (`hang_guard`, 600 s). A module that starts servers narrows it
with its own fixture of that name: `hang_guard = fail_after(120)` (importing the name from a helper does too).
"""

from __future__ import annotations

import signal
from typing import Any, Callable

import pytest


def fail_after(seconds: int) -> Callable[..., Any]:
    """An autouse fixture: SIGALRM after `seconds` dumps the stacks and raises TimeoutError in the test."""

    @pytest.fixture(autouse=True)
    def hang_guard():
        import faulthandler

        def expire(signum, frame):
            faulthandler.dump_traceback(all_threads=True)
            raise TimeoutError(f"test exceeded {seconds}s")
        old = signal.signal(signal.SIGALRM, expire)
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    return hang_guard
