"""Wire messages between senders (agents, system samplers, the launcher) and
the collector: versioned envelopes encoded with orjson.

Shared by the agent, the launcher and the collector, so it imports only the
standard library and orjson.  A message carries a batch: many steps or samples
per envelope.  Payloads are columnar (``fields`` + ``rows``) so a sender can add
a field (a new phase, say) without changing the transport: the collector stores
the fields it knows and keeps the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from traceml.errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

KIND_STEPS = "steps"
KIND_EVENTS = "events"
KIND_PROCESS = "process"
KIND_SYSTEM = "system"
KIND_HELLO = "hello"
KIND_BYE = "bye"
KIND_CONTROL = "control"
KINDS = frozenset({KIND_STEPS, KIND_EVENTS, KIND_PROCESS, KIND_SYSTEM, KIND_HELLO, KIND_BYE,
                   KIND_CONTROL})

# A rank's step events (KIND_EVENTS): ``(code, value)`` pairs in the order the
# training thread logged them, the value a perf_counter time unless the code
# says otherwise.  The collector's step tracker (`traceml.collector.steps`)
# turns them into steps.  Codes 0-3: a phase begins.
INPUT, FORWARD, BACKWARD, OPTIMIZER = 0, 1, 2, 3
PHASE_NAMES = ("input", "forward", "backward", "optimizer")
# The phase-end codes are contiguous (END ... OPTIMIZER_SKIPPED): one comparison.
END = 4  # the innermost phase ends
END_UNCOUNTED = 5  # ... adding its time but not a call (a parameter-free module)
END_EXHAUSTED = 6  # a fetch found its loader empty
OPTIMIZER_END = 7  # the outermost optimizer step ends: the iteration is complete
OPTIMIZER_SKIPPED = 8  # ... a GradScaler step that skipped the update (inf grads)
NOGRAD_FORWARD = 9  # an outermost forward with grad disabled begins
MANUAL_ENTER = 10  # trace_step entered
MANUAL_EXIT = 11
# (MARK, payload): device data of the running step.  In the rank's log the
# payload holds CUDA events; on the wire it is DEVICE_MARK_FIELDS.
MARK = 12
CLOSE = 13  # process exit: the last step ends with its optimizer step
RSS = 14  # (RSS, bytes or None): host RSS of the rank; steps finished from here carry it
RESYNC = 15  # events were lost before this one: drop the open step and phases
NUM_EVENT_CODES = 16
DEVICE_MARK_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes",
                      "gpu_forward_ms", "gpu_backward_ms", "gpu_optimizer_ms")
MAX_EVENTS_PER_MESSAGE = 100_000  # ~2.5 MB of JSON, well under MAX_MESSAGE_BYTES

# Column order of a step row as the agent sends it.  Growing this tuple is
# backward compatible: the collector maps by name.
STEP_FIELDS: tuple[str, ...] = (
    "step",
    "t_begin",
    "input_ms",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "total_ms",
    "wait_ms",
    "num_input",
    "num_forward",
    "num_backward",
    "num_optimizer",
    "num_skipped",
    "rss_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "gpu_forward_ms",
    "gpu_backward_ms",
    "gpu_optimizer_ms",
)

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

    @property
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
            "from": [s.role, s.host, s.pid, s.node_rank, s.rank, s.local_rank,
                     s.world_size, s.restart],
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
    role, host, pid, node_rank, rank, local_rank, world_size, restart = obj["from"]
    kind = obj["kind"]
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    payload = obj["p"]
    if not isinstance(payload, dict):
        raise TypeError("payload is not an object")
    return Envelope(
        session_id=str(obj["sid"]),
        kind=kind,
        sender=Sender(
            role=str(role), host=str(host), pid=int(pid), node_rank=int(node_rank),
            rank=None if rank is None else int(rank),
            local_rank=None if local_rank is None else int(local_rank),
            world_size=None if world_size is None else int(world_size),
            restart=int(restart),
        ),
        seq=int(obj["seq"]),
        sent_at=float(obj["at"]),
        payload=payload,
        num_sent=int(obj.get("ns", 0)),
        num_dropped=int(obj.get("nd", 0)),
    )


def events_payload(batch: int, wall_offset_s: float,
                   events: list[tuple[int, Any]]) -> dict[str, Any]:
    """A batch of step events: ``batch`` counts this rank's event batches (a gap
    means one was lost), ``wall_offset_s`` turns its clock into epoch seconds."""
    return {"batch": batch, "wall_offset": wall_offset_s, "events": events}


def _is_number(value: Any) -> bool:
    return type(value) in (float, int)


def check_events(payload: dict[str, Any]) -> tuple[int, float, list[list[Any]]]:
    """Batch number, clock offset and events of an events payload;
    ProtocolError for anything the step tracker could not replay."""
    batch, events = payload.get("batch"), payload.get("events")
    offset: Any = payload.get("wall_offset")
    if type(batch) is not int or not _is_number(offset) or not isinstance(events, list):
        raise ProtocolError("events payload without batch/wall_offset/events")
    for event in events:
        if type(event) is not list or len(event) != 2:
            raise ProtocolError("an event is not a (code, value) pair")
        code, value = event
        if type(code) is not int or not 0 <= code < NUM_EVENT_CODES:
            raise ProtocolError(f"unknown event code {code!r}")
        if code == MARK:
            if (type(value) is not list or len(value) != len(DEVICE_MARK_FIELDS)
                    or not all(v is None or _is_number(v) for v in value)):
                raise ProtocolError("malformed device mark")
        elif not (_is_number(value) or (code == RSS and value is None)):
            raise ProtocolError(f"event {code} without a time")
    return batch, float(offset), events


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
