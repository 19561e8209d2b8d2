"""Wire messages between senders (agents, system samplers, the launcher) and
the collector: versioned envelopes encoded with orjson.

Shared by the agent, the launcher and the collector, so it imports only the
standard library, orjson and the phase table.  A message carries a batch:
a rank's step events (``events``: one list of times per event code, replayed
into steps by the collector), or many process or system samples (columnar
``fields`` + ``rows``, so a sender can add a field without changing the
transport).  The launcher's control messages carry typed records: what runs
(`RunStart`), how it ended (`RunEnd`) and the request to stop (`StopCollector`).
Each payload kind is decoded here into a typed record.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from traceml import phases, stacks
from traceml.errors import ProtocolError

PROTOCOL_VERSION = 3  # 2: event codes follow traceml.phases (communication), spans; 3: hook
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

KIND_EVENTS = "events"
KIND_PROCESS = "process"
KIND_SYSTEM = "system"
KIND_HELLO = "hello"
KIND_BYE = "bye"
KIND_CONTROL = "control"
KIND_INCIDENT = "incident"
KIND_RELAY = "relay"
KINDS = frozenset({KIND_EVENTS, KIND_PROCESS, KIND_SYSTEM, KIND_HELLO, KIND_BYE,
                   KIND_CONTROL, KIND_INCIDENT, KIND_RELAY})
ROLES = frozenset({"rank", "system", "launcher", "watch", "relay"})

# Bounds of a sender's identity: beyond them the numbers are not a job's.
MAX_WORLD_SIZE = 1 << 17
MAX_NODES = 1 << 14
MAX_RESTARTS = 1 << 20
MAX_HOST_CHARS = 255
_MAX_INT = 2**63 - 1

# A rank's step events (KIND_EVENTS), by code: the rank logs one list of
# perf_counter times per code; the collector merges them into one timeline
# (`traceml.collector.steps`).  Codes below END: that phase of
# `traceml.phases.PHASES` begins (the code is its position in the table).
INPUT, FORWARD, BACKWARD, OPTIMIZER = (phases.code(n)
                                       for n in ("input", "forward", "backward", "optimizer"))
# The phase-end codes are contiguous (END ... OPTIMIZER_SKIPPED): one comparison.
END = len(phases.PHASES)  # the innermost phase ends
END_UNCOUNTED = END + 1  # ... adding its time but not a call (a parameter-free module)
END_EXHAUSTED = END + 2  # a fetch found its loader empty
OPTIMIZER_END = END + 3  # the outermost optimizer step ends: the iteration is complete
OPTIMIZER_SKIPPED = END + 4  # ... a GradScaler step that skipped the update (inf grads)
NOGRAD_FORWARD = END + 5  # an outermost forward with grad disabled begins
MANUAL_ENTER = END + 6  # trace_step entered
MANUAL_EXIT = END + 7
MARK = END + 8  # device data of the running step (CUDA): the payload is DEVICE_MARK_FIELDS
CLOSE = END + 9  # process exit: the last step ends with its optimizer step
RSS = END + 10  # a reading of the rank's RSS (bytes or None), for the steps finished after it
SPAN = END + 11  # a collective completed: the payload is its (launch, completion) times
BATCH = END + 12  # a batch of another size began to be used: the payload is BATCH_FIELDS
FLOP_COUNT = END + 13  # a FLOP count ended in the running step: FLOP_COUNT_FIELDS
EVAL_FORWARD = END + 14  # an outermost forward with grad disabled of a module that trains begins
COPY = END + 15  # a host-to-device copy on the training thread begins (ends with END)
NUM_EVENT_CODES = END + 16
DEVICE_MARK_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes",
                      *(p.gpu_column for p in phases.gpu_timed()))
# What a batch holds (`traceml.agent.batch`), logged when it changes: samples
# (its first tensor's leading dimension), tokens (that tensor's elements when it
# holds 2-D integer token ids), the FLOPs per step known for its shape, and
# where it was seen.  None: not measured.
BATCH_FIELDS = ("samples", "tokens", "flops", "source")
BATCH_FROM_FETCH, BATCH_FROM_FORWARD = 0, 1
# One FLOP count (`traceml.agent.flops`): FLOPs of the step (None: abstained,
# see reason), the dtype most of them ran in and its share, the device name torch
# reports and its multiprocessor count, and whether the counter ran in the step.
FLOP_COUNT_FIELDS = ("flops", "dtype", "dtype_share", "device_name", "sm_count", "reason",
                     "ran")
# A rank sends its events early once this many wait: ~2 MB of JSON, well
# under MAX_MESSAGE_BYTES.
MAX_EVENTS_PER_MESSAGE = 100_000

# A rank's process telemetry, every sample interval.
PROCESS_FIELDS: tuple[str, ...] = (
    "t",
    "cpu_pct",
    "rss_bytes",
    "host_ram_total_bytes",
    "num_cpus",
    "device_allocated_bytes",
    "device_reserved_bytes",
    "device_total_bytes",
)

# A node's system telemetry; "gpus" holds one GPU_FIELDS list per GPU of the job.
SYSTEM_FIELDS: tuple[str, ...] = ("t", "cpu_pct", "ram_pct", "ram_total_bytes", "gpus")
GPU_FIELDS: tuple[str, ...] = (
    "index", "util_pct", "mem_used_bytes", "mem_total_bytes", "temp_c", "power_w",
)


@dataclass(frozen=True)
class Sender:
    """Who sent a message.  ``rank`` is None for node-level senders."""

    role: str  # "rank" | "system" | "launcher"
    host: str
    pid: int
    node_rank: int
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    restart: int = 0

    @functools.cached_property
    def sender_id(self) -> str:
        who = f"r{self.rank}" if self.rank is not None else self.role
        return f"{who}@n{self.node_rank}:{self.host}:{self.pid}:{self.restart}"


@dataclass(frozen=True)
class Envelope:
    """One message on the wire."""

    session_id: str
    kind: str
    sender: Sender
    seq: int
    sent_at: float
    payload: dict[str, Any]
    num_sent: int = 0  # messages this sender had sent before this one
    num_dropped: int = 0  # messages this sender dropped (queue full)
    version: int = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict)


def encode(env: Envelope) -> bytes:
    s = env.sender
    return orjson.dumps(
        {
            "v": env.version,
            "sid": env.session_id,
            "kind": env.kind,
            "from": sender_values(s),
            "seq": env.seq,
            "at": env.sent_at,
            "ns": env.num_sent,
            "nd": env.num_dropped,
            "p": env.payload,
        }
    )


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Envelope:
    """Decode one message; raise ProtocolError for anything malformed."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("not an envelope")
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {obj.get('v')!r}, expected {PROTOCOL_VERSION}")
    try:
        return _envelope_from(obj)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed envelope: {exc!r}") from None


def _envelope_from(obj: dict[str, Any]) -> Envelope:
    kind = obj["kind"]
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    payload = obj["p"]
    if not isinstance(payload, dict):
        raise TypeError("payload is not an object")
    sid = obj["sid"]
    if type(sid) is not str:
        raise TypeError("session id is not a string")
    return Envelope(
        session_id=sid, kind=kind, sender=_sender_from(obj["from"]),
        seq=_bounded(obj["seq"], 0, _MAX_INT, "seq"),
        sent_at=_finite_float(obj["at"], "at"), payload=payload,
        num_sent=_bounded(obj.get("ns", 0), 0, _MAX_INT, "ns"),
        num_dropped=_bounded(obj.get("nd", 0), 0, _MAX_INT, "nd"),
    )


def sender_values(s: Sender) -> list[Any]:
    """A sender identity as the wire carries it (``from`` of an envelope)."""
    return [s.role, s.host, s.pid, s.node_rank, s.rank, s.local_rank, s.world_size, s.restart]


def _sender_from(values: Any) -> Sender:
    """A sender identity, checked: exact types, and numbers a job can have."""
    if type(values) is not list or len(values) != 8:
        raise TypeError("sender identity is not a list of 8")
    role, host, pid, node_rank, rank, local_rank, world_size, restart = values
    if role not in ROLES or type(host) is not str or not 0 < len(host) <= MAX_HOST_CHARS \
            or not host.isprintable():
        raise ValueError("sender role or host is not one of ours")
    sender = Sender(
        role=role, host=host, pid=_bounded(pid, 0, 2**32, "pid"),
        node_rank=_bounded(node_rank, -1, MAX_NODES, "node_rank"),
        rank=_bounded_or_none(rank, 0, MAX_WORLD_SIZE - 1, "rank"),
        local_rank=_bounded_or_none(local_rank, 0, MAX_WORLD_SIZE - 1, "local_rank"),
        world_size=_bounded_or_none(world_size, 1, MAX_WORLD_SIZE, "world_size"),
        restart=_bounded(restart, 0, MAX_RESTARTS, "restart"),
    )
    if (sender.rank is None) != (role != "rank") or (
            sender.world_size is not None and sender.rank is not None
            and sender.rank >= sender.world_size):
        raise ValueError("rank does not fit the role or the world size")
    return sender


def _bounded(value: Any, low: int, high: int, name: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name} is not an integer in [{low}, {high}]")
    return value


def _bounded_or_none(value: Any, low: int, high: int, name: str) -> int | None:
    return None if value is None else _bounded(value, low, high, name)


def _finite_float(value: Any, name: str) -> float:
    if not _is_number(value):
        raise ValueError(f"{name} is not a finite number")
    return float(value)


def events_payload(batch: int, wall_offset_s: float, times: list[list[float]],
                   marks: list[tuple[float, Any]], rss: list[tuple[float, int | None]],
                   spans: list[tuple[float, float]] | None = None,
                   batches: list[tuple[Any, ...]] | None = None,
                   flop_counts: list[tuple[Any, ...]] | None = None) -> dict[str, Any]:
    """A batch of step events: ``times[code]`` lists that code's event times;
    ``marks`` are ``(time, DEVICE_MARK_FIELDS)``, ``rss`` ``(time, bytes)`` and
    ``spans`` the collectives' ``(launch, completion)`` times; ``batches`` are
    ``(time, *BATCH_FIELDS)`` and ``flop_counts`` ``(time, *FLOP_COUNT_FIELDS)``.
    ``batch`` counts this rank's event batches (a gap means one was lost);
    ``wall_offset_s`` turns its clock into epoch seconds."""
    return {"batch": batch, "wall_offset": wall_offset_s, "times": times, "marks": marks,
            "rss": rss, "spans": spans or [], "batches": batches or [],
            "flops": flop_counts or []}


def _is_number(value: Any) -> bool:
    """A finite float, or an int SQLite can store (NaN and infinities are no
    one's measurement)."""
    if type(value) is float:
        return math.isfinite(value)
    return type(value) is int and -(2**63) <= value < 2**63


def _timed_values(items: Any, valid: Callable[[Any], bool]) -> bool:
    return isinstance(items, list) and all(
        type(item) is list and len(item) == 2 and _is_number(item[0]) and valid(item[1])
        for item in items)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


_BATCH_CHECKS = (_optional(_is_number), _optional(_is_number), _optional(_is_number),
                 lambda v: v in (BATCH_FROM_FETCH, BATCH_FROM_FORWARD))
_FLOP_COUNT_CHECKS = (_optional(_is_number), _optional(lambda v: isinstance(v, str)),
                      _optional(_is_number), _optional(lambda v: isinstance(v, str)),
                      _optional(_is_number), _optional(lambda v: isinstance(v, str)),
                      lambda v: type(v) is bool)


def _records(items: Any, checks: tuple[Callable[[Any], bool], ...]) -> bool:
    """``[time, *fields]`` records, each field passing its check."""
    return isinstance(items, list) and all(
        type(item) is list and len(item) == len(checks) + 1 and _is_number(item[0])
        and all(check(v) for check, v in zip(checks, item[1:])) for item in items)


def _device_mark(values: Any) -> bool:
    return (type(values) is list and len(values) == len(DEVICE_MARK_FIELDS)
            and all(v is None or _is_number(v) for v in values))


@dataclass(frozen=True)
class EventBatch:
    """A decoded events payload (see :func:`events_payload`)."""

    batch: int
    wall_offset_s: float
    times: list[list[float]]
    marks: list[list[Any]]  # [time, DEVICE_MARK_FIELDS values]
    rss: list[list[Any]]  # [time, bytes or None]
    spans: list[list[float]]  # [launch, completion] of each collective
    batches: list[list[Any]] = field(default_factory=list)  # [time, *BATCH_FIELDS]
    flop_counts: list[list[Any]] = field(default_factory=list)  # [time, *FLOP_COUNT_FIELDS]


def check_events(payload: dict[str, Any]) -> EventBatch:
    """An events payload, checked; ProtocolError for anything the step tracker
    could not replay."""
    batch: Any = payload.get("batch")
    offset: Any = payload.get("wall_offset")
    times: Any = payload.get("times")
    marks: Any = payload.get("marks")
    rss: Any = payload.get("rss")
    spans: Any = payload.get("spans", [])
    batches: Any = payload.get("batches", [])
    flop_counts: Any = payload.get("flops", [])
    if type(batch) is not int or not _is_number(offset):
        raise ProtocolError("events payload without batch/wall_offset")
    if (not isinstance(times, list) or len(times) > NUM_EVENT_CODES
            or not all(isinstance(ts, list) and all(map(_is_number, ts)) for ts in times)):
        raise ProtocolError("event times are not lists of numbers per code")
    if any(times[code] for code in (MARK, RSS, SPAN, BATCH, FLOP_COUNT) if code < len(times)):
        raise ProtocolError("marks, RSS readings, spans, batches and FLOP counts travel with "
                            "their values")
    if not _timed_values(marks, _device_mark):
        raise ProtocolError("malformed device marks")
    if not _timed_values(rss, lambda v: v is None or _is_number(v)):
        raise ProtocolError("malformed RSS readings")
    if not _timed_values(spans, _is_number) or any(s[1] < s[0] for s in spans):
        raise ProtocolError("malformed collective spans")
    if not _records(batches, _BATCH_CHECKS) or not _records(flop_counts, _FLOP_COUNT_CHECKS):
        raise ProtocolError("malformed batch sizes or FLOP counts")
    return EventBatch(batch, float(offset), times, marks, rss, spans, batches, flop_counts)


# -- a node's relay to node 0's collector (KIND_RELAY) -------------------------------------
# One message per relay flush: the states of the node's senders (an identity and
# RELAY_STATE_FIELDS each), their steps (columnar: the sender's index in
# ``senders``, then one list per step column of the store), FLOP counts
# ``[index, time, *FLOP_COUNT_FIELDS]``, process and system samples
# ``[index, columnar payload]``, incidents the relay placed at the rank's step
# (``[id, node_rank, cleared_at, step, phase, open_phases, incident payload]``),
# stalls that cleared (``[id, at]``) and the relay's rejections by reason.

RELAY_STATE_FIELDS = ("first_seen", "last_seen", "num_messages", "num_gaps", "last_seq",
                      "num_sent", "num_dropped", "said_bye")
MAX_RELAYED_SENDERS = 4096
MAX_REJECT_REASONS = 64


@dataclass(frozen=True)
class RelayBatch:
    """A decoded relay payload; its values are checked by the collector's intake."""

    senders: list[tuple[Sender, list[Any]]]  # identity, RELAY_STATE_FIELDS values
    step_columns: list[list[Any]]  # [sender index, *one list per step column], or []
    flop_counts: list[list[Any]]
    process: list[list[Any]]
    system: list[list[Any]]
    incidents: list[list[Any]]
    clears: list[list[Any]]
    rejected: dict[str, int]


def relay_payload(batch: RelayBatch) -> dict[str, Any]:
    return {"senders": [[*sender_values(s), *state] for s, state in batch.senders],
            "steps": batch.step_columns, "flops": batch.flop_counts, "process": batch.process,
            "system": batch.system, "incidents": batch.incidents, "clears": batch.clears,
            "rejected": batch.rejected}


def _lists(value: Any, length: int | None = None) -> bool:
    return isinstance(value, list) and all(
        type(item) is list and (length is None or len(item) == length) for item in value)


def check_relay(payload: dict[str, Any]) -> RelayBatch:
    """A relay payload's shape, checked; ProtocolError for anything else."""
    senders: Any = payload.get("senders")
    steps: Any = payload.get("steps")
    rejected: Any = payload.get("rejected")
    parts: list[Any] = [payload.get(k) for k in ("flops", "process", "system", "incidents",
                                                 "clears")]
    if not _lists(senders, 8 + len(RELAY_STATE_FIELDS)) or len(senders) > MAX_RELAYED_SENDERS:
        raise ProtocolError("relayed senders are not identities with their states")
    if not _lists(steps) or (steps and len({len(c) for c in steps}) != 1):
        raise ProtocolError("relayed steps are not columns of one length")
    if not all(_lists(p) for p in parts):
        raise ProtocolError("relayed records are not lists")
    flops, process, system, incidents, clears = parts
    if (not all(len(r) == 2 and isinstance(r[1], dict) for r in [*process, *system])
            or not all(flops) or not _records([r[1:] for r in flops], _FLOP_COUNT_CHECKS)):
        raise ProtocolError("relayed records are not lists of their shape")
    if (not isinstance(rejected, dict) or len(rejected) > MAX_REJECT_REASONS
            or not all(type(n) is int and n >= 0 and len(k) <= 200 for k, n in rejected.items())):
        raise ProtocolError("relayed rejections are not counts by reason")
    try:
        identities = [(_sender_from(s[:8]), s[8:]) for s in senders]
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"relayed sender: {exc}") from None
    return RelayBatch(identities, steps, flops, process, system, incidents, clears, rejected)


def rows_payload(fields: tuple[str, ...], rows: list[tuple[Any, ...]]) -> dict[str, Any]:
    """A columnar batch payload."""
    return {"fields": list(fields), "rows": rows}


def iter_rows(payload: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Fields and rows of a columnar payload; ProtocolError when malformed."""
    fields = payload.get("fields")
    rows = payload.get("rows")
    if not isinstance(fields, list) or not isinstance(rows, list):
        raise ProtocolError("payload without fields/rows")
    for row in rows:
        if not isinstance(row, list) or len(row) != len(fields):
            raise ProtocolError("row does not match fields")
    return [str(f) for f in fields], rows


# -- stalls and crashes (KIND_INCIDENT) ----------------------------------------------------

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

    what: str
    began_at: float  # unix seconds
    at: float
    stack: tuple[stacks.Frame, ...] = ()
    stack_source: str | None = None  # "python" | "faulthandler"
    rank: int | None = None
    pid: int | None = None
    detail: Mapping[str, str | int | float | None] = field(default_factory=dict)


def incident_payload(report: IncidentReport) -> dict[str, Any]:
    return {"what": report.what, "began_at": report.began_at, "at": report.at,
            "stack": stacks.to_json(report.stack), "stack_source": report.stack_source,
            "rank": report.rank, "pid": report.pid, "detail": dict(report.detail)}


def _detail_value(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_DETAIL_TEXT
    return value is None or _finite(value)


def _finite(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


def check_incident(payload: dict[str, Any]) -> IncidentReport:
    """An incident payload, checked; ProtocolError for anything else."""
    what = payload.get("what")
    began: Any = payload.get("began_at")
    at: Any = payload.get("at")
    rank, pid, source = payload.get("rank"), payload.get("pid"), payload.get("stack_source")
    detail = payload.get("detail", {})
    if what not in INCIDENTS or not _finite(began) or not _finite(at):
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
    return IncidentReport(what, float(began), float(at), stack, source, rank, pid, detail)


# -- the launcher's control messages (KIND_CONTROL) --------------------------------------


@dataclass(frozen=True)
class RunStart:
    """What runs: the launcher tells its collector before the workers start."""

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


@dataclass(frozen=True)
class RunEnd:
    """How the run ended: the launcher tells its collector once the training is over."""

    ended_at: float  # unix seconds
    exit_code: int  # the training's, as a shell reports it
    # False: the collector died or hung before the end (the launcher's own record)
    telemetry_complete: bool = True


@dataclass(frozen=True)
class StopCollector:
    """The run is over: drain what is still in flight, then exit."""


Control = RunStart | RunEnd | StopCollector
"""What a control message carries."""

OP_RUN_START, OP_RUN_END, OP_STOP = "run_start", "run_end", "stop"

_Record = TypeVar("_Record", RunStart, RunEnd)


def control_payload(record: Control) -> dict[str, Any]:
    """The payload of a control message carrying ``record``."""
    if isinstance(record, RunStart):
        return {"op": OP_RUN_START, **record_to_json(record)}
    if isinstance(record, RunEnd):
        return {"op": OP_RUN_END, **record_to_json(record)}
    return {"op": OP_STOP}


def check_control(payload: dict[str, Any]) -> Control:
    """A control payload, decoded; ProtocolError for anything else."""
    op = payload.get("op")
    fields = {k: v for k, v in payload.items() if k != "op"}
    if op == OP_RUN_START:
        return record_from_json(RunStart, fields)
    if op == OP_RUN_END:
        return record_from_json(RunEnd, fields)
    if op == OP_STOP:
        return StopCollector()
    raise ProtocolError(f"unknown control op {op!r}")


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
    if kind == "float" and _is_number(value):
        return float(value)
    if (kind == "tuple[str, ...]" and isinstance(value, (list, tuple))
            and all(isinstance(v, str) for v in value)):
        return tuple(value)
    raise ProtocolError(f"{name}: {type(value).__name__} is not a {kind}")
