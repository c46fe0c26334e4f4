"""Isolated python execution for the TIR harness: no network, resource limits, timeouts that kill
every descendant, capped output, stateful sessions, and a warm pool. Bad code never takes the
harness down. Standard library only on the host side.
"""

from sandbox.config import DEFAULT_PREIMPORTS, Limits, SandboxConfig
from sandbox.pool import SandboxPool
from sandbox.result import CellResult, Stream
from sandbox.session import Session

__all__ = ["CellResult", "DEFAULT_PREIMPORTS", "Limits", "SandboxConfig", "SandboxPool", "Session", "Stream"]
