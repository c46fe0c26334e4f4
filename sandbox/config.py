"""Sandbox settings: limits per cell, preimports, how much output is kept and fed back."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

# What the AIMO-3 harness preimported, plus the aliases whose absence caused most NameErrors.
DEFAULT_PREIMPORTS = (
    "import math",
    "import numpy as np",
    "import sympy as sp",
    "import sympy",
    "import itertools",
    "import collections",
    "from collections import Counter, defaultdict, deque",
    "import fractions",
    "from fractions import Fraction",
    "import random",
    "import mpmath",
    "import functools",
    "import re",
)


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0  # per cell; every descendant is killed at the deadline (also a session's replay budget)
    cpu_seconds: int = 20  # RLIMIT_CPU backstop per stateless cell
    memory_mb: int = 1024  # on top of the warm worker: all of a cell's processes together (memory cgroup,
    #                        tmpfs files and SysV shared memory included) and, per process, address space
    file_size_mb: int = 16  # largest file a cell may write
    open_files: int = 64
    max_processes: int = 32  # threads and processes of a cell and all it starts, its main thread included
    #                          (pids cgroup, which counts refusals for the result; else RLIMIT_NPROC per slot uid)
    tmpfs_mb: int = 64  # each private tmpfs (/tmp, /var/tmp, /dev/shm, /run, /run/lock), fresh per pool cell

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SandboxConfig:
    limits: Limits = field(default_factory=Limits)
    preimports: tuple[str, ...] = DEFAULT_PREIMPORTS
    isolation: str = "auto"  # auto | namespaces | none
    capture_bytes: int = 64 * 1024  # head and tail kept of each stream
    pool_size: int = 0  # 0: sized to the machine
    python: str = ""  # interpreter for workers; default: the harness's own

    def resolved_pool_size(self) -> int:
        return self.pool_size or min(32, max(4, 2 * (os.cpu_count() or 1)))
