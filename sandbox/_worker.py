"""The process that runs model-written code. Started by sandbox/worker.py, one per pool slot.

It is deliberately one self-contained file (it runs with `python -I`, so it cannot import the
project). Protocol: one JSON line per request on fd 0, one JSON line per reply on fd 1; both are
moved to private descriptors at start, and 0/1/2 then point at /dev/null so nothing the cell does
can reach the channel.

Two modes:
- fork (stateless cells): this process is the namespace's pid 1 and a warm "zygote" with the
  preimports loaded; each cell runs in a fresh fork that drops to the slot's uid, gets its rlimits
  and a private working directory, and writes stdout/stderr to pipes the zygote reads with caps.
  After every cell the zygote kills everything else in the namespace (kill(-1)), which removes
  detached grandchildren, and reaps them.
- inline (stateful sessions): the cell runs in this process so later cells see earlier variables;
  stdout/stderr go to capped files on the private tmpfs; a timer interrupts Python code, and the
  host kills the whole namespace when C code does not yield.
"""

import json
import linecache
import os
import resource
import select
import shutil
import signal
import sys
import time
import traceback

CELL_FILE = "<cell>"
CHANNEL_IN, CHANNEL_OUT = 0, 1


class CellTimeout(BaseException):
    """Raised in an inline cell by the interval timer."""


def _setup_channel():
    global CHANNEL_IN, CHANNEL_OUT
    CHANNEL_IN = os.dup(0)
    CHANNEL_OUT = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    for fd in (CHANNEL_IN, CHANNEL_OUT):
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


def _trimmed_traceback(exc):
    """The traceback as the model should see it: only frames of its own code, no harness frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != CELL_FILE:
        tb = tb.tb_next
    if isinstance(exc, SyntaxError) or tb is None:
        return "".join(traceback.format_exception_only(type(exc), exc))
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _compile(code):
    name = CELL_FILE
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    return compile(code, name, "exec")


def _apply_limits(limits, inline=False):
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
    lim(resource.RLIMIT_NPROC, limits.get("max_processes", 0))
    if not inline and limits.get("cpu_seconds"):
        lim(resource.RLIMIT_CPU, int(limits["cpu_seconds"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _drop_privileges(uid):
    if uid is not None and os.getuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def _fresh_dir(path, uid):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, mode=0o700)
    if uid is not None and os.getuid() == 0:
        os.chown(path, uid, uid)


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


def _kill_others_and_reap(pgid=None):
    """Remove what the cell left running, then reap it.

    As the namespace's pid 1: SIGKILL every other process in the namespace (detached or not).
    Without a pid namespace (isolation 'none') kill(-1) would hit the whole machine, so only the
    cell's process group is killed; a child that called setsid() can then survive.
    """
    try:
        if os.getpid() == 1:
            os.kill(-1, signal.SIGKILL)
        elif pgid is not None:
            os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if os.getpid() != 1:
        return
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _run_forked(req, base_globals, cfg):
    limits, uid = cfg["limits"], cfg.get("uid")
    workdir = cfg["workdir"]
    _fresh_dir(workdir, uid)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the cell
        try:
            os.setsid()
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.closerange(3, 1 << 16)
            _drop_privileges(uid)
            os.chdir(workdir)
            _apply_limits(limits)
            sys.stdout = os.fdopen(1, "w", buffering=1, errors="backslashreplace", closefd=False)
            sys.stderr = os.fdopen(2, "w", buffering=1, errors="backslashreplace", closefd=False)
            code = 0
            try:
                exec(_compile(req["code"]), dict(base_globals))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except BaseException as e:  # noqa: BLE001 - the model's exception, reported to it
                sys.stderr.write(_trimmed_traceback(e))
                code = 1
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:  # noqa: BLE001
                pass
            os._exit(code & 0xFF)
        finally:
            os._exit(120)
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
    if timed_out:
        status = {"kind": "timeout"}
    elif os.WIFSIGNALED(wstatus):
        status = {"kind": "signal", "signal": signal.Signals(os.WTERMSIG(wstatus)).name}
    else:
        status = {"kind": "exit", "code": os.WEXITSTATUS(wstatus)}
    return {"status": status, "stdout": caps[out_r].render(), "stderr": caps[err_r].render(),
            "seconds": elapsed}


def _run_inline(req, session_globals, cfg):
    limits = cfg["limits"]
    cap = cfg["capture_bytes"]
    paths = [os.path.join(cfg["workdir"], ".stdout"), os.path.join(cfg["workdir"], ".stderr")]
    saved = [os.dup(1), os.dup(2)]
    files = [open(p, "wb") for p in paths]
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    timeout = float(req.get("timeout") or limits.get("wall_seconds", 10))

    def on_alarm(signum, frame):
        raise CellTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    t0 = time.monotonic()
    status = {"kind": "exit", "code": 0}
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        exec(_compile(req["code"]), session_globals)
    except CellTimeout:
        status = {"kind": "timeout"}
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        status = {"kind": "exit", "code": code}
    except BaseException as e:  # noqa: BLE001 - the model's exception, reported to it
        try:
            sys.stderr.write(_trimmed_traceback(e))
        except BaseException:  # noqa: BLE001
            pass
        status = {"kind": "exit", "code": 1}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    elapsed = time.monotonic() - t0
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    for fd in saved:
        os.close(fd)
    outs = []
    for f, p in zip(files, paths):
        f.close()
        c = Capture(cap)
        with open(p, "rb") as fh:
            c.add(fh.read(2 * cap))
            size = os.path.getsize(p)
        c.total = max(c.total, size)
        outs.append(c.render())
        os.unlink(p)
    _kill_others_and_reap()
    return {"status": status, "stdout": outs[0], "stderr": outs[1], "seconds": elapsed}


def main():
    cfg = json.loads(sys.argv[1])
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
    inline = cfg["mode"] == "inline"
    os.makedirs(cfg["workdir"], exist_ok=True)
    if inline:
        _fresh_dir(cfg["workdir"], cfg.get("uid"))
        _drop_privileges(cfg.get("uid"))
        os.chdir(cfg["workdir"])
        _apply_limits(cfg["limits"], inline=True)
    _send({"ready": True, "pid": os.getpid(), "uid": os.getuid(), "failed_preimports": failed})
    session_globals = dict(base_globals)
    for req in _requests():
        if req.get("op") == "ping":
            _send({"pong": True})
            continue
        if inline:
            reply = _run_inline(req, session_globals, cfg)
        else:
            reply = _run_forked(req, base_globals, cfg)
        _send(reply)


if __name__ == "__main__":
    main()
