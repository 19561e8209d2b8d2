"""One system sampler per node, run by that node's launcher (launcher side).

Host CPU % and RAM % from psutil; for the GPUs this job uses (honouring
CUDA_VISIBLE_DEVICES) utilisation, memory, temperature and power from NVML.
No GPU or no NVML: the GPU list is empty, and the rules abstain.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import psutil

from traceml.environment import TorchRank
from traceml.security import CurveKeys
from traceml.sender import BatchSender, Producer
from traceml.wire.envelope import Message
from traceml.wire.identity import Sender
from traceml.wire.records import Bye
from traceml.wire.rows import SYSTEM_FIELDS, SystemRows


def visible_gpu_indices(count: int, visible: str | None) -> list[int]:
    """NVML indices of the GPUs this job may use (CUDA_VISIBLE_DEVICES as ints)."""
    if visible is None:
        return list(range(count))
    indices = []
    for item in visible.split(","):
        item = item.strip()
        if not item.isdigit():
            break  # UUIDs or garbage: CUDA stops at the first it cannot parse
        if int(item) < count:
            indices.append(int(item))
    return indices


class Nvml:
    """The GPUs of this job through pynvml; empty when NVML is unavailable."""

    def __init__(self) -> None:
        self.handles: list[tuple[int, Any]] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            wanted = visible_gpu_indices(count, os.environ.get("CUDA_VISIBLE_DEVICES"))
            self.nvml: Any = pynvml
            self.handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in wanted]
        except Exception:  # no driver, no library: not measured
            self.handles = []

    def sample(self) -> list[list[Any]]:
        rows = []
        for index, handle in self.handles:
            rows.append([index, self._call("nvmlDeviceGetUtilizationRates", handle, "gpu"),
                         self._call("nvmlDeviceGetMemoryInfo", handle, "used"),
                         self._call("nvmlDeviceGetMemoryInfo", handle, "total"),
                         self._call("nvmlDeviceGetTemperature", handle, None, 0),
                         self._power_w(handle)])
        return rows

    def _call(self, name: str, handle: Any, attr: str | None, *args: Any) -> Any:
        try:
            value = getattr(self.nvml, name)(handle, *args)
        except Exception:
            return None
        return getattr(value, attr) if attr else value

    def _power_w(self, handle: Any) -> float | None:
        milliwatts = self._call("nvmlDeviceGetPowerUsage", handle, None)
        return None if milliwatts is None else milliwatts / 1000.0


def workers_node_rank() -> int | None:
    """This node's rank as torch's rendezvous assigned it (GROUP_RANK of a worker)."""
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return None
    for child in children:
        try:
            rank = TorchRank.from_env(child.environ())
        except (psutil.Error, ValueError):  # gone, or not torch's numbers: not a worker
            continue
        if rank is not None and rank.group_rank is not None:
            return rank.group_rank
    return None


class SystemSampler:
    """Samples the node and sends through a BatchSender thread.

    ``node_rank=None`` (c10d: join order decides) sends nothing but its hello
    until this node's workers exist and say which node rank they got.
    """

    def __init__(self, endpoint: str, session_id: str, node_rank: int | None,
                 interval_s: float, keys: CurveKeys,
                 extra: list[Producer] | None = None,
                 token_of: Callable[[Sender], str | None] | None = None) -> None:
        self.nvml = Nvml()
        psutil.cpu_percent(None)  # prime: the first call has no interval
        self.node_rank = node_rank
        identity = Sender(role="system", host=socket.gethostname(), pid=os.getpid(),
                          node_rank=-1 if node_rank is None else node_rank)
        extra = extra or []  # more of this node's messages (stacks, crash records)
        self.sender = BatchSender(endpoint, session_id, identity, interval_s,
                                  producers=[self.produce, *extra],
                                  final_producers=[self.produce, *extra, self._bye],
                                  keys=keys, token_of=token_of)

    def produce(self) -> list[Message]:
        if self.node_rank is None:
            self.node_rank = workers_node_rank()
            if self.node_rank is None:
                return []
            self.sender.identity = replace(self.sender.identity, node_rank=self.node_rank)
        mem = psutil.virtual_memory()
        row = (time.time(), psutil.cpu_percent(None), mem.percent, mem.total, self.nvml.sample())
        return [SystemRows(SYSTEM_FIELDS, [row])]

    def _bye(self) -> list[Message]:
        if self.node_rank is None:
            return []
        return [Bye(time.time())]

    def start(self) -> None:
        self.sender.start()

    def stop(self) -> None:
        self.sender.stop()
