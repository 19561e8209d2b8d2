"""Profiler captures on the wire: node 0's ask (collector to agents, over the control
channel) and a rank's report of what it captured (rank to collector).

An ask names the ranks that profile, the step boundary after which they start (each
rank's count of ended iterations: optimizer steps and ``trace_step`` exits, the same
count on every rank of a data-parallel job), how many steps, and the byte cap of each
trace.  A report carries the operators of the captured steps per step, the trace file
and, where the capture stopped early or failed, why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from traceml.errors import ProtocolError
from traceml.wire.checks import TIME, escaped, is_number
from traceml.wire.identity import MAX_WORLD_SIZE

ASK_OP = "capture"
MAX_CAPTURE_STEPS = 20
MAX_CAPTURE_BYTES = 2**34
MAX_OPERATORS = 64  # rows of a report: the most expensive (operator, input shapes) pairs
MAX_ID_CHARS = 64
MAX_ASK_RANKS = 16
MAX_BOUNDARY = 2**62


def is_communication(name: str) -> bool:
    """Whether a profiler event is a collective (c10d, NCCL, gloo) or traceml's DDP wait."""
    if name.startswith("aten::"):  # aten::broadcast_tensors is no collective
        return False
    low = name.lower()
    return any(m in low for m in ("c10d::", "nccl", "gloo", "allreduce", "all_reduce",
                                  "allgather", "all_gather", "reduce_scatter",
                                  "record_param_comms", "broadcast", "ddp wait"))


@dataclass(frozen=True)
class CaptureAsk:
    """Node 0 asks ``ranks`` to profile ``steps`` steps, starting once each has ended
    ``start_after`` iterations."""

    capture_id: str
    ranks: tuple[int, ...]
    start_after: int
    steps: int
    max_bytes: int

    def payload(self) -> dict[str, Any]:
        return {"op": ASK_OP, "id": self.capture_id, "ranks": list(self.ranks),
                "start_after": self.start_after, "steps": self.steps,
                "max_bytes": self.max_bytes}

    @classmethod
    def from_payload(cls, payload: Any) -> CaptureAsk:
        """An ask, checked; ProtocolError for anything else."""
        if not isinstance(payload, dict) or payload.get("op") != ASK_OP:
            raise ProtocolError("not a capture ask")
        cid: Any = payload.get("id")
        ranks: Any = payload.get("ranks")
        start: Any = payload.get("start_after")
        steps: Any = payload.get("steps")
        cap: Any = payload.get("max_bytes")
        if not (isinstance(cid, str) and 0 < len(cid) <= MAX_ID_CHARS and cid.isprintable()
                and isinstance(ranks, list) and 0 < len(ranks) <= MAX_ASK_RANKS
                and all(type(r) is int and 0 <= r < MAX_WORLD_SIZE for r in ranks)
                and type(start) is int and 0 <= start < MAX_BOUNDARY
                and type(steps) is int and 1 <= steps <= MAX_CAPTURE_STEPS
                and type(cap) is int and 1 <= cap <= MAX_CAPTURE_BYTES):
            raise ProtocolError("capture ask out of range")
        return cls(cid, tuple(ranks), start, steps, cap)


@dataclass(frozen=True)
class OperatorRow:
    """One operator with one signature of input shapes, per captured step."""

    name: str
    shapes: str  # the input shapes as torch's profiler lists them ("" when not recorded)
    calls: float  # calls per step
    self_ms: float  # host self time per step
    device_ms: float | None = None  # device (CUDA) self time per step; None: no GPU activity
    part: str = "compute"  # the part of the step it ran in (`PARTS`)

    def values(self) -> list[Any]:
        return [self.name, self.shapes, self.calls, self.self_ms, self.device_ms, self.part]


PARTS = ("compute", "input", "optimizer")
"""Where an operator ran: inside a DataLoader fetch's profiler range (input), an
optimizer's (optimizer), or elsewhere in the step (compute: forward, backward)."""


def operator_from(values: Any) -> OperatorRow:
    if not (isinstance(values, list) and len(values) == 6):
        raise ProtocolError("operator row is not 6 values")
    name, shapes, calls, self_ms, device_ms, part = values
    if not (isinstance(name, str) and isinstance(shapes, str) and part in PARTS
            and all(is_number(v) and v >= 0 for v in (calls, self_ms))
            and (device_ms is None or (is_number(device_ms) and device_ms >= 0))):
        raise ProtocolError("operator row out of range")
    return OperatorRow(escaped(name)[:200], escaped(shapes)[:400], float(calls),
                       float(self_ms), None if device_ms is None else float(device_ms), part)


@dataclass(frozen=True)
class CaptureReport:
    """What one rank captured for one ask."""

    KIND: ClassVar[str] = "capture"

    capture_id: str
    steps_asked: int
    num_steps: int  # steps profiled (fewer: cut at the byte cap, or the run ended)
    began_at: float | None = None  # unix seconds: the first profiled step began
    ended_at: float | None = None  # ...the capture's last work (the trace written) ended
    path: str | None = None  # the trace file (Chrome trace JSON, gzip), on ``host``
    trace_bytes: int = 0  # its size on disk
    cut: str | None = None  # why it stopped before the asked steps
    error: str | None = None  # why nothing was captured
    operators: tuple[OperatorRow, ...] = ()

    def payload(self) -> dict[str, Any]:
        return {"id": self.capture_id, "steps_asked": self.steps_asked,
                "num_steps": self.num_steps, "began_at": self.began_at,
                "ended_at": self.ended_at, "path": self.path, "trace_bytes": self.trace_bytes,
                "cut": self.cut, "error": self.error,
                "operators": [o.values() for o in self.operators]}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> CaptureReport:
        """A report, checked: shape, ranges, printable text; ProtocolError else."""
        cid, asked, n = payload.get("id"), payload.get("steps_asked"), payload.get("num_steps")
        began, ended = payload.get("began_at"), payload.get("ended_at")
        size, ops = payload.get("trace_bytes", 0), payload.get("operators", [])
        texts = [payload.get(k) for k in ("path", "cut", "error")]
        if not (isinstance(cid, str) and 0 < len(cid) <= MAX_ID_CHARS
                and type(asked) is int and 1 <= asked <= MAX_CAPTURE_STEPS
                and type(n) is int and 0 <= n <= asked
                and all(t is None or TIME(t) for t in (began, ended))
                and type(size) is int and 0 <= size <= 2**62
                and all(t is None or isinstance(t, str) for t in texts)
                and isinstance(ops, list) and len(ops) <= MAX_OPERATORS):
            raise ProtocolError("capture report out of range")
        path, cut, error = (None if t is None else escaped(t)[:1000] for t in texts)
        return cls(escaped(cid), asked, n, began, ended, path, size, cut, error,
                   tuple(operator_from(o) for o in ops))
