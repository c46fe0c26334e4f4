"""The attacks of issue 18, groups 5-9 and the smaller items: what passes from one cell to the next,
the memory and thread/process limits, session crashes and restores, exit codes, uid slots and the
degraded modes. Groups 1-4 are in test_sandbox_attacks.py; shared helpers in sandbox_attack_kit.py.

Every test is bounded in time, checks the host afterwards and leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from sandbox_attack_kit import FAST, ROOT, SPINNER, bounded, healthy, idle_worker, pool, session_uid  # noqa: F401

from sandbox import SandboxConfig, SandboxPool, isolation
from sandbox.config import Limits
from sandbox.result import escape_controls
from sandbox.slots import Slots

# ---- 5. every pool cell starts from a clean state

def interpreter_bind_points(folder: str, python: str = "") -> list[str]:
    """Names in the private folder `folder` that are the interpreter's own read-only binds, not files.

    A checkout (and so its venv) under /tmp is bound read-only at its own path inside the cell's
    fresh /tmp (see isolation.rebinds), so `os.listdir('/tmp')` shows its first path component.
    """
    prefix = folder.rstrip("/") + "/"
    return sorted({dst[len(prefix):].split("/")[0] for _, dst in isolation.rebinds(python) if dst.startswith(prefix)})


def test_pool_cells_do_not_see_each_others_files(pool):
    places = ["/tmp", "/dev/shm", "/var/tmp", "/run/lock", "."]
    workdir = "/tmp/cell"  # the cell's working directory, a new one per cell
    expected = [sorted(["cell"] + interpreter_bind_points("/tmp", pool.config.python))]
    expected += [interpreter_bind_points(workdir if d == "." else d, pool.config.python) for d in places[1:]]
    r = pool.run(textwrap.dedent(f"""
        import os
        for d in {places!r}:
            open(os.path.join(d, 'leftover'), 'w').write('secret')
        try:
            with open('/tmp/fill', 'wb') as f:
                while True:
                    f.write(b'0' * (1 << 20))
        except OSError as e:
            print(e.strerror)
    """))
    assert "No space left" in r.stdout.text or "File too large" in r.stdout.text, r.feedback()
    r = pool.run(textwrap.dedent(f"""
        import os
        print([sorted(os.listdir(d)) for d in {places!r}])
        open('/tmp/mine', 'wb').write(b'1' * (8 << 20))
        print('wrote')
    """))
    assert r.stdout.text == f"{expected}\nwrote\n", r.feedback()  # /tmp/cell is the new cwd


def test_metadata_left_on_the_working_directory_does_not_pass(pool):
    """An empty folder is reused only if nothing about it changed: times, mode and xattrs carry data too."""
    r = pool.run("import os\nos.utime('.', (12345, 67890))\nos.chmod('.', 0o755)\n"
                 "try:\n    os.setxattr('.', 'user.msg', b'secret')\nexcept OSError:\n    pass")
    assert r.status == "ok", r.feedback()
    r = pool.run("import os\nst = os.stat('.')\nprint(int(st.st_mtime), oct(st.st_mode & 0o777), os.listxattr('.'))")
    mtime, mode, xattrs = r.stdout.text.split(maxsplit=2)
    assert mtime != "67890" and mode == "0o700" and xattrs.strip() == "[]", r.stdout.text


def test_no_posix_message_queues(pool):
    r = pool.run("import ctypes\nrt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
                 "q = rt.mq_open(b'/sandbox-q', 0o100 | 0o2, 0o666, None)\nprint(q, ctypes.get_errno())")
    q, errno = r.stdout.text.split()
    assert q == "-1" and errno != "0", r.feedback()


# ---- 6. a cell cannot sabotage the next one; a broken worker is caught before it gets a cell

@pytest.mark.parametrize("sabotage", [
    "import os\nos.rename('/tmp/cell', '/tmp/moved')\nos.mkfifo('/tmp/cell')",
    "import os\nos.rename('/tmp/cell', '/tmp/moved')\nopen('/tmp/cell', 'w').write('x')",
    "import os\nos.chdir('/')\nos.chmod('/tmp/cell', 0)\nos.symlink('/proc/self', '/tmp/cell/x')",
])
def test_cell_cannot_break_the_next_cell(pool, sabotage):
    assert pool.run(sabotage).status in ("ok", "error")
    t = time.monotonic()
    healthy(pool)
    assert time.monotonic() - t < 2


def test_worker_killed_between_cells_is_replaced_before_use(pool):
    w = idle_worker(pool)
    os.kill(w.init_pid, signal.SIGKILL)
    while w.alive():
        time.sleep(0.01)
    restarts = pool.restarts
    healthy(pool)
    assert pool.restarts == restarts + 1


# ---- 7. the memory limit binds the cell as a whole

def test_memory_limit_covers_all_processes_of_a_cell(pool):
    w = idle_worker(pool)
    if w.cgroup is None:
        pytest.skip("no writable memory cgroup on this machine")
    code = textwrap.dedent("""
        import os, time
        r, w = os.pipe()
        kids = []
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                block = bytearray(b'\\x01') * (150 << 20)   # each child alone is within the limit
                os.write(w, b'k')
                time.sleep(3)
                os._exit(0)
            kids.append(pid)
        os.close(w)
        got = b''
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and len(got) < 3:
            chunk = os.read(r, 3)
            if not chunk:
                break
            got += chunk
        print('children holding their memory at once:', len(got))
    """)
    r = pool.run(code, timeout=8)
    assert "at once: 3" not in r.stdout.text, r
    assert w.cgroup.peak() <= w.cgroup.limit_bytes + (1 << 20)
    assert "memory limit" in r.feedback() or r.status == "killed", r.feedback()
    healthy(pool)


# ---- 8. a session crash returns within its timeout; the restore is in the background

def test_session_crash_returns_within_its_timeout(pool):
    with pool.session() as s:
        for k in range(4):
            assert s.run(f"import time\ntime.sleep(0.4)\nx{k} = {k}", timeout=2).ok
        r = s.run("import os\nos._exit(1)", timeout=2)
        assert r.restarted and r.total_seconds < 2, r  # the 1.6 s replay is not charged to the crash
        r = s.run("print(x0 + x1 + x2 + x3)", timeout=5)  # waits for the restore, within its own limit
        assert r.stdout.text == "6\n" and 0 < r.queue_seconds and r.total_seconds < 5, r
        r = s.run(SPINNER, timeout=1)  # ignores the timer: killed shortly after its limit
        assert r.status == "timeout" and r.restarted and r.total_seconds < 2, r
        r = s.run("print(x3)", timeout=1)  # a restore longer than the limit: told so, within the limit
        assert r.status == "timeout" and "still being restored" in r.feedback() and r.total_seconds < 1.5, r
        r = s.run("print(x3)", timeout=5)
        assert r.stdout.text == "3\n", r


def test_a_session_closed_from_another_thread_as_its_cell_crashes_closes_cleanly(pool, monkeypatch):
    """A sample cancelled (its session closed from the solver's thread) at the moment its cell crashed:
    the close lands between the restore thread's creation and its start, and still ends cleanly."""
    import threading

    closed, closers = [], []
    real_thread = threading.Thread

    class CloseFirst(real_thread):
        def start(self) -> None:  # the window: the restore thread exists, a close comes from elsewhere
            if self.name.endswith("-restore"):
                closer = real_thread(target=lambda: closed.append(s.close() or True))
                closers.append(closer)
                closer.start()
                closer.join(1.0)  # it ends, or waits for this cell's thread to let go of the worker
            super().start()

    monkeypatch.setattr(threading, "Thread", CloseFirst)
    with pool.session() as s:
        assert s.run("x = 1", timeout=2).ok
        r = s.run("import os\nos._exit(1)", timeout=2)
        assert r.status != "ok", r
    for closer in closers:
        closer.join()
    assert len(closers) == 1 and closed == [True]
    healthy(pool)


def test_a_session_closed_while_its_cell_runs_kills_the_cell_and_frees_the_worker_after_it(pool):
    """A sample cancelled mid-cell (early stopping): close, from another thread, kills the cell at once
    and frees the worker only after the cell's thread has seen it die; the cell reports, no restore starts."""
    import threading

    s = pool.session()
    assert s.run("x = 1", timeout=2).ok
    out = []
    runner = threading.Thread(target=lambda: out.append(s.run("import time\ntime.sleep(600)", timeout=900)))
    runner.start()
    while not s._run_lock.locked():  # the cell's thread has it: the cell runs (or is about to)
        time.sleep(0.01)
    s.close()
    runner.join(120)  # long before the cell's own 600 s
    assert not runner.is_alive() and out and out[0].status != "ok" and not out[0].restarted, out
    assert s._restore is None
    healthy(pool)


def test_session_restore_is_bounded_by_the_replay_budget():
    p = SandboxPool(SandboxConfig(pool_size=1, limits=Limits(wall_seconds=1.5), **FAST))
    try:
        with p.session() as s:
            # two cells that fit the 1.5 s budget with room on any machine, and one that cannot (it ran 2 s
            # under its own 5 s limit; replayed, it gets what is left of 1.5 s)
            assert s.run("x0 = 0").ok and s.run("x1 = 1").ok
            assert s.run("import time\ntime.sleep(2)\nx2 = 2", timeout=5).ok
            assert s.run("import os\nos._exit(3)").restarted
            r = s.run("print('x2' in globals(), 'x1' in globals())", timeout=5)
            assert r.stdout.text == "False True\n", r
            assert "only 2 of 3" in r.feedback(), r.feedback()
    finally:
        p.close()


# ---- 9. a cell that runs into the thread and process limit is told so

TASKS = 8  # a small limit: reached long before the address space runs out (8 MiB of stack per thread)

BOMBS = {
    # threads until starting one fails ("can't start new thread")
    "threads": ("import threading, time\nwhile True:\n"
                "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()", 5),
    # every process forks until forking fails (BlockingIOError)
    "processes": ("import os\nwhile True:\n    os.fork()", 5),
    # a fork loop that swallows the failures and so runs into its time limit
    "processes-until-timeout": ("import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n"
                                "            time.sleep(60)\n            os._exit(0)\n"
                                "    except OSError:\n        pass", 1),
}


@pytest.fixture(scope="module")
def small_pool():
    p = SandboxPool(SandboxConfig(pool_size=1, limits=Limits(wall_seconds=5, max_processes=TASKS), **FAST))
    w = idle_worker(p)
    if w.cgroup is None or w.cgroup.pids_path is None:
        p.close()
        from sandbox import cgroup

        why = f"memory: {cgroup.available()[2]}; pids: {cgroup.pids_available()[2]}; worker group: {w.cgroup}"
        pytest.skip(f"no writable pids cgroup for this worker ({why}): the limit binds (RLIMIT_NPROC) "
                    "but counts nothing")
    yield p
    p.close()


@pytest.mark.parametrize("bomb", list(BOMBS))
def test_thread_and_process_bombs_are_told_the_limit(small_pool, bomb):
    code, timeout = BOMBS[bomb]
    said = f"too many threads or processes: the limit is {TASKS}"
    r = small_pool.run(code, timeout=timeout)
    assert r.status in ("error", "timeout", "killed") and said in r.feedback(), r
    r = small_pool.run("print(6 * 7)")
    assert r.status == "ok" and r.stdout.text == "42\n" and said not in r.feedback(), r  # counted once, for its cell
    with small_pool.session() as s:
        assert s.run("x = 7").ok
        r = s.run(code, timeout=timeout)
        assert r.status in ("error", "timeout", "killed") and said in r.feedback(), r
        r = s.run("print(x)", timeout=10)
        assert r.status == "ok" and r.stdout.text == "7\n" and said not in r.feedback(), r


def test_the_thread_and_process_limit_counts_the_cell_itself(small_pool):
    """`max_processes` threads and processes for a cell, its own main thread included, in pool cells and sessions."""
    code = ("import threading, time\nn = 0\ntry:\n    while n < 100:\n"
            "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n        n += 1\n"
            "except RuntimeError:\n    pass\nprint(n)")
    r = small_pool.run(code)
    assert r.stdout.text == f"{TASKS - 1}\n" and "limit is" in r.feedback(), r
    with small_pool.session() as s:
        r = s.run(code)
        assert r.stdout.text == f"{TASKS - 1}\n" and "limit is" in r.feedback(), r


# ---- the smaller items

@pytest.mark.parametrize("code, code_out", [
    ("raise SystemExit(256)", 1), ("import sys\nsys.exit(2**70)", 1), ("import sys\nsys.exit(-1)", 255),
    ("import sys\nsys.exit(True)", 1),
])
def test_nonzero_exit_is_never_success(pool, code, code_out):
    r = pool.run(code)
    assert r.status == "error" and r.exit_code == code_out, r
    with pool.session() as s:
        r = s.run(code)
        assert r.status == "error" and r.exit_code == code_out and not r.restarted, r


def test_session_signals_and_exit_messages(pool):
    with pool.session() as s:
        assert s.run("x = 1").ok
        r = s.run("import sys\nsys.exit('bye')")
        assert r.status == "error" and "bye" in r.feedback() and not r.restarted, r
        r = s.run("import signal\nsignal.raise_signal(signal.SIGKILL)")
        assert r.status == "killed" and r.signal == "SIGKILL" and r.restarted, r
        r = s.run("import os\nos._exit(9)")
        assert r.status == "error" and r.exit_code == 9 and r.restarted, r
        assert "resource limit" not in r.feedback() and "memory" not in r.feedback()
        assert "exited with code 9" in r.feedback(), r.feedback()
        assert s.run("print(x)").stdout.text == "1\n"


def test_control_characters_are_escaped_in_feedback(pool):
    r = pool.run("print('a\\x1b[31mred\\x00\\x07\\r\\nb\\tc\\rd\\x9b')")
    fb = r.feedback()
    assert fb == "a\\x1b[31mred\\x00\\x07\nb\tc\\x0dd\\x9b", repr(fb)
    assert "\x1b" in r.stdout.text  # the raw stream keeps what the cell wrote
    assert escape_controls("ok\n\tfine") == "ok\n\tfine"


def test_slots_are_unique_and_reused():
    slots = Slots(5)
    taken = [slots.take() for _ in range(5)]
    assert sorted(taken) == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="in use"):
        slots.take()
    slots.give(2)
    assert slots.take() == 2


def test_slots_are_unique_across_harness_processes(tmp_path):
    mine = Slots(4, str(tmp_path))
    assert [mine.take(), mine.take()] == [0, 1]
    other = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                            f"from sandbox.slots import Slots\ns = Slots(4, {str(tmp_path)!r})\n"
                            "print(s.take(), s.take())"],
                           capture_output=True, text=True, timeout=30)
    assert other.stdout.split() == ["2", "3"], other.stderr  # another harness skips the uids this one holds
    mine.give(0)
    assert mine.take() == 0


def test_sessions_never_share_a_uid_with_pool_workers(pool):
    pool_slots = set(pool._slots)
    sessions = [pool.session() for _ in range(3)]
    try:
        uids = {session_uid(s) for s in sessions}
        assert len(uids) == 3 and not uids & {isolation.slot_uid(k, pool.mechanism) for k in pool_slots}
    finally:
        for s in sessions:
            s.close()


def test_failed_replacement_never_queues_a_dead_worker(monkeypatch):
    import sandbox.pool as pool_mod

    def no_worker(*a, **k):
        raise OSError("no more workers")

    p = SandboxPool(SandboxConfig(pool_size=1, **FAST))
    try:
        real = pool_mod.Worker
        monkeypatch.setattr(pool_mod, "Worker", no_worker)
        w = idle_worker(p)
        os.kill(w.init_pid, signal.SIGKILL)
        while w.alive():
            time.sleep(0.01)
        r = p.run("print(1)")
        assert r.status == "killed" and "could be started" in r.feedback(), r
        assert list(p._idle.queue) == [p._slots[0]]  # a vacant slot, never the dead worker
        r = p.run("import os\nos._exit(1)")  # still answers (and still cannot start one)
        assert r.status == "killed" and list(p._idle.queue) == [p._slots[0]]
        monkeypatch.setattr(pool_mod, "Worker", real)
        r = p.run("print(2)")
        assert r.status == "ok" and r.stdout.text == "2\n", r
    finally:
        p.close()


def test_without_a_memory_cgroup_the_pool_warns_and_still_limits(monkeypatch):
    from sandbox import cgroup
    from sandbox.memory_limit import MemoryLimitWarning

    monkeypatch.setattr(cgroup, "available", lambda: (None, "", "test double: no cgroup"))
    with pytest.warns(MemoryLimitWarning, match="per process only"):
        p = SandboxPool(SandboxConfig(pool_size=1, limits=Limits(memory_mb=256), **FAST))
    try:
        assert idle_worker(p).cgroup is None
        r = p.run("x = bytearray(2 * 1024**3)")
        assert r.status == "error" and "MemoryError" in r.feedback(), r
        healthy(p)
    finally:
        p.close()


def test_unisolated_sessions_still_restore_and_bound_time():
    """The degraded mode keeps the protocol checks, the restore and the time bound."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = SandboxPool(SandboxConfig(pool_size=1, isolation="none", **FAST))
    try:
        with p.session() as s:
            assert s.run("x = 3").ok
            r = s.run(SPINNER.replace("os.setsid()", "pass"), timeout=1)
            assert r.status == "timeout" and r.restarted and r.total_seconds < 2.5, r
            assert s.run("print(x)", timeout=5).stdout.text == "3\n"
    finally:
        p.close()
