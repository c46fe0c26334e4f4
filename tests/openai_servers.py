"""`make serve`'s server as a subprocess on loopback for the openai tests (real uvicorn, real engine).

Each server lives in its own process group and is always killed by its fixture; `hang_guard` fails
a test that runs past its time instead of hanging CI.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from hang_guard import fail_after

ROOT = Path(__file__).resolve().parents[1]
TEST_SECONDS = 120
hang_guard = fail_after(TEST_SECONDS)


def wait_for(cond, timeout: float = 30.0) -> bool:
    """Poll `cond` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m server.programs.serve --engine <dir>` on 127.0.0.1 and an ephemeral port."""

    def __init__(self, engine_dir: Path, log: Path, *extra: str):
        self.engine_dir, self.log, self.extra = engine_dir, log, extra
        self.port = free_port()
        self.proc: Optional[subprocess.Popen] = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.programs.serve", "--engine", str(self.engine_dir), "--port", str(self.port),
             "--threads", "1", "--max-batch-size", "8", "--max-seq-len", "384", "--model-name", "tiny", *self.extra],
            stdout=self.log.open("a"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
        return self

    def wait_ready(self, timeout: float = 90.0) -> "ServerProcess":
        import httpx2

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}"
            try:
                if httpx2.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx2.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready in {timeout}s: {self.log.read_text()[-3000:]}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics(self) -> dict[str, float]:
        import httpx2

        out = {}
        for line in httpx2.get(self.base + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
