"""The suite's hang guard (tests/hang_guard.py): a test that hangs fails with every thread's stack dumped,
and the tests after it run, instead of the whole run hanging until CI kills it with nothing said."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_hanging_test_fails_by_name_with_stacks_and_the_next_test_runs(tmp_path):
    (tmp_path / "test_hangs.py").write_text(
        "import sys, threading\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "from hang_guard import fail_after\n"
        "hang_guard = fail_after(1)\n"
        "def test_waits_for_what_never_comes():\n"
        "    threading.Event().wait()\n"
        "def test_a_library_timeout_does_not_disarm_it():\n"  # math_verify's parse ends with alarm(0)
        "    import signal\n"
        "    signal.alarm(0)\n"
        "    threading.Event().wait()\n"
        "def test_an_except_exception_does_not_swallow_it():\n"
        "    try:\n"
        "        threading.Event().wait()\n"
        "    except Exception:\n"
        "        pass\n"
        "def test_after_them():\n"
        "    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "3 failed, 1 passed" in out and "HangGuardExpired: test exceeded 1s" in out, out
    assert "test_waits_for_what_never_comes" in out and "threading.py" in out, out  # the stacks were dumped


def test_a_module_fixture_that_hangs_fails_its_test_and_the_next_module_runs(tmp_path):
    """A server that never starts hangs in a module fixture's setup, before the function-scoped guard is
    armed: the protocol guard fails the test that asked for it."""
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "from hang_guard import protocol_guard\n"
        "pytest_runtest_protocol = protocol_guard(1)\n")
    (tmp_path / "test_a_server.py").write_text(
        "import threading, pytest\n"
        "@pytest.fixture(scope='module')\n"
        "def server():\n"
        "    threading.Event().wait()\n"
        "def test_uses_the_server(server):\n"
        "    pass\n")
    (tmp_path / "test_b_after.py").write_text("def test_after_it():\n    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 passed, 1 error" in out and "test_uses_the_server with its fixtures exceeded 1s" in out, out
