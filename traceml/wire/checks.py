"""The value checks every message kind shares (wire): a number SQLite can store and
no one's measurement is NaN, a time is a unix time, text that reaches a terminal is
printable.  A check is a predicate; a message's decode raises `ProtocolError` when one
fails."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], bool]

MAX_TEXT_CHARS = 4096
MAX_CLOCK_S = 1e11  # a rank's perf_counter and its offset to epoch seconds stay under it


def is_number(value: Any) -> bool:
    """A finite float, or an int SQLite can store (NaN and infinities are no
    one's measurement; a bool is not a number here)."""
    if type(value) is float:
        return math.isfinite(value)
    return type(value) is int and -(2**63) <= value < 2**63


def number(low: float, high: float, nullable: bool = True) -> Check:
    """A number in [low, high] (or None, when ``nullable``)."""
    def check(v: Any) -> bool:
        if v is None:
            return nullable
        return is_number(v) and low <= v <= high
    return check


def integer(low: int, high: int) -> Check:
    """An integer in [low, high], or None."""
    return lambda v: v is None or (type(v) is int and low <= v <= high)


def optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


def is_text(value: Any) -> bool:
    return isinstance(value, str)


TIME = number(0.0, 1e11, nullable=False)  # unix seconds, before the year 5000
PCT = number(0.0, 1e6)  # a process's CPU % exceeds 100 on many cores
BYTES = integer(0, 2**62)
WATTS = number(0.0, 1e5)


def escaped(text: str) -> str:
    """Text as printable characters: a control character shows as its escape."""
    if text.isprintable():
        return text[:MAX_TEXT_CHARS]
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)[:MAX_TEXT_CHARS]


def timed_values(items: Any, valid: Check) -> bool:
    """``[[time, value], ...]``, each value passing ``valid``."""
    return isinstance(items, list) and all(
        type(item) is list and len(item) == 2 and is_number(item[0]) and valid(item[1])
        for item in items)


def records(items: Any, checks: tuple[Check, ...]) -> bool:
    """``[[time, *fields], ...]``, each field passing its check."""
    return isinstance(items, list) and all(
        type(item) is list and len(item) == len(checks) + 1 and is_number(item[0])
        and all(check(v) for check, v in zip(checks, item[1:])) for item in items)


def lists(value: Any, length: int | None = None) -> bool:
    """A list of lists (each of ``length``)."""
    return isinstance(value, list) and all(
        type(item) is list and (length is None or len(item) == length) for item in value)
