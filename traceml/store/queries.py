"""The bounded read's SQL helpers (shared, like `traceml.store.reader`): the spans of
each rank's attempts and time spans merged into few OR terms."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepSpan:
    """One attempt of a rank: its first and last stored step."""

    rank: int
    restart: int
    first: int
    last: int


SPANS_PER_QUERY = 100  # OR terms of one query (SQLite caps a compound SELECT at 500 terms)


def merged_spans(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` sorted, those that overlap made one (crashes of a job come together)."""
    out: list[tuple[float, float]] = []
    for low, high in sorted(spans):
        if out and low <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out
