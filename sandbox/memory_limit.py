"""How the memory limit binds on this host: over a cell and all it starts (a memory cgroup, with
namespaces), or per process only (RLIMIT_AS), which a pool warns about when it starts.

Its own module because this is a property of the host, checked when a pool starts, apart from
running cells.
"""

from __future__ import annotations

from sandbox import cgroup, isolation


class MemoryLimitWarning(isolation.IsolationWarning):
    """The memory limit binds per process only (no writable memory cgroup)."""


def memory_limit_scope(mechanism: str) -> str:
    """How the memory limit binds here; warns when it is per process only."""
    if mechanism != "namespaces":
        return "memory limit per process (RLIMIT_AS)"
    version, _, reason = cgroup.available()
    if version is None:
        import warnings

        warnings.warn(f"sandbox: {reason}; the memory limit binds per process only, so a cell's forked "
                      "children can together exceed it", MemoryLimitWarning, stacklevel=3)
        return "memory limit per process (RLIMIT_AS)"
    return reason
