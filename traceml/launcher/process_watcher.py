"""``traceml watch``: process telemetry of the workers, sampled from outside
by the launcher (launcher side).  Nothing is injected into the workers.

Each worker is found as a child of this launcher with torch's ``RANK`` in its
environment; its CPU % and RSS come from psutil.  Device memory per process
is not measured here (the rules abstain).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import psutil

from traceml.environment import TorchRank
from traceml.host import usable_cpus
from traceml.security import CurveKeys
from traceml.sender import BatchSender
from traceml.wire.envelope import Message
from traceml.wire.identity import Sender
from traceml.wire.rows import PROCESS_FIELDS, ProcessRows


class ProcessWatcher:
    """Samples every local worker each interval and reports it as that rank."""

    def __init__(self, endpoint: str, session_id: str, node_rank: int | None,
                 interval_s: float, keys: CurveKeys,
                 token_of: Callable[[Sender], str | None] | None = None) -> None:
        self.node_rank = node_rank
        self.host = socket.gethostname()
        self.ram_total = psutil.virtual_memory().total
        self.num_cpus = usable_cpus()
        self.workers: dict[int, tuple[psutil.Process, Sender]] = {}
        identity = Sender(role="watch", host=self.host, pid=os.getpid(),
                          node_rank=node_rank if node_rank is not None else -1)
        self.sender = BatchSender(endpoint, session_id, identity, interval_s,
                                  producers=[self.produce], keys=keys, token_of=token_of)

    def start(self) -> None:
        self.sender.start()

    def stop(self) -> None:
        self.sender.stop()

    def _discover(self) -> None:
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return
        for child in children:
            if child.pid in self.workers:
                continue
            try:
                rank = TorchRank.from_env(child.environ())
            except (psutil.Error, ValueError):  # gone, or not torch's numbers: not a worker
                continue
            if rank is None:
                continue
            child.cpu_percent(None)  # prime
            self.workers[child.pid] = (child, self._identity(child.pid, rank))

    def _identity(self, pid: int, rank: TorchRank) -> Sender:
        """The worker ``pid`` as the rank it would report itself as under ``run``."""
        node = rank.group_rank if rank.group_rank is not None else self.node_rank or 0
        return Sender(role="rank", host=self.host, pid=pid, node_rank=node, rank=rank.rank,
                      local_rank=rank.local_rank, world_size=rank.world_size,
                      restart=rank.restart_count)

    def produce(self) -> list[Message]:
        self._discover()
        for pid, (proc, who) in list(self.workers.items()):
            try:
                with proc.oneshot():
                    row = (time.time(), proc.cpu_percent(None), proc.memory_info().rss,
                           self.ram_total, self.num_cpus, None, None, None)
            except psutil.Error:
                del self.workers[pid]
                continue
            self.sender.send(ProcessRows(PROCESS_FIELDS, [row]), who)
        return []
