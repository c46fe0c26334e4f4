"""Host-side handle of one sandbox worker process (see _worker.py for the inside)."""

from __future__ import annotations

import json
import os
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
from sandbox.config import SandboxConfig

WORKER_SCRIPT = Path(__file__).with_name("_worker.py")
STARTUP_SECONDS = 60.0
GRACE_SECONDS = 3.0  # beyond a cell's own timeout before the host kills the whole worker
THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class WorkerDied(RuntimeError):
    """The worker process ended or stopped answering; it must be replaced."""

    def __init__(self, msg: str, hung: bool = False):
        super().__init__(msg)
        self.hung = hung


class Worker:
    def __init__(self, config: SandboxConfig, mechanism: str, slot: int, mode: str = "fork"):
        self.config, self.mechanism, self.slot, self.mode = config, mechanism, slot, mode
        self._scratch: str | None = None
        if mechanism == "namespaces":
            workdir = "/tmp/cell"
        else:
            self._scratch = tempfile.mkdtemp(prefix="sandbox-")
            workdir = os.path.join(self._scratch, "cell")
        cfg = {
            "mode": mode, "workdir": workdir, "uid": isolation.slot_uid(slot, mechanism),
            "limits": config.limits.as_dict(), "preimports": list(config.preimports),
            "capture_bytes": config.capture_bytes, "env": THREAD_ENV,
        }
        argv = isolation.wrap([config.python or sys.executable, "-I", str(WORKER_SCRIPT), json.dumps(cfg)], mechanism)
        self._stderr = tempfile.TemporaryFile()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SANDBOX_TMPFS_MB": str(config.limits.tmpfs_mb),
               "LANG": "C.UTF-8", **THREAD_ENV}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     env=env, start_new_session=True, close_fds=True)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""
        hello = self._read_line(time.monotonic() + STARTUP_SECONDS)
        if not hello.get("ready"):
            raise WorkerDied(f"sandbox worker did not start: {hello}")
        self.info = hello

    def _startup_error(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace").strip()[-500:]

    def _read_line(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerDied("sandbox worker stopped answering", hung=True)
            if not self._sel.select(left):
                continue
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                code = self.proc.wait()
                raise WorkerDied(f"sandbox worker exited (code {code}) {self._startup_error()}".strip())
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            self.proc.stdin.write((json.dumps(payload) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            self.kill()
            raise WorkerDied(f"sandbox worker is gone: {e}") from None
        return self._read_line(time.monotonic() + timeout + GRACE_SECONDS)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Kill the worker and, through its namespace (or process group), everything it started."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        self._sel.close()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._stderr.close()
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
