"""Raw wire messages for tests: an envelope around a payload dict, as a sender (or a
forger) puts it on the wire, valid or not; and event-time lists built as an agent logs
them."""

from __future__ import annotations

import time
from typing import Any

from traceml.wire.envelope import Envelope, encode_payload
from traceml.wire.events import NUM_EVENT_CODES
from traceml.wire.identity import Sender
from traceml.wire.records import Hello


def envelope_bytes(session_id: str, kind: str, sender: Sender, seq: int,
                   payload: dict[str, Any], at: float | None = None, num_sent: int = 0,
                   num_dropped: int = 0, token: str | None = None) -> bytes:
    """One message of ``kind`` carrying ``payload`` as is."""
    env = Envelope(session_id, sender, seq, time.time() if at is None else at, Hello(),
                   num_sent, num_dropped, token=token)
    return encode_payload(env, kind, payload)


def empty_times() -> list[list[float]]:
    """One empty list of event times per code."""
    return [[] for _ in range(NUM_EVENT_CODES)]
