"""Process telemetry of one rank: CPU %, RSS, device memory (agent side).

Runs on the sender thread every sample interval, never on the training path:
a first sample at the sender's first tick and a last one in its final flush
at exit, so every rank that ran has samples however short its run.
Standard library and torch only (no psutil in the agent): CPU time from
``time.process_time``, RSS from /proc/self/statm, device memory from torch's
caching allocator counters (no synchronisation).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from traceml.agent.cuda_timing import allocator_bytes
from traceml.host import usable_cpus
from traceml.wire.envelope import Message
from traceml.wire.rows import PROCESS_FIELDS, ProcessRows


class RssReader:
    """Host RSS of this process from /proc/self/statm: a few µs, no psutil."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> int | None:
        if self._fd is None:
            return None
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) * self._page
        except (OSError, IndexError, ValueError):
            return None


def host_ram_total_bytes() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def device_memory() -> tuple[int | None, int | None, int | None]:
    """(allocated, reserved, total) bytes of this rank's CUDA device; None off CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None, None, None
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    allocated, reserved = allocator_bytes(torch.cuda, device, "current")
    return allocated, reserved, int(total)


class ProcessSampler:
    """Produces a process sample at the first call, then at most every
    ``interval_s``, and at the next call after `sample_at_next_call`."""

    def __init__(self, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.rss = RssReader()
        self.ram_total = host_ram_total_bytes()
        self.num_cpus = usable_cpus()
        self._last_wall = clock()
        self._last_cpu = time.process_time()
        self._due = self._last_wall  # the first sample's CPU is over the time since now

    def sample_at_next_call(self) -> None:
        """Take a sample at the next call, due or not (the exit sample)."""
        self._due = -math.inf

    def sample(self) -> list[tuple[Any, ...]]:
        now = self.clock()
        if now < self._due:
            return []
        self._due = now + self.interval_s
        cpu = time.process_time()
        cpu_pct = 100.0 * (cpu - self._last_cpu) / max(now - self._last_wall, 1e-6)
        self._last_wall, self._last_cpu = now, cpu
        alloc, reserved, total = device_memory()
        return [(time.time(), round(cpu_pct, 2), self.rss.read(), self.ram_total,
                 self.num_cpus, alloc, reserved, total)]

    def produce(self) -> list[Message]:
        rows = self.sample()
        if not rows:
            return []
        return [ProcessRows(PROCESS_FIELDS, rows)]
