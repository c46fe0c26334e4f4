"""Host-side handle of one sandbox worker process (see _worker.py for the inside).

The handle owns three ways to end everything the worker started, used together on `kill()`:
a pidfd on the pid namespace's init (SIGKILL to it makes the kernel kill the whole namespace, and
its exit is only reported once the namespace is empty), the wrapper's process group, and the
worker's memory cgroup (every member is killed). Replies are checked strictly: a reply that does
not parse, does not answer the request just sent (its `id`), or lacks a field is a dead worker.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sandbox import isolation
from sandbox.cgroup import CellGroup
from sandbox.config import SandboxConfig

WORKER_SCRIPT = Path(__file__).with_name("_worker.py")
STARTUP_SECONDS = 60.0
GRACE_SECONDS = 3.0  # beyond a cell's own timeout before the host kills the whole worker
KILL_WAIT_SECONDS = 5.0
MAX_REPLY_BYTES = 16 << 20  # replies carry capped output only; more without a newline is garbage
THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_request_ids = itertools.count(1)


# With a pids cgroup, pids.max is the thread and process limit (it counts what it refuses), and
# RLIMIT_NPROC must never refuse first. It counts every process of the slot's uid, and a slot's uid
# passes from a killed worker to the next, whose first cell can start while the last one's processes
# (at most pids.max of them) are still being torn down: so twice the limit, plus one. (With one above
# the limit a fork bomb sometimes ran into RLIMIT_NPROC and its result did not name the limit.)
def task_rlimit(max_processes: int, counted: bool) -> int:
    return 2 * max_processes + 1 if counted and max_processes else max_processes


class WorkerDied(RuntimeError):
    """The worker process ended, stopped answering or answered nonsense; it must be replaced."""

    def __init__(self, msg: str, hung: bool = False):
        super().__init__(msg)
        self.hung = hung


def _worker_source() -> str:
    """The worker's code, passed with `-c`: the project folder need not be visible in the sandbox."""
    return WORKER_SCRIPT.read_text()


def _init_pid(wrapper: int) -> int | None:
    """Host pid of the namespace's init: the only child of util-linux `unshare --fork`."""
    try:
        kids = Path(f"/proc/{wrapper}/task/{wrapper}/children").read_text().split()
        if kids:
            return int(kids[0])
    except OSError:
        pass
    for d in os.listdir("/proc"):  # kernels without /proc/.../children
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == wrapper:
                    return int(d)
            except (OSError, ValueError, IndexError):
                pass
    return None


def _valid_stream(s: Any) -> bool:
    return (isinstance(s, dict) and isinstance(s.get("head"), str) and isinstance(s.get("tail"), str)
            and type(s.get("omitted")) is int and type(s.get("total")) is int and len(s) == 4)


def check_run_reply(reply: dict[str, Any]) -> None:
    """Raise WorkerDied unless `reply` is a well-formed answer to a run request."""
    st = reply.get("status")
    ok = (isinstance(st, dict) and st.get("kind") in ("exit", "signal", "timeout", "crash")
          and (st.get("kind") != "exit" or type(st.get("code")) is int)
          and (st.get("kind") != "signal" or isinstance(st.get("signal"), str))
          and _valid_stream(reply.get("stdout")) and _valid_stream(reply.get("stderr"))
          and isinstance(reply.get("seconds"), (int, float)) and isinstance(reply.get("clean"), bool))
    if not ok:
        raise WorkerDied(f"sandbox worker sent a malformed reply: {str(reply)[:200]}")


class Worker:
    def __init__(self, config: SandboxConfig, mechanism: str, slot: int, mode: str = "fork"):
        self.config, self.mechanism, self.slot, self.mode = config, mechanism, slot, mode
        self._scratch: str | None = None
        self._init_fd: int | None = None
        self.cgroup: CellGroup | None = CellGroup.create() if mechanism == "namespaces" else None
        self._seen: dict[str, int] = {}  # cgroup counter -> its value at the last new_* call
        isolated = mechanism == "namespaces"
        if isolated:
            workdir = "/tmp/cell"
        else:
            self._scratch = tempfile.mkdtemp(prefix="sandbox-")
            workdir = os.path.join(self._scratch, "cell")
        python = config.python or sys.executable
        counted = self.cgroup is not None and self.cgroup.pids_path is not None
        cfg = {
            "mode": mode, "workdir": workdir, "uid": isolation.slot_uid(slot, mechanism),
            "limits": config.limits.as_dict(), "preimports": list(config.preimports),
            "capture_bytes": config.capture_bytes, "env": THREAD_ENV, "isolate_ipc": isolated,
            "task_rlimit": task_rlimit(config.limits.max_processes, counted),
            "fresh": {"tmpfs": list(isolation.PRIVATE_TMP), "tmpfs_mb": config.limits.tmpfs_mb,
                      "rebind": isolation.rebinds(config.python)} if isolated else None,
        }
        argv = isolation.wrap([python, "-I", "-c", _worker_source(), json.dumps(cfg)], mechanism, config.python)
        self._stderr = tempfile.TemporaryFile()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SANDBOX_TMPFS_MB": str(config.limits.tmpfs_mb),
               "SANDBOX_CGROUP_PROCS": self.cgroup.procs_file if self.cgroup else "",
               "SANDBOX_PIDS_CGROUP_PROCS": self.cgroup.pids_procs_file if self.cgroup else "",
               "LANG": "C.UTF-8", **THREAD_ENV}
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                         env=env, start_new_session=True, close_fds=True)
        except OSError:
            self._release()
            raise
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""
        try:
            hello = self._read_line(time.monotonic() + STARTUP_SECONDS)
            if not hello.get("ready"):
                raise WorkerDied(f"sandbox worker did not start: {hello} {self._startup_error()}")
            self._attach_init()
            if self.cgroup is not None:
                self.cgroup.limit_memory(config.limits.memory_mb << 20)
                # a session's interpreter already runs: its main thread is the cell's own
                own = 1 if mode == "session" else 0
                if counted and not self.cgroup.limit_tasks(config.limits.max_processes - own):
                    raise WorkerDied("sandbox worker's thread and process limit could not be set")
        except BaseException:
            self.close()
            raise
        self.info = hello

    def _attach_init(self) -> None:
        """Hold a pidfd on the namespace's init (the worker itself without namespaces)."""
        pid = _init_pid(self.proc.pid) if self.mechanism == "namespaces" else self.proc.pid
        if pid is None:
            raise WorkerDied("sandbox worker's namespace init not found")
        self._init_fd = os.pidfd_open(pid)
        self.init_pid = pid

    def _startup_error(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace").strip()[-500:]

    def _read_line(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerDied("sandbox worker stopped answering", hung=True)
            try:
                if not self._sel.select(left):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            except (OSError, ValueError) as e:  # closed under us (the session was closed meanwhile)
                raise WorkerDied(f"sandbox worker is gone: {e}") from None
            if not chunk:
                self.kill()
                raise WorkerDied(f"sandbox worker exited (code {self.proc.returncode}) {self._startup_error()}".strip())
            self._buf += chunk
            if len(self._buf) > MAX_REPLY_BYTES:
                self.kill()
                raise WorkerDied("sandbox worker sent an oversized reply")
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            self.kill()
            raise WorkerDied(f"sandbox worker sent an unparseable reply: {line[:200]!r}")
        return reply

    def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request and return its reply; WorkerDied on anything else (the worker is then dead)."""
        rid = f"{os.urandom(4).hex()}-{next(_request_ids)}"
        try:
            self.proc.stdin.write((json.dumps({**payload, "id": rid}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            self.kill()
            raise WorkerDied(f"sandbox worker is gone: {e}") from None
        reply = self._read_line(time.monotonic() + timeout + GRACE_SECONDS)
        if reply.get("id") != rid:
            self.kill()
            raise WorkerDied(f"sandbox worker answered out of order (expected {rid}, got {reply.get('id')!r})")
        if payload.get("op") == "run":
            try:
                check_run_reply(reply)
            except WorkerDied:
                self.kill()
                raise
        return reply

    def alive(self) -> bool:
        """The wrapper and the namespace's init both still run (a cheap check, no round trip)."""
        if self.proc.poll() is not None:
            return False
        if self._init_fd is not None:
            ready, _, _ = select.select([self._init_fd], [], [], 0)
            return not ready
        return True

    def _growth(self, counter: str) -> int:
        """How much the cgroup's `counter` (the name of its reading method) grew since the last call for
        it (0 without a cgroup)."""
        if self.cgroup is None:
            return 0
        n = getattr(self.cgroup, counter)()
        new, self._seen[counter] = n - self._seen.get(counter, 0), n
        return new

    def new_oom_kills(self) -> int:
        """Processes the cgroup's OOM killer ended since the last call (0 without a cgroup)."""
        return self._growth("oom_kills")

    def new_task_limit_hits(self) -> int:
        """Forks and thread starts the task limit refused since the last call (0 without a pids cgroup)."""
        return self._growth("task_limit_hits")

    def kill(self) -> None:
        """Kill the worker and everything it started; returns once all of it is gone."""
        if self._init_fd is not None:
            try:
                signal.pidfd_send_signal(self._init_fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            select.select([self._init_fd], [], [], KILL_WAIT_SECONDS)  # readable once the namespace is empty
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.cgroup is not None:
            self.cgroup.kill()
        try:
            self.proc.wait(KILL_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            pass

    def _release(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def close(self) -> None:
        self.kill()
        self._sel.close()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._stderr.close()
        if self._init_fd is not None:
            os.close(self._init_fd)
            self._init_fd = None
        self._release()
