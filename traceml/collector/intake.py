"""What the collector accepts (collector side).

Every message is checked here before anything of it is stored: its size, its
session, its envelope (`traceml.protocol` checks the sender's identity), and
its payload by the validator of its kind in :data:`VALIDATORS`, the one table
of kinds.  A new kind is one entry there (a test checks that every kind of
`protocol.KINDS` has one).  What fails raises `Rejected` with a fixed reason,
so the store's count of rejections by reason stays small whatever arrives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from traceml import protocol, stacks, step_fields
from traceml.errors import ProtocolError
from traceml.protocol import (
    GPU_FIELDS,
    PROCESS_FIELDS,
    SYSTEM_FIELDS,
    Envelope,
    RunEnd,
    RunStart,
)

MAX_FIELDS = 64  # columnar payloads: fields per row (a sender may add some)
MAX_GPUS = 1024
MAX_COMMAND_ARGS = 4096
MAX_TEXT_CHARS = 4096
MAX_WINDOW_ROWS = 10**8


class Rejected(Exception):
    """A message the collector does not store; ``reason`` is one of a fixed few."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Accepted:
    """A message that passed: its envelope and its payload as its validator returned it."""

    envelope: Envelope
    payload: Any


def session_prefix(session_id: str) -> bytes:
    """How every envelope of this session begins (`protocol.encode` writes the
    version and the session id first): a cheap test before decoding."""
    head = orjson.dumps({"v": protocol.PROTOCOL_VERSION, "sid": session_id})
    return head[:-1] + b","


def accept(data: bytes, prefix: bytes, max_bytes: int) -> Accepted:
    """The message, checked whole; Rejected with the reason otherwise."""
    if len(data) > max_bytes:
        raise Rejected("oversized message")
    if not data.startswith(prefix):
        # Refused before decoding: a large foreign message costs no parse.
        raise Rejected("foreign session" if data.startswith(prefix[:prefix.index(b'"sid"')])
                       else "not an envelope of this protocol")
    try:
        env = protocol.decode(data, max_bytes)
    except ProtocolError:
        raise Rejected("malformed envelope") from None
    validate = VALIDATORS.get(env.kind)
    if validate is None:
        raise Rejected("unknown kind")
    try:
        return Accepted(env, validate(env.payload))
    except (ProtocolError, TypeError, ValueError, KeyError) as exc:
        raise Rejected(f"bad {env.kind} payload") from exc


# -- values ---------------------------------------------------------------------------------

Check = Callable[[Any], bool]


def _number(low: float, high: float, nullable: bool = True) -> Check:
    def check(v: Any) -> bool:
        if v is None:
            return nullable
        return (type(v) is int or (type(v) is float and math.isfinite(v))) and low <= v <= high
    return check


def _integer(low: int, high: int) -> Check:
    return lambda v: v is None or (type(v) is int and low <= v <= high)


_TIME = _number(0.0, 1e11, nullable=False)  # unix seconds, before the year 5000
_PCT = _number(0.0, 1e6)  # a process's CPU % exceeds 100 on many cores
_BYTES = _integer(0, 2**62)
_WATTS = _number(0.0, 1e5)

_PROCESS_CHECKS: dict[str, Check] = {
    "t": _TIME, "cpu_pct": _PCT, "rss_bytes": _BYTES, "host_ram_total_bytes": _BYTES,
    "num_cpus": _integer(1, 1 << 20), "device_allocated_bytes": _BYTES,
    "device_reserved_bytes": _BYTES, "device_total_bytes": _BYTES,
}
_GPU_CHECKS: tuple[Check, ...] = (
    _integer(0, MAX_GPUS), _number(0.0, 100.0), _BYTES, _BYTES, _number(-100.0, 1000.0), _WATTS)
assert set(_PROCESS_CHECKS) == set(PROCESS_FIELDS) and len(_GPU_CHECKS) == len(GPU_FIELDS)


def _gpus(v: Any) -> bool:
    return v is None or (type(v) is list and len(v) <= MAX_GPUS and all(
        type(g) is list and len(g) == len(_GPU_CHECKS)
        and all(check(x) for check, x in zip(_GPU_CHECKS, g)) for g in v))


_SYSTEM_CHECKS: dict[str, Check] = {
    "t": _TIME, "cpu_pct": _number(0.0, 100.0), "ram_pct": _number(0.0, 100.0),
    "ram_total_bytes": _BYTES, "gpus": _gpus,
}
assert set(_SYSTEM_CHECKS) == set(SYSTEM_FIELDS)


def _columnar(checks: dict[str, Check]) -> Callable[[dict[str, Any]], tuple[list[str],
                                                                            list[list[Any]]]]:
    """A validator of columnar rows whose known fields pass ``checks`` (a field
    we do not know is carried but not stored)."""
    def validate(payload: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
        fields, rows = protocol.iter_rows(payload)
        raw = payload["fields"]
        if len(raw) > MAX_FIELDS or not all(type(f) is str for f in raw) \
                or len(set(raw)) != len(raw):
            raise ProtocolError("fields are not distinct names")
        known = [(i, checks[f]) for i, f in enumerate(fields) if f in checks]
        for row in rows:
            if not all(check(row[i]) for i, check in known):
                raise ProtocolError("a value of the wrong type or out of range")
        return fields, rows
    return validate


def _timestamped(payload: dict[str, Any]) -> dict[str, Any]:
    """A hello or a goodbye: its time, if it says one, is a time."""
    if "t" in payload and not _TIME(payload["t"]):
        raise ProtocolError("time is not a time")
    return payload


MAX_CLOCK_S = 1e11  # a rank's perf_counter and its offset to epoch seconds stay under it


def _events(payload: dict[str, Any]) -> protocol.EventBatch:
    batch = protocol.check_events(payload)
    if batch.batch < 0 or not -MAX_CLOCK_S <= batch.wall_offset_s <= MAX_CLOCK_S:
        raise ProtocolError("batch number or clock offset out of range")
    stamps = [t for ts in batch.times for t in ts]
    stamps += [m[0] for m in batch.marks] + [r[0] for r in batch.rss]
    stamps += [t for span in batch.spans for t in span]
    if stamps and not -MAX_CLOCK_S <= min(stamps) <= max(stamps) <= MAX_CLOCK_S:
        raise ProtocolError("event times out of range")
    return batch


# -- the launcher's records -----------------------------------------------------------------


def _escaped(text: str) -> str:
    """Text as printable characters: a control character shows as its escape."""
    if text.isprintable():
        return text[:MAX_TEXT_CHARS]
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)[:MAX_TEXT_CHARS]


def _control(payload: dict[str, Any]) -> protocol.Control:
    record = protocol.check_control(payload)
    if isinstance(record, RunStart):
        return _run_start(record)
    if isinstance(record, RunEnd) and not (
            _TIME(record.ended_at) and -(2**31) <= record.exit_code < 2**31):
        raise ProtocolError("end time or exit code out of range")
    return record


def _run_start(r: RunStart) -> RunStart:
    if (r.mode not in ("run", "watch") or not _TIME(r.started_at)
            or len(r.command) > MAX_COMMAND_ARGS
            or not 0 <= r.expected_world_size <= protocol.MAX_WORLD_SIZE
            or not 0 <= r.max_world_size <= protocol.MAX_WORLD_SIZE
            or not 1 <= r.expected_nodes <= protocol.MAX_NODES
            or not 0 <= r.summary_window_rows <= MAX_WINDOW_ROWS
            or r.count_flops not in (0, 1) or not _number(0.0, 1e9, nullable=False)(
                r.peak_tflops)):
        raise ProtocolError("run start out of range")
    return dataclasses.replace(
        r, command=tuple(_escaped(a) for a in r.command),
        traceml_version=_escaped(r.traceml_version), torch_version=_escaped(r.torch_version),
        python_version=_escaped(r.python_version))


def _incident(payload: dict[str, Any]) -> protocol.IncidentReport:
    """A stall or crash report: checked by its protocol, its times in range, its
    text printable (it reaches the terminal)."""
    report = protocol.check_incident(payload)
    if not (_TIME(report.began_at) and _TIME(report.at)):
        raise ProtocolError("incident times out of range")
    if report.rank is not None and not 0 <= report.rank < protocol.MAX_WORLD_SIZE:
        raise ProtocolError("incident rank out of range")
    detail = {k: _escaped(v) if isinstance(v, str) else v for k, v in report.detail.items()}
    stack = tuple(stacks.Frame(_escaped(f.file), f.line, _escaped(f.function))
                  for f in report.stack)
    return dataclasses.replace(report, detail=detail, stack=stack)


# -- a node's relay (`traceml.collector.relay`) ---------------------------------------------

_MEASURED = step_fields.measured()
_COLUMN_TYPES: dict[type, frozenset[type]] = {
    float: frozenset({int, float}), int: frozenset({int}), bool: frozenset({int, bool}),
    str: frozenset({str})}


def _relay(payload: dict[str, Any]) -> protocol.RelayBatch:
    """A relay's batch: its shape from `protocol.check_relay`, its values checked here
    as each kind's own validator checks them (step rows column by column: the
    relay ran the plausibility checks, node 0 checks types and ranges)."""
    batch = protocol.check_relay(payload)
    n = len(batch.senders)
    for _, state in batch.senders:
        if not (all(_TIME(t) for t in state[:2]) and state[-1] in (True, False)
                and all(type(v) is int and v >= -1 for v in state[2:-1])):
            raise ProtocolError("relayed sender state out of range")
    _step_columns(batch.step_columns, n)
    indexed = [r[0] for part in (batch.flop_counts, batch.process, batch.system) for r in part]
    if not all(type(i) is int and 0 <= i < n for i in indexed):
        raise ProtocolError("relayed record of no relayed sender")
    process, system = _columnar(_PROCESS_CHECKS), _columnar(_SYSTEM_CHECKS)
    return dataclasses.replace(
        batch, process=[[r[0], *process(r[1])] for r in batch.process],
        system=[[r[0], *system(r[1])] for r in batch.system],
        incidents=[_relayed_incident(r) for r in batch.incidents],
        clears=[_clear(r) for r in batch.clears],
        rejected={_escaped(k)[:200]: v for k, v in batch.rejected.items()})


def _step_columns(columns: list[list[Any]], num_senders: int) -> None:
    """Relayed step rows, column by column: each column's values of its type and
    within its bounds (`traceml.step_fields`), as node 0 would store them."""
    if not columns:
        return
    if len(columns) != 1 + len(_MEASURED):
        raise ProtocolError("relayed steps have other columns")
    index, *values = columns
    if set(map(type, index)) != {int} or min(index) < 0 or max(index) >= num_senders:
        raise ProtocolError("relayed step of no relayed sender")
    for f, column in zip(_MEASURED, values):
        present = [v for v in column if v is not None] if f.optional else column
        if not set(map(type, present)) <= _COLUMN_TYPES[f.kind]:
            raise ProtocolError(f"relayed step {f.name} of another type")
        if f.kind is str:
            if not all(map(f.choices.__contains__, present)):
                raise ProtocolError(f"relayed step {f.name} unknown")
        elif present and not (step_fields.admits(f, min(present))
                              and step_fields.admits(f, max(present))):
            raise ProtocolError(f"relayed step {f.name} out of range")


def _relayed_incident(record: list[Any]) -> list[Any]:
    """``[id, node_rank, cleared_at, step, phase, open_phases, incident payload]``."""
    if len(record) != 7:
        raise ProtocolError("relayed incident of another shape")
    row_id, node_rank, cleared_at, step, phase, open_phases, report = record
    if not (type(row_id) is int and row_id >= 0 and type(node_rank) is int
            and -1 <= node_rank < protocol.MAX_NODES
            and (cleared_at is None or _TIME(cleared_at))
            and (step is None or (type(step) is int and step >= 0))
            and (phase is None or isinstance(phase, str)) and isinstance(report, dict)
            and type(open_phases) is list and len(open_phases) <= 64
            and all(isinstance(p, str) for p in open_phases)):
        raise ProtocolError("relayed incident out of range")
    checked = _incident(report)
    if checked.rank is None or checked.pid is None:
        raise ProtocolError("relayed incident without its rank")
    shown = tuple(_escaped(p)[:64] for p in open_phases)
    return [row_id, node_rank, cleared_at, step, phase and _escaped(phase)[:64], shown, checked]


def _clear(record: list[Any]) -> list[Any]:
    if len(record) != 2 or type(record[0]) is not int or not _TIME(record[1]):
        raise ProtocolError("relayed stall end out of range")
    return record


VALIDATORS: dict[str, Callable[[dict[str, Any]], Any]] = {
    protocol.KIND_EVENTS: _events,
    protocol.KIND_PROCESS: _columnar(_PROCESS_CHECKS),
    protocol.KIND_SYSTEM: _columnar(_SYSTEM_CHECKS),
    protocol.KIND_HELLO: _timestamped,
    protocol.KIND_BYE: _timestamped,
    protocol.KIND_CONTROL: _control,
    protocol.KIND_INCIDENT: _incident,
    protocol.KIND_RELAY: _relay,
}
"""Each payload kind's validator: the payload in, what the collector stores
out (ProtocolError, TypeError, ValueError or KeyError: rejected)."""
