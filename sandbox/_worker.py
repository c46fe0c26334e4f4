"""The process that supervises model-written code. Started by sandbox/worker.py, one per pool slot or session.

It is deliberately one self-contained file: it runs as `python -I -c <this file>`, so it needs
neither the project on its path nor the project folder inside the sandbox's root. Protocol: one
JSON line per request on fd 0, one JSON line per reply on fd 1; every request carries an `id` that
its reply echoes. Both are moved to private descriptors at start, and 0/1/2 then point at /dev/null.

This process never runs model code itself. It is the namespace's pid 1 and stays root; every cell
runs in a child that drops to the slot's uid, closes the channel and gets its rlimits. So a cell
can reach neither the channel nor this process's memory (no ptrace, no /proc/1/fd: other uid), and
whatever it does to its own process (monkeypatching json, `__main__`, signals) only changes its own
process, whose every report is checked here. (Sessions used to run cells in this process itself;
a cell could then read and write the channel and patch the runner, so a session now has a child
of its own too, at the cost of one more process wake-up per cell, ~0.2 ms.)

Two modes:
- fork (stateless pool cells): a warm "zygote" with the preimports loaded; each cell runs in a
  fresh fork, writing stdout/stderr to pipes read here with caps. After every cell this process
  kills everything else in the namespace (kill(-1): detached and setsid() grandchildren too), reaps
  them, moves to a fresh IPC namespace if the cell left SysV objects, and mounts fresh tmpfs on
  /tmp, /var/tmp, /dev/shm, /run and /run/lock if the cell left any trace there, so the next cell
  (often another sample's) starts from empty folders with its own working directory, and nothing
  the cell did to those folders can reach this process. The reply says whether that cleanup
  worked (`clean`); the host replaces a worker that is not clean.
- session (stateful): one long-lived child, forked from the warm zygote, runs the session's cells
  in its own interpreter so later cells see earlier variables. Requests reach it over a pipe with
  a fresh random nonce per cell; its status reply must echo that nonce in a strict format. Both
  pipes are held only by a thread of the child with a descriptor table of its own, so the cell's
  code, its threads and its forks have no descriptor that leads to them (see _session_child). Its
  stdout/stderr are pipes read here with caps. The child interrupts a cell with an interval timer
  at the time limit; if the cell ignores that, this process kills the child shortly after. Any
  unparseable, out-of-order or oversized status, or the child's death, is a crash: the reply says
  `crashed` and the host restores the session (op `reset` forks a fresh child from the zygote).
  When a session ends, op `park` kills its child and everything else in the namespace; the host
  keeps the worker for a later session, which op `reset` starts (fresh temporary folders, IPC
  namespace and child, as after a crash) instead of starting a new worker.
"""

import ctypes
import json
import linecache
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time
import traceback

CELL_FILE = "<cell>"
CHANNEL_IN, CHANNEL_OUT, DIAGNOSTICS = 0, 1, 2
CLONE_NEWIPC, CLONE_FILES = 0x08000000, 0x400
MNT_DETACH = 2
MS_NOSUID, MS_NODEV, MS_NOATIME = 2, 4, 1024
SESSION_KILL_GRACE = 0.5  # after its time limit, a session cell that ignored the timer is killed
SESSION_START_SECONDS = 20.0  # for a new session child to report that its channel thread is up
MAX_STATUS_BYTES = 1 << 16
_libc = None


class CellTimeout(BaseException):
    """Raised in a session cell by the interval timer."""


# ---- channel to the host

def _setup_channel():
    global CHANNEL_IN, CHANNEL_OUT, DIAGNOSTICS
    CHANNEL_IN = os.dup(0)
    CHANNEL_OUT = os.dup(1)
    DIAGNOSTICS = os.dup(2)  # the host's log of this worker: for the worker's own failures only
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    for fd in (CHANNEL_IN, CHANNEL_OUT, DIAGNOSTICS):
        os.set_inheritable(fd, False)


def _send(obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(CHANNEL_OUT, data):]


def _requests():
    buf = b""
    while True:
        chunk = os.read(CHANNEL_IN, 1 << 16)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)


# ---- kernel calls the stdlib lacks (unshare, mount, prctl)

def _lib():
    """libc, loaded once, with errno kept for ctypes.get_errno()."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _sys(name, *args):
    libc = _lib()
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _mount_tmpfs(path, mb, mode):
    opts = f"size={mb}m,mode={mode}".encode()
    _sys("mount", b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOATIME, opts)


def _bind_ro(src, dst):
    os.makedirs(dst, exist_ok=True)
    _sys("mount", src.encode(), dst.encode(), None, 0x1000, None)  # MS_BIND
    _sys("mount", None, dst.encode(), None, 0x1000 | 0x20 | 1, None)  # MS_BIND | MS_REMOUNT | MS_RDONLY


# ---- the cell's environment

def _trimmed_traceback(exc):
    """The traceback as the model should see it: only frames of its own code, no harness frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != CELL_FILE:
        tb = tb.tb_next
    if isinstance(exc, SyntaxError) or tb is None:
        return "".join(traceback.format_exception_only(type(exc), exc))
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _compile(code):
    """(code object for the cell, code object for its trailing expression or None).

    As in a notebook, a cell whose last statement is an expression shows that expression's value
    (its repr, unless it is None or the line ends with ';'): a block ending in `math.comb(10, 3)`
    shows 120. Line numbers stay those of the cell, so tracebacks point at the model's lines.
    """
    import ast

    name = CELL_FILE
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    tree = ast.parse(code, name, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
        last = compile(ast.Expression(tree.body.pop().value), name, "eval")
    return compile(tree, name, "exec"), last


def _apply_limits(cfg, inline=False):
    limits = cfg["limits"]

    def lim(kind, value):
        if value:
            resource.setrlimit(kind, (value, value))

    mb = 1 << 20
    if limits.get("memory_mb"):
        # The budget is on top of what the warm interpreter already maps.
        base = 0
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmSize:"):
                        base = int(line.split()[1]) * 1024
        except OSError:
            pass
        lim(resource.RLIMIT_AS, base + limits["memory_mb"] * mb)
    lim(resource.RLIMIT_FSIZE, limits.get("file_size_mb", 0) * mb)
    lim(resource.RLIMIT_NOFILE, limits.get("open_files", 0))
    nproc = cfg.get("task_rlimit") or limits.get("max_processes", 0)
    # a session's channel thread runs as the cell's uid but is the harness's, not part of the cell's budget
    lim(resource.RLIMIT_NPROC, nproc + 1 if nproc and inline else nproc)
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))  # no POSIX message queues (they would outlive the cell)
    if not inline and limits.get("cpu_seconds"):
        lim(resource.RLIMIT_CPU, int(limits["cpu_seconds"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


PR_SET_PDEATHSIG = 1


def _die_with_parent(parent):
    """SIGKILL this process when the worker that forked it ends. Without namespaces the session's child is in
    a process group of its own (setsid) that killing the worker's misses, and stopped between cells it never
    reads the end of its channel: it stayed, stopped, with all its memory, after every session. Set after the
    uid drop, which clears it; checked against a parent that died before it was set."""
    _sys("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(120)


def _drop_privileges(uid):
    if uid is not None and os.getuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 4, 24, 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _drop_capabilities():
    """A cell still root after `_drop_privileges` (a harness that is not root maps only its own uid into the
    user namespace, so cells stay its root) gives up every capability there: the bounding set (nothing comes
    back through exec), the ambient set, then effective, permitted and inheritable. Without them the
    worker's memory (/proc/1/mem; it is not dumpable) and its mounts are out of a cell's reach, as the uid
    drop keeps them where the harness is root. Fails closed: a cell never runs with them."""
    if os.geteuid() != 0:  # a uid drop cleared them
        return
    libc = _lib()
    try:
        for cap in range(64):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                if ctypes.get_errno() == 22:  # EINVAL: past the kernel's last capability
                    break
                raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before Linux 4.3: none to clear
        header = ctypes.create_string_buffer(struct.pack("Ii", LINUX_CAPABILITY_VERSION_3, 0))
        data = ctypes.create_string_buffer(24)  # two (effective, permitted, inheritable) words, all zero
        if libc.capset(header, data) != 0:
            raise OSError(ctypes.get_errno(), "capset")
    except OSError as e:
        os.write(2, f"sandbox: the cell's capabilities could not be dropped: {e}\n".encode())
        os._exit(120)


_snapshot = None  # fingerprint of the private folders right after they were last made fresh


def _fingerprint(cfg):
    """Everything a cell could change in the private folders and leave for the next cell.

    Per private tmpfs: its inode and block counts (any file anywhere in it counts) and its root's
    inode, mode, owner and times; for the working directory (the one folder a cell owns) also its
    extended attributes. The roots are root-owned (sticky or 755), so a cell cannot set their
    attributes; the mounts are noatime, so reading them changes nothing. Equal fingerprints mean
    nothing of the previous cell is left.
    """
    out = []
    for d in cfg["fresh"]["tmpfs"]:
        v, st = os.statvfs(d), os.lstat(d)
        out.append((v.f_files - v.f_ffree, v.f_blocks - v.f_bfree, st.st_ino, st.st_mode, st.st_uid, st.st_gid,
                    st.st_nlink, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns))
    st = os.lstat(cfg["workdir"])
    out.append((st.st_ino, st.st_dev, st.st_mode, st.st_uid, st.st_gid, st.st_nlink, st.st_size, st.st_atime_ns,
                st.st_mtime_ns, st.st_ctime_ns, os.listxattr(cfg["workdir"], follow_symlinks=False)))
    return out


def _fresh_state(cfg):
    """Empty private folders and a new working directory for the next cell; False if that failed.

    Namespaces: if anything differs from the fingerprint taken when the folders were last made
    fresh, every private tmpfs is detached and mounted again (O(1), and nothing a cell renamed,
    filled or replaced with a FIFO survives). A cell that left no trace costs a few lstat calls.
    Without namespaces: a new scratch folder.
    """
    global _snapshot
    uid, workdir = cfg.get("uid"), cfg["workdir"]
    try:
        fresh = cfg.get("fresh")
        if fresh and _snapshot is not None and not fresh["rebind"] and _fingerprint(cfg) == _snapshot:
            return True
        if fresh:
            for t in fresh["tmpfs"]:
                parent_is_fresh = any(t.startswith(p + "/") for p in fresh["tmpfs"])
                if not parent_is_fresh:
                    _sys("umount2", t.encode(), MNT_DETACH)
                else:
                    os.makedirs(t, exist_ok=True)
                _mount_tmpfs(t, fresh["tmpfs_mb"], "755" if t == "/run" else "1777")
            for src, dst in fresh["rebind"]:
                _bind_ro(src, dst)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(workdir, mode=0o700)
        if uid is not None and os.getuid() == 0:
            os.chown(workdir, uid, uid)
        if fresh:
            _snapshot = _fingerprint(cfg)
        return True
    except OSError:
        _snapshot = None
        return False


IPC_INFO_CALLS = (("shmctl", 14, 0), ("semctl", 19, 7), ("msgctl", 12, 0))  # (call, SHM/SEM/MSG_INFO, field)


def _ipc_objects():
    """How many SysV shared memory segments, semaphore sets and message queues exist here.

    One *_INFO call each (the `used_ids`, `semusz` and `msgpool` counts), ~100x cheaper than
    reading /proc/sysvipc.
    """
    libc = _lib()
    total = 0
    for call, cmd, field in IPC_INFO_CALLS:
        buf = (ctypes.c_int * 32)()
        args = (0, 0, cmd, buf) if call == "semctl" else (0, cmd, buf)
        if getattr(libc, call)(*args) < 0:
            raise OSError(ctypes.get_errno(), f"{call} info")
        total += buf[field]
    return total


def _fresh_ipc(cfg):
    """Leave an IPC namespace in which a cell created SysV objects, so the next cell sees none.

    Pool cells share pid 1's IPC namespace (a new one per cell cost ~0.5 ms of fork time); after
    the cell's processes are dead, any object left makes pid 1 move to a fresh namespace, and the
    old one (objects and their memory) is freed with its last member. POSIX message queues cannot
    be created at all (RLIMIT_MSGQUEUE is 0 for cells).
    """
    if not cfg.get("isolate_ipc"):
        return True
    try:
        if _ipc_objects():
            _sys("unshare", CLONE_NEWIPC)
        return True
    except OSError:
        return False


def _exit_code(code):
    """(exit status, message) for SystemExit(code); a nonzero request never becomes success.

    Python's own rule (an int is the status, None is 0, anything else is printed and gives 1) with
    one change: ints the OS would wrap to 0 (256, 2**70) give 1.
    """
    if code is None:
        return 0, None
    if isinstance(code, int):
        c = int.__and__(int(code), 0xFF)
        return (c if c or code == 0 else 1), None
    try:
        msg = str(code)
    except BaseException:  # noqa: BLE001 - the model's object
        msg = "<unprintable exit message>"
    return 1, msg


def _run_code(code, glob):
    """Run one cell's code in `glob`; (status dict). Prints the trimmed traceback or exit message."""
    status = {"kind": "exit", "code": 0}
    try:
        body, last = _compile(code)
        exec(body, glob)
        if last is not None:
            value = eval(last, glob)
            if value is not None:
                print(repr(value))
    except CellTimeout:
        status = {"kind": "timeout"}
    except SystemExit as e:
        c, msg = _exit_code(e.code)
        if msg is not None:
            _safe_write(msg + "\n")
        status = {"kind": "exit", "code": c}
    except BaseException as e:  # noqa: BLE001 - the model's exception, reported to it
        try:
            _safe_write(_trimmed_traceback(e))
        except BaseException:  # noqa: BLE001
            pass
        status = {"kind": "exit", "code": 1}
    return status


def _safe_write(text):
    try:
        os.write(2, text.encode("utf-8", "backslashreplace"))
    except OSError:
        pass


def _std_streams():
    sys.stdout = os.fdopen(1, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, errors="backslashreplace", closefd=False)


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass


class Capture:
    """Keeps the first and last `cap` bytes of a stream and counts the rest."""

    def __init__(self, cap):
        self.cap, self.head, self.tail, self.total = cap, bytearray(), bytearray(), 0

    def add(self, data):
        self.total += len(data)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.cap:
                del self.tail[: len(self.tail) - self.cap]

    def render(self):
        omitted = self.total - len(self.head) - len(self.tail)
        return {"head": self.head.decode("utf-8", "replace"), "tail": self.tail.decode("utf-8", "replace"),
                "omitted": omitted, "total": self.total}


def _others(keep):
    """Live pids in this pid namespace other than pid 1 and `keep` (zombies are dead already: their
    parent, the session child, reaps them; they are not pid 1's to reap)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) not in (1, keep):
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                        continue
            except (OSError, IndexError):
                continue
            out.append(int(d))
    return out


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_others_and_reap(pgid=None, keep=None):
    """Remove what a cell left running, then reap it; True when nothing is left.

    As the namespace's pid 1 without a child to keep: kill(-1) hits every other process in the
    namespace (detached or not). Keeping the session child: SIGKILL every other pid until none is
    left (forks made meanwhile are caught next round; RLIMIT_NPROC bounds them). Without a pid
    namespace (isolation 'none') kill(-1) would hit the whole machine, so only the cell's process
    group is killed; a child that called setsid() can then survive.
    """
    if os.getpid() != 1:
        try:
            if pgid is not None:
                os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return True
    if keep is None:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return True
    for _ in range(200):
        pids = _others(keep)
        if not pids:
            _reap()
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()
        time.sleep(0.001)
    return not _others(keep)


def _oom_score(value):
    """Set this process's OOM score adjustment (children inherit it); best effort."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError:
        pass


def _isolate_ipc(cfg):
    """A fresh IPC namespace for this session child: what it creates vanishes with it."""
    if cfg.get("isolate_ipc"):
        _sys("unshare", CLONE_NEWIPC)


def _status_of(wstatus):
    if os.WIFSIGNALED(wstatus):
        return {"kind": "signal", "signal": signal.Signals(os.WTERMSIG(wstatus)).name}
    return {"kind": "exit", "code": os.WEXITSTATUS(wstatus)}


# ---- fork mode: one fresh process per cell

def _forked_cell(req, base_globals, cfg, out_w, err_w):
    """The child: never returns."""
    try:
        os.setsid()
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 16)
        _oom_score(1000)  # cells are the OOM killer's first choice, in the cgroup and on the host
        _drop_privileges(cfg.get("uid"))
        os.chdir(cfg["workdir"])
        _apply_limits(cfg)
        _drop_capabilities()
        _confine_syscalls()
        _std_streams()
        status = _run_code(req["code"], dict(base_globals))
        _flush()
        os._exit(status.get("code", 1))
    finally:
        os._exit(120)


def _run_forked(req, base_globals, cfg):
    limits = cfg["limits"]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _forked_cell(req, base_globals, cfg, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    cap = cfg["capture_bytes"]
    caps = {out_r: Capture(cap), err_r: Capture(cap)}
    pidfd = os.pidfd_open(pid)
    deadline = t0 + float(req.get("timeout") or limits.get("wall_seconds", 10))
    open_fds = {out_r, err_r}
    exited = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select(list(open_fds) + ([] if exited else [pidfd]), [], [], left)
        for fd in ready:
            if fd == pidfd:
                exited = True
                continue
            data = os.read(fd, 1 << 16)
            if data:
                caps[fd].add(data)
            else:
                open_fds.discard(fd)
        if exited and not open_fds:
            break
        if exited:
            # the cell is gone; a detached child may still hold the pipes: drain briefly, then stop
            ready, _, _ = select.select(list(open_fds), [], [], 0.005)
            if not ready:
                break
    timed_out = not exited and time.monotonic() >= deadline
    elapsed = time.monotonic() - t0
    if not exited:
        os.kill(pid, signal.SIGKILL)
    _, wstatus = os.waitpid(pid, 0)
    _kill_others_and_reap(pgid=pid)
    os.close(pidfd)
    for fd in (out_r, err_r):
        os.close(fd)
    status = {"kind": "timeout"} if timed_out else _status_of(wstatus)
    return {"status": status, "stdout": caps[out_r].render(), "stderr": caps[err_r].render(),
            "seconds": elapsed, "clean": _fresh_ipc(cfg) and _fresh_state(cfg)}


# ---- session mode: one long-lived child per session

def _write_frame(fd, obj):
    data = json.dumps(obj).encode()
    data = struct.pack("!I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _session_child(req_fd, status_fd, glob):
    """The session child's runner (uid dropped, limits set): run cells in `glob`. Never returns.

    The cell runs in this process, so a descriptor this process holds is one the cell can write
    to, read from, close or replace, and one that the threads and processes it starts inherit;
    any of that used to make a later, innocent cell wait for its time limit. So the control
    channel lives in a thread of its own with a private descriptor table (unshare(CLONE_FILES)):
    once that thread has its copy, the main thread closes the channel in the table it shares with
    everything the cell runs or starts. No fd number, /proc/self/fd entry or inherited descriptor
    of the cell leads to the channel; /proc/self/task/<tid>/fd shows the channel thread's links,
    but reopening a pipe through them is refused (the pipes belong to root and the cell runs as
    the slot's uid; without the uid drop this holds only as far as the user namespace does), and
    pidfd_getfd(), which could copy them, is filtered out (`_confine_syscalls`). The two threads hand
    over a cell and its status through queues; the cell runs in the main thread, where the
    interval timer's signal arrives.
    """
    import queue
    import threading
    import warnings

    # The channel thread makes every session multi-threaded: Python 3.12+ would warn at each fork()
    # a cell makes that it "may lead to deadlocks" (it cannot here: that thread holds no lock a child needs).
    warnings.filterwarnings("ignore", message=r"This process \(pid=\d+\) is multi-threaded",
                            category=DeprecationWarning)
    # Each cell comes with a queue of its own for its status. A cell can reach the runner's objects (its frames
    # lead here) and put a status in: through one shared status queue, its own real status then answered the
    # next request and every later cell got the one before it's output. Now it can reach only its own reply
    # queue (the next cell's does not exist yet): a forged status ends the forging cell early, nothing more.
    cells = queue.SimpleQueue()
    private = threading.Event()

    def channel():
        try:
            _sys("unshare", CLONE_FILES)
            private.set()
            _write_frame(status_fd, {"ready": True})
            while True:
                head = _read_exact(req_fd, 4)
                if head is None:
                    os._exit(0)  # the worker closed the channel: the session is over
                msg = json.loads(_read_exact(req_fd, struct.unpack("!I", head)[0]))
                reply = queue.SimpleQueue()
                cells.put((msg["code"], float(msg["timeout"]), reply))
                status, seconds, threads = reply.get()
                del reply  # the next cell's queue is made when it comes
                _write_frame(status_fd, {"nonce": msg["nonce"], "status": status, "seconds": seconds,
                                         "threads": threads})
        finally:
            os._exit(120)  # the channel broke: this interpreter ends, the worker sees it die

    def on_alarm(signum, frame):
        raise CellTimeout()

    channel_thread = threading.Thread(target=channel, name="sandbox-channel", daemon=True)
    channel_thread.start()
    private.wait()
    ours = {threading.main_thread().native_id, channel_thread.native_id}
    os.close(req_fd)
    os.close(status_fd)
    _confine_syscalls()
    me = os.getpid()
    while True:
        try:
            code, timeout, reply = cells.get()
        except BaseException:  # noqa: BLE001 - a signal handler the cell left behind raised between cells
            continue
        t0 = time.monotonic()
        try:
            signal.signal(signal.SIGALRM, on_alarm)
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout)
                status = _run_code(code, glob)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except CellTimeout:  # the timer fired outside the cell's own code (the timer is one-shot: it is spent)
            status = {"kind": "timeout"}
        elapsed = time.monotonic() - t0
        _flush()
        if os.getpid() != me:  # a copy the cell forked, back from its code: it ends like a pool cell
            os._exit(status.get("code", 1))
        # the worker stops this process between cells and continues it for the next: a SIGCONT handler the
        # cell left would run then, outside any cell (raising there ended the interpreter, and every restore)
        signal.signal(signal.SIGCONT, signal.SIG_DFL)
        # the kernel thread ids of the threads the cells left running, as the interpreter lists them (a joined
        # thread is gone from the list when its join returns; /proc still listed it while it exited): ids, not
        # a count, so that a thread started while an older one ended is still seen as new. A cell that lies
        # here misleads only its own sample's note
        try:  # a cell can patch threading: the note is then wrong for its sample, the session goes on
            left = sorted({i for i in (t.native_id for t in threading.enumerate()) if type(i) is int and i > 0}
                          - ours)[-MAX_THREAD_IDS:]  # the newest ids, where a cell left more than the frame holds
        except BaseException:
            left = []
        reply.put((status, elapsed, left))
        del reply


MAX_THREAD_IDS = 4096  # the status frame lists at most this many of a session's left-running threads
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 1, 1
SECCOMP_ALLOW, SECCOMP_ERRNO = 0x7FFF0000, 0x00050000
EPERM, ENOSYS = 1, 38
# the clone flags that make new namespaces (CLONE_NEWTIME, 0x80, is not one of clone()'s: there it is the exit signal)
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
# numbers the unified syscall table gave every architecture but alpha and mips (their tables are offset)
SYS_PIDFD_GETFD, SYS_CLONE3 = 438, 435
# a 64-bit interpreter's audit arch and its numbers of unshare, setns, clone (flags in args[0]) and seccomp
NATIVE_SYSCALLS = {"x86_64": (0xC000003E, 272, 308, 56, 317), "aarch64": (0xC00000B7, 97, 268, 220, 277),
                   "riscv64": (0xC00000F3, 97, 268, 220, 277)}
# its numbers of ptrace, process_vm_readv and process_vm_writev: reading or writing another process
TRACE_SYSCALLS = {"x86_64": (101, 310, 311), "aarch64": (117, 270, 271), "riscv64": (117, 270, 271)}


def _abi():
    """The interpreter's machine as NATIVE_SYSCALLS names it, "" for one it lacks (uname names the kernel's:
    a 32-bit interpreter on a 64-bit kernel makes its calls through another ABI), None where the shared
    numbers are not shared."""
    machine = os.uname().machine
    if machine.startswith(("alpha", "mips")):
        return None
    return machine if struct.calcsize("P") == 8 and machine in NATIVE_SYSCALLS else ""


def _syscall_filter(abi):
    """The seccomp program (classic BPF, (code, jt, jf, k) tuples) `_confine_syscalls` installs.

    Refused with EPERM: pidfd_getfd (copies a descriptor out of another thread's table: the session's channel
    thread), unshare, setns, and clone with a namespace flag (a cell in a user namespace of its own is root there:
    mounts, every namespaced interface of the kernel opened to model code), ptrace and process_vm_readv/writev (a
    cell run as its worker's uid, where the harness is not root, could otherwise drive the unfiltered worker
    that holds the host's channel). clone3 answers ENOSYS, as in
    container runtimes: its flags sit in memory a filter cannot read, and glibc, seeing ENOSYS, starts threads
    and processes with clone. Another ABI than the native one (int 0x80's i386 calls from an x86_64 process,
    x32 numbers) answers ENOSYS to everything: its numbers would pass the checks above. On an ABI without a
    table here ("") only the two shared numbers are filtered.
    """
    ld_arch, ld_nr, ld_arg0 = (0x20, 0, 0, 4), (0x20, 0, 0, 0), (0x20, 0, 0, 16)  # seccomp_data fields
    deny, nosys = (0x06, 0, 0, SECCOMP_ERRNO | EPERM), (0x06, 0, 0, SECCOMP_ERRNO | ENOSYS)
    allow = (0x06, 0, 0, SECCOMP_ALLOW)
    if abi not in NATIVE_SYSCALLS:
        return [ld_nr, (0x15, 2, 0, SYS_PIDFD_GETFD), (0x15, 2, 0, SYS_CLONE3), allow, deny, nosys]
    arch, unshare, setns, clone, _ = NATIVE_SYSCALLS[abi]
    denied = (SYS_PIDFD_GETFD, unshare, setns, *TRACE_SYSCALLS[abi])
    d = len(denied)  # the layout: 0-3 arch and number, 4 x32, 5.. denied, clone3, clone, its flags, the verdicts
    return [ld_arch,
            (0x15, 1, 0, arch),  # the native ABI: go on
            nosys,
            ld_nr,
            (0x45, 6 + d, 0, 0x40000000),  # x32's numbers: ENOSYS
            *((0x15, 4 + d - j, 0, nr) for j, nr in enumerate(denied)),  # EPERM
            (0x15, 5, 0, SYS_CLONE3),
            (0x15, 0, 2, clone),
            ld_arg0,  # clone's flags (their low 32 bits: every CLONE_NEW* is there)
            (0x45, 1, 0, CLONE_NEW_ANY),
            allow,
            deny,
            nosys]


def _confine_syscalls():
    """Install `_syscall_filter` in every thread of this process and all they start, with no_new_privs.

    Every thread: a session's interpreter has its channel thread (which did its unshare(CLONE_FILES) before
    this), and a cell can make that thread run its code (it calls json.dumps, os.read): a filter on the calling
    thread alone (prctl) left a fork from there free to unshare. So the filter goes in through seccomp() with
    TSYNC, and a failure to install it ends the process with a message on its stderr: the cell never runs
    unconfined. Where no table is known (another ABI) prctl installs the two shared numbers' filter, best effort;
    on alpha and mips nothing is installed."""
    abi = _abi()
    if abi is None:
        return
    bpf = _syscall_filter(abi)
    prog = b"".join(struct.pack("HBBI", *ins) for ins in bpf)
    buf = ctypes.create_string_buffer(prog)
    fprog = ctypes.create_string_buffer(struct.pack("@HP", len(bpf), ctypes.addressof(buf)))  # struct sock_fprog
    libc = _lib()
    if abi not in NATIVE_SYSCALLS:
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0)
        return
    ctypes.set_errno(0)
    done = libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if done == 0:  # else -1; with TSYNC a positive result is the thread that could not take the filter
        done = libc.syscall(NATIVE_SYSCALLS[abi][4], SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, fprog)
    if done != 0:
        why = f"thread {done} could not take it" if done > 0 else os.strerror(ctypes.get_errno())
        os.write(2, f"sandbox: the system-call filter could not be installed: {why}\n".encode())
        os._exit(120)


class SessionChild:
    """Handle, in pid 1, of the session's child: its pid, pidfd and the four pipes to it."""

    def __init__(self, base_globals, cfg):
        req_r, self.req_w = os.pipe()
        self.status_r, status_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.err_r, err_w = os.pipe()
        worker = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.setsid()
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                os.dup2(req_r, 3)
                os.dup2(status_w, 4)
                os.closerange(5, 1 << 16)
                _oom_score(1000)
                _isolate_ipc(cfg)
                _drop_privileges(cfg.get("uid"))
                _die_with_parent(worker)
                os.chdir(cfg["workdir"])
                _apply_limits(cfg, inline=True)
                _drop_capabilities()
                _std_streams()
                _session_child(3, 4, dict(base_globals))
            finally:
                os._exit(120)
        for fd in (req_r, status_w, out_w, err_w):
            os.close(fd)
        for fd in (self.req_w, self.status_r, self.out_r, self.err_r):
            os.set_blocking(fd, False)
        self.pidfd = os.pidfd_open(self.pid)
        self.alive = True
        self.ready = self._await_ready()

    def _await_ready(self):
        """Wait for the child's `ready` frame: its channel thread is up. False if it died or said anything else."""
        raw, deadline = b"", time.monotonic() + SESSION_START_SECONDS
        while not _status_complete(raw):
            left = deadline - time.monotonic()
            if left <= 0 or len(raw) > MAX_STATUS_BYTES:
                return False
            ready, _, _ = select.select([self.status_r, self.pidfd], [], [], left)
            if self.pidfd in ready:
                return False
            chunk = _read_some(self.status_r) if ready else None
            if chunk == b"":
                return False
            raw += chunk or b""
        try:
            return len(raw) == 4 + struct.unpack("!I", raw[:4])[0] and json.loads(raw[4:]) == {"ready": True}
        except ValueError:
            return False

    def pause(self):
        """Stop the child, every thread of it, until the next cell: a thread a cell left running (a busy
        loop, a timer that exits the process) otherwise ran on between cells, outside every limit, for as
        long as the session lived. SIGSTOP cannot be caught, blocked or ignored."""
        self._signal(signal.SIGSTOP)

    def resume(self):
        self._signal(signal.SIGCONT)

    def _signal(self, sig):
        if self.alive:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        """SIGKILL the child and reap it; its exit status (or None if it was already reaped)."""
        status = None
        if self.alive:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                _, wstatus = os.waitpid(self.pid, 0)
                status = _status_of(wstatus)
            except ChildProcessError:
                pass
            self.alive = False
        for fd in (self.req_w, self.status_r, self.out_r, self.err_r, self.pidfd):
            try:
                os.close(fd)
            except OSError:
                pass
        return status


def _parse_status(raw, nonce):
    """The child's status frame if it is exactly one well-formed reply to `nonce`, else None."""
    if len(raw) < 4:
        return None
    n = struct.unpack("!I", raw[:4])[0]
    if len(raw) != 4 + n:
        return None
    try:
        msg = json.loads(raw[4:])
    except ValueError:
        return None
    if not isinstance(msg, dict) or set(msg) != {"nonce", "status", "seconds", "threads"} or msg["nonce"] != nonce:
        return None
    st, secs, threads = msg["status"], msg["seconds"], msg["threads"]
    if not isinstance(secs, (int, float)) or not isinstance(st, dict) or type(threads) is not list:
        return None
    if len(threads) > MAX_THREAD_IDS or not all(type(t) is int and t > 0 for t in threads):
        return None
    if st == {"kind": "timeout"}:
        return msg
    if set(st) == {"kind", "code"} and st["kind"] == "exit" and type(st["code"]) is int and 0 <= st["code"] <= 255:
        return msg
    return None


def _status_complete(raw):
    return len(raw) >= 4 and len(raw) >= 4 + struct.unpack("!I", raw[:4])[0]


def _run_session_cell(child, req, cfg):
    """Relay one cell to the session child, enforcing the deadline and checking its status."""
    limits, cap = cfg["limits"], cfg["capture_bytes"]
    timeout = float(req.get("timeout") or limits.get("wall_seconds", 10))
    nonce = os.urandom(12).hex()
    child.resume()
    frame = json.dumps({"nonce": nonce, "code": req["code"], "timeout": timeout}).encode()
    pending = struct.pack("!I", len(frame)) + frame
    caps = {child.out_r: Capture(cap), child.err_r: Capture(cap)}
    raw, crash = b"", None
    t0 = time.monotonic()
    hard = t0 + timeout + SESSION_KILL_GRACE
    try:
        pending = pending[os.write(child.req_w, pending):]  # usually all of it: the pipe is empty
    except BlockingIOError:
        pass
    except OSError:
        crash = "died"
    while crash is None:
        left = hard - time.monotonic()
        if left <= 0:
            crash = "timeout"
            break
        rd = [child.out_r, child.err_r, child.status_r, child.pidfd]
        ready, writable, _ = select.select(rd, [child.req_w] if pending else [], [], left)
        if writable:
            try:
                pending = pending[os.write(child.req_w, pending):]
            except BlockingIOError:
                pass
            except OSError:
                crash = "died"
                break
        if child.pidfd in ready:
            crash = "died"
            break
        for fd in (child.out_r, child.err_r):
            if fd in ready:
                _drain(fd, caps[fd])
        if child.status_r in ready:
            chunk = _read_some(child.status_r)
            if chunk is None:
                continue
            if not chunk:  # the child closed its status pipe: it is ending; let it finish to get its status
                select.select([child.pidfd], [], [], SESSION_KILL_GRACE)
                crash = "died"
                break
            raw += chunk
            if len(raw) > MAX_STATUS_BYTES or (len(raw) >= 4 and struct.unpack("!I", raw[:4])[0] > MAX_STATUS_BYTES):
                crash = "protocol"  # no status is that long: garbage, reported now rather than at the deadline
                break
            if _status_complete(raw):
                break
    elapsed = time.monotonic() - t0
    for fd in (child.out_r, child.err_r):
        _drain(fd, caps[fd])
    msg = None if crash else _parse_status(raw, nonce)
    if crash is None and msg is None:
        crash = "protocol"
    if crash:
        wst = child.kill()
        if crash == "timeout":
            status = {"kind": "timeout"}
        elif crash == "died" and wst is not None:
            status = wst
        else:
            status = {"kind": "crash"}
        _kill_others_and_reap()
        return {"status": status, "stdout": caps[child.out_r].render(), "stderr": caps[child.err_r].render(),
                "seconds": elapsed, "crashed": crash, "clean": True}
    child.pause()
    clean = _kill_others_and_reap(keep=child.pid)
    child.pause()  # again: a process the cell left could have continued it before it was killed
    # Read again once the cell's leftovers are dead: what a process it started (or a forked copy of the
    # runner) wrote after the status came back belongs to this cell, not to the next one.
    for fd in (child.out_r, child.err_r):
        _drain(fd, caps[fd])
    return {"status": msg["status"], "stdout": caps[child.out_r].render(), "stderr": caps[child.err_r].render(),
            "seconds": float(msg["seconds"]), "crashed": None, "clean": clean, "threads": msg["threads"]}


def _read_some(fd):
    """Bytes, b'' at EOF, or None when nothing is there after all."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _drain(fd, cap):
    """Read what `fd` holds now, without waiting."""
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except (BlockingIOError, OSError):
            return
        if not data:
            return
        cap.add(data)


def _serve_session(cfg, base_globals):
    child = None

    def start():
        nonlocal child
        if child is not None:
            child.kill()
        _kill_others_and_reap()
        if not _fresh_state(cfg):
            child = None
            return False
        child = SessionChild(base_globals, cfg)
        if not child.ready:
            child.kill()
            child = None
        return child is not None

    ok = start()
    _send({"ready": ok, "pid": os.getpid(), "uid": cfg.get("uid"), "failed_preimports": cfg["_failed"]})
    for req in _requests():
        rid = req.get("id")
        if req.get("op") == "ping":
            _send({"id": rid, "pong": True})
        elif req.get("op") == "reset":
            _send({"id": rid, "reset": start()})
        elif req.get("op") == "park":  # the session ended: nothing of it runs on or stays in memory
            if child is not None:
                child.kill()
                child = None
            _send({"id": rid, "parked": _kill_others_and_reap() and _fresh_state(cfg)})
        elif child is None or not child.alive:
            _send({"id": rid, "status": {"kind": "crash"}, "stdout": Capture(0).render(),
                   "stderr": Capture(0).render(), "seconds": 0.0, "crashed": "missing", "clean": True})
        else:
            reply = _run_session_cell(child, req, cfg)
            if reply["crashed"]:
                child = None
            reply["id"] = rid
            _send(reply)
    if child is not None:  # the host closed the channel: the session's interpreter ends with this worker
        child.kill()


def _serve_pool(cfg, base_globals):
    ok = _fresh_state(cfg)
    _send({"ready": ok, "pid": os.getpid(), "uid": cfg.get("uid"), "failed_preimports": cfg["_failed"]})
    for req in _requests():
        if req.get("op") == "ping":
            _send({"id": req.get("id"), "pong": True})
            continue
        reply = _run_forked(req, base_globals, cfg)
        reply["id"] = req.get("id")
        _send(reply)


def main():
    cfg = json.loads(sys.argv[1])
    # not dumpable: opening /proc/<this>/mem or tracing it needs CAP_SYS_PTRACE, which no cell holds, even
    # one of this process's uid (a harness that is not root); cells inherit it (after a uid drop it was so too)
    _sys("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
    _setup_channel()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # oversized writes raise OSError instead of killing
    os.environ.update(cfg.get("env", {}))
    base_globals = {"__name__": "__main__", "__builtins__": __builtins__}
    failed = []
    for line in cfg.get("preimports", []):
        try:
            exec(line, base_globals)
        except Exception as e:  # noqa: BLE001 - a missing optional module must not stop the worker
            failed.append(f"{line}: {type(e).__name__}: {e}")
    cfg["_failed"] = failed
    if os.getpid() == 1:
        _oom_score(-1000)  # the cgroup's OOM killer must pick a cell, never this process (needs CAP_SYS_RESOURCE)
    code = 0
    try:
        if cfg["mode"] == "session":
            _serve_session(cfg, base_globals)
        else:
            _serve_pool(cfg, base_globals)
    except BaseException:  # noqa: BLE001 - logged for the host, then the worker ends
        os.write(DIAGNOSTICS, traceback.format_exc().encode())
        code = 70
    os._exit(code)  # never wait for threads: pid 1 leaving ends the namespace


if __name__ == "__main__":
    main()
