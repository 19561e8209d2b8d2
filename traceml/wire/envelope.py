"""One message on the wire: a versioned envelope around one typed message (wire).

`encode` writes an `Envelope` as orjson bytes, the version and the session id first
(the collector refuses a foreign one before parsing it); `decode` reads it back and
hands the payload to the decoder of its kind (:data:`DECODERS`, the one table of
kinds), so that what it returns is one of the closed union :data:`Message`, checked
whole.  It raises `EnvelopeError` for a malformed envelope (a kind not in the table
among them) and `PayloadError` for a payload its kind's decoder refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from traceml.errors import ProtocolError
from traceml.wire.captures import CaptureReport
from traceml.wire.checks import is_number
from traceml.wire.events import EventBatch
from traceml.wire.identity import MAX_INT, Sender, bounded, sender_from
from traceml.wire.incidents import IncidentReport
from traceml.wire.records import (
    CONTROL_KIND,
    Bye,
    Hello,
    RunEnd,
    RunStart,
    StopCollector,
    control_from_payload,
)
from traceml.wire.relay import RelayBatch
from traceml.wire.rows import ProcessRows, SystemRows

PROTOCOL_VERSION = 4  # 2: event codes follow traceml.phases; 3: hook; 4: typed messages,
# relayed steps as the step-field table's measured columns
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_TOKEN_CHARS = 64

Message = (EventBatch | ProcessRows | SystemRows | Hello | Bye | RunStart | RunEnd
           | StopCollector | IncidentReport | RelayBatch | CaptureReport)
"""Everything a message can carry."""

DECODERS: dict[str, Callable[[dict[str, Any]], Message]] = {
    EventBatch.KIND: EventBatch.from_payload,
    ProcessRows.KIND: ProcessRows.from_payload,
    SystemRows.KIND: SystemRows.from_payload,
    Hello.KIND: Hello.from_payload,
    Bye.KIND: Bye.from_payload,
    CONTROL_KIND: control_from_payload,
    IncidentReport.KIND: IncidentReport.from_payload,
    RelayBatch.KIND: RelayBatch.from_payload,
    CaptureReport.KIND: CaptureReport.from_payload,
}
"""Each kind's decoder: the payload in, the checked message out (ProtocolError,
TypeError, ValueError or KeyError: refused)."""

KINDS = frozenset(DECODERS)


class EnvelopeError(ProtocolError):
    """Not an envelope of this protocol: not JSON, another version, a field missing or
    of the wrong type, a kind no decoder reads, a sender no job has."""


class PayloadError(ProtocolError):
    """A payload its kind's decoder refuses."""

    def __init__(self, kind: str, problem: str) -> None:
        super().__init__(f"bad {kind} payload: {problem}")
        self.kind = kind


@dataclass(frozen=True)
class Envelope:
    """One message on the wire."""

    session_id: str
    sender: Sender
    seq: int  # this sender's messages before this one
    sent_at: float  # unix seconds
    message: Message
    num_sent: int = 0  # messages this sender had sent before this one
    num_dropped: int = 0  # messages this sender dropped (queue full)
    version: int = PROTOCOL_VERSION
    token: str | None = None  # proves the sender's identity (`traceml.security.TokenBook`)

    @property
    def kind(self) -> str:
        return self.message.KIND


def encode(env: Envelope) -> bytes:
    return encode_payload(env, env.kind, env.message.payload())


def encode_payload(env: Envelope, kind: str, payload: dict[str, Any]) -> bytes:
    """``env`` with another kind and payload: what a test or a fuzzer sends that no
    sender would."""
    head = {"v": env.version, "sid": env.session_id, "kind": kind,
            "from": env.sender.values(), "seq": env.seq, "at": env.sent_at,
            "ns": env.num_sent, "nd": env.num_dropped}
    if env.token is not None:
        head["tok"] = env.token
    return orjson.dumps({**head, "p": payload})


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Envelope:
    """Decode one message and check it whole (see the module docstring)."""
    return decode_parsed(parse(data, max_bytes))


def parse(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """A message parsed, not yet checked (`decode_parsed` checks it): what the collector
    reads a sender's token from before it spends time checking what it sent."""
    if len(data) > max_bytes:
        raise EnvelopeError(f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise EnvelopeError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EnvelopeError("not an envelope")
    return obj


def decode_parsed(obj: dict[str, Any]) -> Envelope:
    """A parsed message, checked whole (see the module docstring)."""
    if obj.get("v") != PROTOCOL_VERSION:
        raise EnvelopeError(f"protocol version {obj.get('v')!r}, expected {PROTOCOL_VERSION}")
    try:
        head = _head(obj)
    except (KeyError, TypeError, ValueError) as exc:
        raise EnvelopeError(f"malformed envelope: {exc!r}") from None
    kind, payload = obj.get("kind"), obj.get("p")
    read = DECODERS.get(kind) if isinstance(kind, str) else None
    if read is None:
        raise EnvelopeError(f"unknown kind {kind!r}")
    if not isinstance(payload, dict):
        raise EnvelopeError("payload is not an object")
    try:
        message = read(payload)
    except (ProtocolError, TypeError, ValueError, KeyError) as exc:
        raise PayloadError(str(kind), str(exc)) from None
    return Envelope(message=message, **head)


def _head(obj: dict[str, Any]) -> dict[str, Any]:
    """The envelope's fields around its payload, checked."""
    sid, at, token = obj["sid"], obj["at"], obj.get("tok")
    if type(sid) is not str:
        raise TypeError("session id is not a string")
    if token is not None and (type(token) is not str or not 0 < len(token) <= MAX_TOKEN_CHARS
                              or not token.isascii()):
        raise ValueError("token is not a token")
    if not is_number(at):
        raise ValueError("at is not a finite number")
    return {"session_id": sid, "sender": sender_from(obj["from"]),
            "seq": bounded(obj["seq"], 0, MAX_INT, "seq"), "sent_at": float(at),
            "num_sent": bounded(obj.get("ns", 0), 0, MAX_INT, "ns"),
            "num_dropped": bounded(obj.get("nd", 0), 0, MAX_INT, "nd"), "token": token}
