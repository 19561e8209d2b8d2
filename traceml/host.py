"""What a process may use of its host (agent and launcher side; standard library only)."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask), else the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
