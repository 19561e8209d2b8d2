"""What the collector accepts (collector side).

Every message is checked here before anything of it is stored: its size, its
session (before it is parsed), then its envelope and its payload by
`traceml.wire.envelope.decode`, whose decoder of each kind checks shape and values
together.  What fails raises `Rejected` with a fixed reason, so the store's count of
rejections by reason stays small whatever arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from traceml.errors import ProtocolError
from traceml.wire.envelope import (
    PROTOCOL_VERSION,
    Envelope,
    PayloadError,
    decode_parsed,
    parse,
)


class Rejected(Exception):
    """A message the collector does not store; ``reason`` is one of a fixed few."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def session_prefix(session_id: str) -> bytes:
    """How every envelope of this session begins (`wire.envelope.encode` writes the
    version and the session id first): a cheap test before decoding."""
    head = orjson.dumps({"v": PROTOCOL_VERSION, "sid": session_id})
    return head[:-1] + b","


def accept(data: bytes, prefix: bytes, max_bytes: int,
           meter: Callable[[dict[str, Any], int], bool] | None = None) -> Envelope:
    """The message, checked whole; Rejected with the reason otherwise.  ``meter``: whether
    the sender the parsed message claims to be may spend its bytes, asked before anything
    but the parse is spent on it (it may refuse the message itself: Rejected)."""
    if len(data) > max_bytes:
        raise Rejected("oversized message")
    if not data.startswith(prefix):
        # Refused before decoding: a large foreign message costs no parse.
        raise Rejected("foreign session" if data.startswith(prefix[:prefix.index(b'"sid"')])
                       else "not an envelope of this protocol")
    try:
        obj = parse(data, max_bytes)
        if meter is not None and not meter(obj, len(data)):
            raise Rejected("over its sender's byte rate")
        return decode_parsed(obj)
    except PayloadError as exc:
        raise Rejected(f"bad {exc.kind} payload") from exc
    except ProtocolError:
        raise Rejected("malformed envelope") from None
