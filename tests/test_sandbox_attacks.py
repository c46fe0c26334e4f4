"""The attacks of issue 18, one group per class, each reproduced and shown to fail.

Every test is bounded in time, checks the host afterwards (`ps`, `/proc`, `ipcs`, sockets that
must receive nothing) and leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from sandbox import SandboxConfig, SandboxPool, isolation
from sandbox.config import Limits
from sandbox.slots import Slots
from sandbox.result import escape_controls
from sandbox.worker import WorkerDied

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(preimports=("import math",))


TEST_BOUND_SECONDS = 30


@pytest.fixture(autouse=True)
def bounded():
    """No attack test may run longer than TEST_BOUND_SECONDS (no pytest-timeout here: SIGALRM)."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"attack test ran past {TEST_BOUND_SECONDS} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TEST_BOUND_SECONDS)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def pool():
    """One worker, so consecutive cells are known to share it (the worst case for leftovers)."""
    p = SandboxPool(SandboxConfig(pool_size=1, limits=Limits(wall_seconds=5, memory_mb=256), **FAST))
    yield p
    p.close()


def healthy(p: SandboxPool) -> None:
    r = p.run("print(6 * 7)")
    assert r.status == "ok" and r.stdout.text == "42\n", r


def idle_worker(p: SandboxPool):
    """The pool's idle worker, once there is one (a replacement may still be starting)."""
    w = p._idle.get(timeout=30)
    p._idle.put(w)
    assert not isinstance(w, int), "vacant slot"
    return w


def ps() -> list[tuple[int, int, str]]:
    """(pid, uid, command line) of every process on the host, from `ps`."""
    out = subprocess.run(["ps", "-eo", "pid=,uid=,args="], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        pid, uid, *args = line.split(None, 2)
        rows.append((int(pid), int(uid), args[0] if args else ""))
    return rows


def survivors(uid: int | None = None, marker: str | None = None) -> list[tuple[int, int, str]]:
    """Host processes running as `uid` or whose command line holds `marker`."""
    me = os.getpid()
    return [r for r in ps() if r[0] != me and "ps -eo" not in r[2]
            and ((uid is not None and r[1] == uid) or (marker is not None and marker in r[2]))]


def wait_gone(uid: int | None = None, marker: str | None = None, seconds: float = 3.0) -> list:
    deadline = time.monotonic() + seconds
    while (left := survivors(uid, marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def session_uid(s) -> int:
    uid = isolation.slot_uid(s.slot, s.mechanism)
    assert uid is not None, "these tests run as root with namespaces, like CI"
    return uid


SPINNER = "import os, signal, sys, time\ntry:\n    os.setsid()\nexcept OSError:\n    pass\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass"


def detached_spinner(marker: str) -> str:
    """Cell code starting a setsid() child that ignores SIGALRM, SIGTERM and SIGHUP, and spins."""
    child = ("import os, signal\nos.setsid()\nfor s in (signal.SIGALRM, signal.SIGTERM, signal.SIGHUP):\n"
             "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass")
    return f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}, {marker!r}], start_new_session=True)\n"


# ---- 1. nothing a cell starts outlives its cell, its session or its pool

def test_session_setsid_ignoring_the_timer_dies_at_the_timeout(pool):
    marker = f"sandbox-spin-{uuid.uuid4().hex}"
    with pool.session() as s:
        uid = session_uid(s)
        assert s.run("x = 5").ok
        r = s.run(detached_spinner(marker) + SPINNER, timeout=1)
        assert r.status == "timeout" and r.restarted and r.total_seconds < 2.5, r
        assert wait_gone(marker=marker) == []
        assert [p for p in survivors(uid) if "spin" in p[2] or p[2].count("-c") > 1] == []
        r = s.run("print(x)")  # restored in the background, state back
        assert r.stdout.text == "5\n", r
    assert wait_gone(uid=uid) == [] and wait_gone(marker=marker) == []


def test_session_close_kills_threads_setsid_and_detached_children(pool):
    marker = f"sandbox-thread-{uuid.uuid4().hex}"
    s = pool.session()
    uid = session_uid(s)
    code = (detached_spinner(marker) + "import os, threading\n"
            "threading.Thread(target=lambda: [None for _ in iter(int, 1)]).start()\nprint('started')")
    r = s.run(code, timeout=3)
    assert r.stdout.text == "started\n", r
    assert wait_gone(marker=marker) == []  # detached children die at the end of their cell
    assert survivors(uid)  # the session's interpreter (with its spinning thread) is alive meanwhile
    t = time.monotonic()
    s.close()
    assert time.monotonic() - t < 5
    assert survivors(uid) == [] and survivors(marker=marker) == []  # gone by the time close() returns


def test_pool_close_ends_every_session_and_worker():
    p = SandboxPool(SandboxConfig(pool_size=1, **FAST))
    marker = f"sandbox-poolclose-{uuid.uuid4().hex}"
    s = p.session()
    uid = session_uid(s)
    assert s.run("import threading, os\nthreading.Thread(target=lambda: [None for _ in iter(int, 1)]).start()").ok
    workers = list(p._idle.queue) + [s._worker]
    inits = [w.init_pid for w in workers]
    groups = [p for w in workers if w.cgroup is not None for p in (w.cgroup.path, w.cgroup.pids_path) if p]
    r = p.run(detached_spinner(marker) + "while True:\n    pass", timeout=1)
    assert r.status == "timeout"
    p.close()
    assert survivors(uid) == [] and survivors(marker=marker) == []
    assert [pid for pid in inits if Path(f"/proc/{pid}").exists()] == []
    assert [g for g in groups if Path(g).exists()] == []  # their cgroups are removed too


def test_workers_die_with_the_harness(tmp_path):
    marker = f"sandbox-orphan-{uuid.uuid4().hex}"
    script = tmp_path / "harness.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from sandbox import SandboxConfig, SandboxPool
        p = SandboxPool(SandboxConfig(pool_size=1, preimports=()))
        s = p.session()
        s.run("import threading, os\\nthreading.Thread(target=lambda: [None for _ in iter(int, 1)]).start()")
        print(s._worker.init_pid, flush=True)
        os.kill(os.getpid(), 9)  # the harness dies without closing anything
    """))
    proc = subprocess.Popen([sys.executable, str(script), marker], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    init = int(out.split()[0])
    deadline = time.monotonic() + 5
    while Path(f"/proc/{init}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{init}").exists()
    from sandbox import cgroup

    for version, base, _ in (cgroup.available(), cgroup.pids_available()):
        if version is not None:  # the dead harness's groups are removed by the next one that starts
            cgroup._remove_stale(base)
            assert [n for n in os.listdir(base) if n.startswith(f"{cgroup.PREFIX}{proc.pid}-")] == []


# ---- 2. no host filesystem socket is reachable

@pytest.fixture
def host_sockets(tmp_path):
    """World-writable listening unix sockets in host places a cell might try, plus an abstract one."""
    tag = uuid.uuid4().hex[:8]
    paths = [Path(f"/run/sandbox-test-{tag}.sock"), tmp_path / "s.sock", ROOT / f".sandbox-test-{tag}.sock",
             Path(f"/var/tmp/sandbox-test-{tag}.sock"), Path(f"/dev/shm/sandbox-test-{tag}.sock")]
    made = []
    for path in paths:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        os.chmod(path, 0o777)
        srv.listen(4)
        srv.setblocking(False)
        made.append((str(path), srv))
    dgram_path = Path(f"/run/sandbox-test-{tag}-dgram.sock")
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(str(dgram_path))
    os.chmod(dgram_path, 0o777)
    dgram.setblocking(False)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0sandbox-test-{tag}")
    abstract.listen(4)
    abstract.setblocking(False)
    yield {"stream": [p for p, _ in made], "dgram": str(dgram_path), "abstract": f"\0sandbox-test-{tag}"}
    got = []
    for p, srv in made + [("abstract", abstract)]:
        try:
            got.append((p, srv.accept()))
        except BlockingIOError:
            pass
        srv.close()
    try:
        got.append(("dgram", dgram.recv(100)))
    except BlockingIOError:
        pass
    dgram.close()
    for path in paths + [dgram_path]:
        path.unlink(missing_ok=True)
    assert got == [], f"a host socket received something from the sandbox: {got}"


def test_no_host_unix_socket_is_reachable(pool, host_sockets):
    code = textwrap.dedent(f"""
        import socket
        for path in {host_sockets['stream'] + [host_sockets['abstract']]!r}:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                s.sendall(b'escaped')
                print('CONNECTED', repr(path))
            except OSError as e:
                print('blocked', type(e).__name__)
        d = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            d.sendto(b'escaped', {host_sockets['dgram']!r})
            print('SENT')
        except OSError as e:
            print('blocked', type(e).__name__)
    """)
    for run in (pool.run, pool.session().run):
        r = run(code)
        assert r.status == "ok", r.feedback()
        assert "CONNECTED" not in r.stdout.text and "SENT" not in r.stdout.text, r.stdout.text
        assert r.stdout.text.count("blocked") == len(host_sockets["stream"]) + 2


def test_sandbox_root_holds_only_the_runtime_and_no_socket(pool):
    runtime = sorted({d for _, d in isolation._binds()} - set(isolation.SYSTEM_DIRS))
    code = textwrap.dedent(f"""
        import os, stat
        print(sorted(os.listdir('/')))
        skip = {['/proc', '/usr', *runtime]!r}
        socks = []
        for root, dirs, files in os.walk('/'):
            dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
            for name in files + dirs:
                try:
                    if stat.S_ISSOCK(os.lstat(os.path.join(root, name)).st_mode):
                        socks.append(os.path.join(root, name))
                except OSError:
                    pass
        print(socks)
    """)
    r = pool.run(code, timeout=10)
    top, socks = r.stdout.text.splitlines()
    allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin", "tmp", "usr", "var",
               ".keep"} | {d.strip("/").split("/")[0] for d in runtime}
    assert set(eval(top)) <= allowed, top
    assert socks == "[]", socks
    r = pool.run("import os\nprint(os.path.exists('/var/run'), os.path.exists('/sys'), os.path.exists('/home'))")
    assert r.stdout.text == "False False False\n"


# ---- 3. SysV IPC is the sandbox's own and dies with it

IPC = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    IPC_CREAT = 0o1000
    def shm(key, size, create):
        return libc.shmget(key, size, (IPC_CREAT | 0o666) if create else 0)
""")


def ipcs_keys() -> str:
    return subprocess.run(["ipcs"], capture_output=True, text=True, check=True).stdout


def test_shared_memory_does_not_pass_between_cells_or_reach_the_host(pool):
    key = int(uuid.uuid4().hex[:7], 16)
    before = ipcs_keys()
    r = pool.run(IPC + f"""
i = shm({key}, 1 << 20, True)
print(i >= 0, libc.semget({key}, 1, IPC_CREAT | 0o666) >= 0, libc.msgget({key}, IPC_CREAT | 0o666) >= 0)
""")
    assert r.stdout.text == "True True True\n", r.feedback()
    assert f"{key:#010x}" not in ipcs_keys() and ipcs_keys() == before
    r = pool.run(IPC + f"print(shm({key}, 0, False), libc.semget({key}, 0, 0), libc.msgget({key}, 0, 0))")
    assert r.stdout.text == "-1 -1 -1\n", r.stdout.text  # the next cell (same worker) sees none of it
    with pool.session() as a, pool.session() as b:
        assert a.run(IPC + f"print(shm({key}, 1 << 20, True) >= 0)").stdout.text == "True\n"
        assert b.run(IPC + f"print(shm({key}, 0, False))").stdout.text == "-1\n"
        assert a.run(IPC + f"print(shm({key}, 0, False) >= 0)").stdout.text == "True\n"  # its own, kept
        assert f"{key:#010x}" not in ipcs_keys()
    assert ipcs_keys() == before


def test_shared_memory_counts_against_the_memory_limit(pool):
    if idle_worker(pool).cgroup is None:
        pytest.skip("no writable memory cgroup on this machine")
    r = pool.run(IPC + textwrap.dedent("""
        done = 0
        for k in range(5):  # each segment is touched, then detached: it stays, holding its memory
            i = shm(0, 128 << 20, True)
            addr = libc.shmat(i, None, 0)
            assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
            ctypes.memset(addr, 1, 128 << 20)
            libc.shmdt(ctypes.c_void_p(addr))
            done += 1
        print('touched', done)
    """), timeout=10)
    assert r.status == "killed" and "memory limit" in r.feedback(), r
    healthy(pool)


# ---- 4. the session control channel and runner are out of reach

FORGE = [  # (writing forged replies to every descriptor: test_session_cell_cannot_use_the_control_channel)
    # break the serializer the runner uses
    "import json\njson.dumps = lambda *a, **k: 'garbage'\nprint('FORGED')",
    # replace the runner's reply with a well-formed one for another cell
    "import __main__\n__main__._write_frame = lambda fd, obj: __import__('os').write(fd, b'\\x00\\x00\\x00\\x02{}')\nprint('FORGED')",
    # make the runner never answer
    "import __main__\n__main__._write_frame = lambda fd, obj: None\nprint('FORGED')",
]


@pytest.mark.parametrize("attack", FORGE, ids=["json-dumps", "forged-frame", "silent-runner"])
def test_session_cell_cannot_forge_or_misattribute_results(pool, attack):
    with pool.session() as s:
        assert s.run("x = 7").ok
        r = s.run(attack, timeout=2)  # never raises
        assert r.status != "ok" and r.restarted, r
        assert r.total_seconds < 3
        for k in range(3):
            r = s.run(f"print('cell', {k}, x)", timeout=5)
            assert r.status == "ok" and r.stdout.text == f"cell {k} 7\n", r


# Every descriptor a session cell could reach the control channel by: fd numbers of its own process
# and every link under /proc/*/task/*/fd (other threads' tables, other processes it can read).
REACH = textwrap.dedent("""
    import fcntl, glob, os, select, threading
    JUNK = b'\\xff\\xff\\xff\\x7fgarbage'  # a frame header announcing 2 GiB, then nonsense
    def links(flags):
        out = []
        for path in glob.glob('/proc/*/task/*/fd/*'):
            try:
                out.append(os.open(path, flags | os.O_NONBLOCK))
            except OSError:
                pass
        return out
    def open_fds():
        out = []
        for fd in range(3, 1024):
            try:
                out.append((fd, fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE))
            except OSError:
                pass
        return out
    def write_all():
        for fd in [fd for fd, _ in open_fds()] + links(os.O_WRONLY):
            try:
                os.write(fd, JUNK)
            except OSError:
                pass
    def read_all(block):
        for fd in [fd for fd, _ in open_fds()] + links(os.O_RDONLY):
            try:
                os.set_blocking(fd, block)
                os.read(fd, 1 << 16)
            except OSError:
                pass
    def close_all():
        for fd in range(3, 1024):
            try:
                os.close(fd)
            except OSError:
                pass
    def background(job, *args):
        threading.Thread(target=job, args=args, daemon=True).start()
""")
CHANNEL_ATTACKS = {
    # garbage to every descriptor, during this cell
    "write": "write_all()",
    # garbage to every descriptor once anything readable arrives (the next cell's request, if the
    # channel is reachable), so it lands inside the next cell's exchange
    "write-later": "def later():\n    select.select([fd for fd, _ in open_fds()], [], [])\n    write_all()\n"
                   "background(later)",
    # read every descriptor now (non-blocking), and from threads blocking on each one, stealing
    # whatever arrives (the next cell's request, if they could reach it)
    "read": "read_all(False)\nfor _ in range(4):\n    background(read_all, True)",
    # close every descriptor, then keep closing from a thread while the next cells run
    "close": "close_all()\nbackground(lambda: [close_all() for _ in iter(int, 1)])",
    # replace every readable descriptor with a pipe that never answers
    "replace": "jam, keep = os.pipe()\nfor fd, mode in open_fds():\n    if fd not in (jam, keep) and mode == os.O_RDONLY:\n"
               "        os.dup2(jam, fd)",
    # a forked copy of the cell returns into the runner with whatever it inherited
    "fork": "pid = os.fork()\nprint('child' if pid == 0 else 'parent')",
    # copy every descriptor of every thread of this process (pidfd_getfd on thread pidfds, Linux
    # 6.9+), then quietly read from all of them in the background
    "pidfd-getfd": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                   "for tid in set(map(int, os.listdir('/proc/self/task'))) - {os.getpid()}:\n"
                   "    pidfd = libc.syscall(434, tid, os.O_EXCL)  # pidfd_open(tid, PIDFD_THREAD)\n"
                   "    for fd in range(16):\n        libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd\n"
                   "background(read_all, True)",
}


@pytest.mark.parametrize("attack", list(CHANNEL_ATTACKS), ids=list(CHANNEL_ATTACKS))
def test_session_cell_cannot_use_the_control_channel(pool, attack):
    """A cell that writes to, reads from or closes the session's control channel (by any fd it can
    find) must not cost the next, innocent cell anything: it runs normally, with its state. The
    innocent cells get a time limit far above their need, so a stolen request or a jammed channel
    shows as status 'timeout', never as a slow pass."""
    with pool.session() as s:
        assert s.run("x = 7").ok
        r = s.run(REACH + CHANNEL_ATTACKS[attack], timeout=5)  # never raises
        assert r.status == "ok" and not r.restarted, r  # the channel was never reached, nothing to restart
        for k in range(3):
            r = s.run(f"print('cell', {k}, x)", timeout=10)
            assert r.status == "ok" and r.stdout.text == f"cell {k} 7\n", r


def test_cells_cannot_read_the_worker_process(pool):
    code = ("import os\nfor p in ('/proc/1/fd', '/proc/1/mem', '/proc/1/environ'):\n    try:\n"
            "        os.listdir(p) if p.endswith('fd') else open(p, 'rb').read(1)\n        print('READ', p)\n"
            "    except OSError as e:\n        print('denied', type(e).__name__)")
    for run in (pool.run, pool.session().run):
        r = run(code)
        assert "READ" not in r.stdout.text and r.stdout.text.count("denied") == 3, r.stdout.text


def test_garbled_or_out_of_order_replies_are_a_dead_worker(pool):
    w = idle_worker(pool)
    w._buf = b'{"id": "not-yours", "status": {"kind": "exit", "code": 0}}\n'
    with pytest.raises(WorkerDied, match="out of order"):
        w.request({"op": "ping"}, 2)
    assert not w.alive()
    r = pool.run("print(1)")  # the pool notices the dead worker before it hands out the cell
    assert r.status == "ok" and r.stdout.text == "1\n", r
    w = idle_worker(pool)
    w._buf = b"\x00not json\n"
    r = pool.run("print(2)")
    assert r.status == "killed" and "failed" in r.feedback(), r
    healthy(pool)


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


def test_session_restore_is_bounded_by_the_replay_budget():
    p = SandboxPool(SandboxConfig(pool_size=1, limits=Limits(wall_seconds=1.5), **FAST))
    try:
        with p.session() as s:
            for k in range(3):
                assert s.run(f"import time\ntime.sleep(0.6)\nx{k} = {k}").ok
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
    "threads": ("import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()", 5),
    # every process forks until forking fails (BlockingIOError)
    "processes": ("import os\nwhile True:\n    os.fork()", 5),
    # a fork loop that swallows the failures and so runs into its time limit
    "processes-until-timeout": ("import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n            time.sleep(60)\n"
                                "            os._exit(0)\n    except OSError:\n        pass", 1),
}


@pytest.fixture(scope="module")
def small_pool():
    p = SandboxPool(SandboxConfig(pool_size=1, limits=Limits(wall_seconds=5, max_processes=TASKS), **FAST))
    w = idle_worker(p)
    if w.cgroup is None or w.cgroup.pids_path is None:
        p.close()
        from sandbox import cgroup

        why = f"memory: {cgroup.available()[2]}; pids: {cgroup.pids_available()[2]}; worker group: {w.cgroup}"
        pytest.skip(f"no writable pids cgroup for this worker ({why}): the limit binds (RLIMIT_NPROC) but counts nothing")
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
                            f"from sandbox.slots import Slots\ns = Slots(4, {str(tmp_path)!r})\nprint(s.take(), s.take())"],
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
