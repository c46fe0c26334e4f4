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
        "from hang_guard import phase_guards\n"
        "pytest_runtest_setup, pytest_runtest_call, pytest_runtest_teardown = phase_guards(1)\n")
    (tmp_path / "test_a_server.py").write_text(
        "import threading, pytest\n"
        "@pytest.fixture(scope='module')\n"
        "def server():\n"
        "    threading.Event().wait()\n"
        "def test_uses_the_server(server):\n"
        "    pass\n"
        "def test_uses_it_too(server):\n"  # the module fixture's failure is cached: its own error, not pytest's
        "    pass\n"
        "@pytest.fixture(scope='module')\n"
        "def stuck_at_teardown():\n"
        "    yield\n"
        "    threading.Event().wait()\n"
        "@pytest.fixture(scope='module')\n"
        "def cleaned_up():\n"
        "    yield\n"
        "    open('cleaned', 'w').close()\n"
        "def test_whose_fixtures_end_badly(cleaned_up, stuck_at_teardown):\n"
        "    pass\n")
    (tmp_path / "test_b_after.py").write_text("def test_after_it():\n    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "2 passed, 3 errors" in out, out
    assert "test_uses_the_server (setup) exceeded 1s" in out and "INTERNALERROR" not in out, out
    assert out.count("(setup) exceeded 1s") >= 2 and "test_whose_fixtures_end_badly (teardown) exceeded 1s" in out
    assert (tmp_path / "cleaned").exists()  # the other finalizer still ran
