"""Process and system samples (wire): columnar ``fields`` + ``rows``, so that a sender
can add a field without changing the transport; a field the collector does not know is
carried but not stored."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from traceml.errors import ProtocolError
from traceml.wire.checks import BYTES, PCT, TIME, WATTS, Check, integer, number

MAX_FIELDS = 64  # fields per row (a sender may add some)
MAX_ROWS = 4096  # rows per message: a sampler sends one or a few per interval
MAX_GPUS = 1024

# A rank's process telemetry, every sample interval.
PROCESS_FIELDS: tuple[str, ...] = (
    "t", "cpu_pct", "rss_bytes", "host_ram_total_bytes", "num_cpus",
    "device_allocated_bytes", "device_reserved_bytes", "device_total_bytes",
)
# A node's system telemetry; "gpus" holds one GPU_FIELDS list per GPU of the job.
SYSTEM_FIELDS: tuple[str, ...] = ("t", "cpu_pct", "ram_pct", "ram_total_bytes", "gpus")
GPU_FIELDS: tuple[str, ...] = (
    "index", "util_pct", "mem_used_bytes", "mem_total_bytes", "temp_c", "power_w",
)

_PROCESS_CHECKS: dict[str, Check] = {
    "t": TIME, "cpu_pct": PCT, "rss_bytes": BYTES, "host_ram_total_bytes": BYTES,
    "num_cpus": integer(1, 1 << 20), "device_allocated_bytes": BYTES,
    "device_reserved_bytes": BYTES, "device_total_bytes": BYTES,
}
_GPU_CHECKS: tuple[Check, ...] = (
    integer(0, MAX_GPUS), number(0.0, 100.0), BYTES, BYTES, number(-100.0, 1000.0), WATTS)
assert set(_PROCESS_CHECKS) == set(PROCESS_FIELDS) and len(_GPU_CHECKS) == len(GPU_FIELDS)


def _gpus(v: Any) -> bool:
    return v is None or (type(v) is list and len(v) <= MAX_GPUS and all(
        type(g) is list and len(g) == len(_GPU_CHECKS)
        and all(check(x) for check, x in zip(_GPU_CHECKS, g)) for g in v))


_SYSTEM_CHECKS: dict[str, Check] = {
    "t": TIME, "cpu_pct": number(0.0, 100.0), "ram_pct": number(0.0, 100.0),
    "ram_total_bytes": BYTES, "gpus": _gpus,
}
assert set(_SYSTEM_CHECKS) == set(SYSTEM_FIELDS)
_CHECKS = {"process": _PROCESS_CHECKS, "system": _SYSTEM_CHECKS}


def _columnar(payload: dict[str, Any], kind: str) -> tuple[tuple[str, ...], list[list[Any]]]:
    """Fields and rows of a columnar payload of ``kind`` whose known fields pass its
    checks; ProtocolError when malformed."""
    fields, rows = payload.get("fields"), payload.get("rows")
    if not isinstance(fields, list) or not isinstance(rows, list):
        raise ProtocolError("payload without fields/rows")
    if len(rows) > MAX_ROWS:
        raise ProtocolError(f"more than {MAX_ROWS} rows")
    if len(fields) > MAX_FIELDS or not all(type(f) is str for f in fields):
        raise ProtocolError("fields are not distinct names")
    names = tuple(fields)
    known = _known(names, kind)
    width = len(names)
    for row in rows:
        if not isinstance(row, list) or len(row) != width:
            raise ProtocolError("row does not match fields")
        if not all(check(row[i]) for i, check in known):
            raise ProtocolError("a value of the wrong type or out of range")
    return names, rows


@functools.lru_cache(maxsize=64)
def _known(fields: tuple[str, ...], kind: str) -> tuple[tuple[int, Check], ...]:
    """The checks of the fields of a process (or system) payload that we know, by place;
    ProtocolError for fields that are not distinct or lack the time (a sample without
    it cannot be stored).  Senders send a handful of field lists: each is read once."""
    if len(set(fields)) != len(fields):
        raise ProtocolError("fields are not distinct names")
    if "t" not in fields:
        raise ProtocolError("rows without their time 't'")
    checks = _CHECKS[kind]
    return tuple((i, checks[f]) for i, f in enumerate(fields) if f in checks)


_R = TypeVar("_R", bound="Rows")


@dataclass(frozen=True)
class Rows:
    """Columnar samples: ``rows`` of ``fields`` values."""

    KIND: ClassVar[str]  # its checks: _CHECKS[KIND]

    fields: tuple[str, ...]
    rows: list[Any]

    def payload(self) -> dict[str, Any]:
        return {"fields": list(self.fields), "rows": self.rows}

    @classmethod
    def from_payload(cls: type[_R], payload: dict[str, Any]) -> _R:
        return cls(*_columnar(payload, cls.KIND))


@dataclass(frozen=True)
class ProcessRows(Rows):
    """Process samples of one rank (`PROCESS_FIELDS`, or some of them, and more)."""

    KIND: ClassVar[str] = "process"


@dataclass(frozen=True)
class SystemRows(Rows):
    """System samples of one node (`SYSTEM_FIELDS`, or some of them, and more)."""

    KIND: ClassVar[str] = "system"
