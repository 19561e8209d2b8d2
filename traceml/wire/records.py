"""The launcher's control records and a sender's greetings (wire).

What runs (`RunStart`), how it ended (`RunEnd`) and the request to stop
(`StopCollector`) travel from the launcher alone (the collector takes them from the
launcher's key); `Hello` and `Bye` open and close every sender's stream.  The store's
meta table keeps a run record as the same flat JSON object (`record_to_json`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from traceml.errors import ProtocolError
from traceml.wire.checks import TIME, escaped, is_number, number
from traceml.wire.identity import MAX_NODES, MAX_WORLD_SIZE

MAX_COMMAND_ARGS = 4096
MAX_WINDOW_ROWS = 10**8
CONTROL_KIND = "control"


@dataclass(frozen=True)
class Hello:
    """A sender's first message."""

    KIND: ClassVar[str] = "hello"

    t: float | None = None  # unix seconds

    def payload(self) -> dict[str, Any]:
        return {} if self.t is None else {"t": self.t}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Hello:
        return cls(_time_of(payload))


@dataclass(frozen=True)
class Bye:
    """A sender's last message: nothing more is in flight from it."""

    KIND: ClassVar[str] = "bye"

    t: float | None = None  # unix seconds
    num_batches: int | None = None  # a rank's events messages, all told

    def payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.t is None else {"t": self.t}
        return out if self.num_batches is None else {**out, "num_batches": self.num_batches}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Bye:
        n = payload.get("num_batches")
        if n is not None and (type(n) is not int or n < 0):
            raise ProtocolError("num_batches is not a count")
        return cls(_time_of(payload), n)


def _time_of(payload: dict[str, Any]) -> float | None:
    """A greeting's time, if it says one; ProtocolError when it is not a time."""
    if "t" not in payload:
        return None
    if not TIME(payload["t"]):
        raise ProtocolError("time is not a time")
    return float(payload["t"])


@dataclass(frozen=True)
class RunStart:
    """What runs: the launcher tells its collector before the workers start."""

    KIND: ClassVar[str] = CONTROL_KIND
    OP: ClassVar[str] = "run_start"

    session_id: str
    command: tuple[str, ...]  # as typed: ``traceml run ...`` or ``python train.py ...``
    started_at: float  # unix seconds
    traceml_version: str
    torch_version: str
    python_version: str
    summary_window_rows: int
    mode: str  # "run" | "watch"
    expected_world_size: int = 0  # when every node of --nnodes (its minimum) joins; 0: unknown
    expected_nodes: int = 1
    count_flops: int = 1  # 0 with --no-flops
    peak_tflops: float = 0.0  # --peak-tflops; 0: the summary's table of accelerators
    max_world_size: int = 0  # ranks the launcher can start (--nnodes' maximum); 0: unknown

    def payload(self) -> dict[str, Any]:
        return {"op": self.OP, **record_to_json(self)}

    def checked(self) -> RunStart:
        """This record, its numbers in range and its text printable; ProtocolError else."""
        if (self.mode not in ("run", "watch") or not TIME(self.started_at)
                or len(self.command) > MAX_COMMAND_ARGS
                or not 0 <= self.expected_world_size <= MAX_WORLD_SIZE
                or not 0 <= self.max_world_size <= MAX_WORLD_SIZE
                or not 1 <= self.expected_nodes <= MAX_NODES
                or not 0 <= self.summary_window_rows <= MAX_WINDOW_ROWS
                or self.count_flops not in (0, 1)
                or not number(0.0, 1e9, nullable=False)(self.peak_tflops)):
            raise ProtocolError("run start out of range")
        return dataclasses.replace(
            self, command=tuple(escaped(a) for a in self.command),
            traceml_version=escaped(self.traceml_version),
            torch_version=escaped(self.torch_version),
            python_version=escaped(self.python_version))


@dataclass(frozen=True)
class RunEnd:
    """How the run ended: the launcher tells its collector once the training is over."""

    KIND: ClassVar[str] = CONTROL_KIND
    OP: ClassVar[str] = "run_end"

    ended_at: float  # unix seconds
    exit_code: int  # the training's, as a shell reports it
    # False: the collector died or hung before the end (the launcher's own record)
    telemetry_complete: bool = True

    def payload(self) -> dict[str, Any]:
        return {"op": self.OP, **record_to_json(self)}

    def checked(self) -> RunEnd:
        if not (TIME(self.ended_at) and -(2**31) <= self.exit_code < 2**31):
            raise ProtocolError("end time or exit code out of range")
        return self


@dataclass(frozen=True)
class StopCollector:
    """The run is over: drain what is still in flight, then exit."""

    KIND: ClassVar[str] = CONTROL_KIND
    OP: ClassVar[str] = "stop"

    def payload(self) -> dict[str, Any]:
        return {"op": self.OP}

    def checked(self) -> StopCollector:
        return self


Control = RunStart | RunEnd | StopCollector
"""What a control message carries."""


def control_from_payload(payload: dict[str, Any]) -> Control:
    """A control payload, decoded and checked; ProtocolError for anything else."""
    op = payload.get("op")
    fields = {k: v for k, v in payload.items() if k != "op"}
    if op == RunStart.OP:
        return record_from_json(RunStart, fields).checked()
    if op == RunEnd.OP:
        return record_from_json(RunEnd, fields).checked()
    if op == StopCollector.OP:
        return StopCollector()
    raise ProtocolError(f"unknown control op {op!r}")


_Record = TypeVar("_Record", RunStart, RunEnd)


def record_to_json(record: RunStart | RunEnd) -> dict[str, Any]:
    """A run record as one flat JSON object, a key per field (the store's meta table
    keeps the same keys)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def record_from_json(cls: type[_Record], obj: Mapping[str, Any]) -> _Record:
    """What :func:`record_to_json` made, checked field by field (a field with a default
    may be absent); ProtocolError when malformed."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in obj:
            values[f.name] = _field_value(str(f.type), obj[f.name], f.name)
        elif f.default is dataclasses.MISSING:
            raise ProtocolError(f"{cls.__name__} without {f.name}")
    return cls(**values)


def _field_value(kind: str, value: Any, name: str) -> Any:
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "bool" and type(value) is bool:
        return value
    if kind == "int" and type(value) is int:
        return value
    if kind == "float" and is_number(value):
        return float(value)
    if (kind == "tuple[str, ...]" and isinstance(value, (list, tuple))
            and all(isinstance(v, str) for v in value)):
        return tuple(value)
    raise ProtocolError(f"{name}: {type(value).__name__} is not a {kind}")
