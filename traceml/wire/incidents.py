"""A stall or a crash of one rank (wire: its agent or its node's launcher reports it;
the collector places it at the rank's step and stores it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from traceml import stacks
from traceml.errors import ProtocolError
from traceml.wire.checks import TIME, escaped, is_number
from traceml.wire.identity import MAX_WORLD_SIZE

STALL, RESUMED, EXCEPTION, EXIT = "stall", "resumed", "exception", "exit"
INCIDENTS = frozenset({STALL, RESUMED, EXCEPTION, EXIT})
MAX_DETAIL_KEYS = 16
MAX_DETAIL_TEXT = 1000


@dataclass(frozen=True)
class IncidentReport:
    """A stall or a crash of one rank, as its agent or its node's launcher reports it.

    ``what``: ``stall`` (no progress since ``began_at``; ``stack`` is where the
    training thread stands), ``resumed`` (that stall ended at ``at``: steps go
    on), ``exception`` (an exception reached the top of the training thread;
    ``stack`` is its traceback) or ``exit`` (the launcher saw the rank die:
    ``detail`` has its exit code or signal).  ``rank`` and ``pid`` name the rank
    when the launcher reports for it; None when a rank reports itself."""

    KIND: ClassVar[str] = "incident"

    what: str
    began_at: float  # unix seconds
    at: float
    stack: tuple[stacks.Frame, ...] = ()
    stack_source: str | None = None  # "python" | "faulthandler"
    rank: int | None = None
    pid: int | None = None
    detail: Mapping[str, str | int | float | None] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        return {"what": self.what, "began_at": self.began_at, "at": self.at,
                "stack": stacks.to_json(self.stack), "stack_source": self.stack_source,
                "rank": self.rank, "pid": self.pid, "detail": dict(self.detail)}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> IncidentReport:
        """An incident payload, checked: its shape, its times in range, its text
        printable (it reaches the terminal); ProtocolError for anything else."""
        report = _shaped(payload)
        if not (TIME(report.began_at) and TIME(report.at)):
            raise ProtocolError("incident times out of range")
        if report.rank is not None and not 0 <= report.rank < MAX_WORLD_SIZE:
            raise ProtocolError("incident rank out of range")
        detail = {k: escaped(v) if isinstance(v, str) else v for k, v in report.detail.items()}
        stack = tuple(stacks.Frame(escaped(f.file), f.line, escaped(f.function))
                      for f in report.stack)
        return dataclasses.replace(report, detail=detail, stack=stack)


def _detail_value(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_DETAIL_TEXT
    return value is None or is_number(value)


def _shaped(payload: dict[str, Any]) -> IncidentReport:
    what = payload.get("what")
    began: Any = payload.get("began_at")
    at: Any = payload.get("at")
    rank, pid, source = payload.get("rank"), payload.get("pid"), payload.get("stack_source")
    detail = payload.get("detail", {})
    if what not in INCIDENTS or not is_number(began) or not is_number(at):
        raise ProtocolError("incident without what/began_at/at")
    if not all(v is None or type(v) is int for v in (rank, pid)):
        raise ProtocolError("incident rank/pid are not integers")
    if source not in (None, "python", "faulthandler"):
        raise ProtocolError("unknown stack source")
    if (not isinstance(detail, dict) or len(detail) > MAX_DETAIL_KEYS
            or not all(isinstance(k, str) and len(k) <= 64 and _detail_value(v)
                       for k, v in detail.items())):
        raise ProtocolError("malformed incident detail")
    try:
        stack = stacks.from_json(payload.get("stack", []))
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    return IncidentReport(str(what), float(began), float(at), stack, source, rank, pid, detail)
