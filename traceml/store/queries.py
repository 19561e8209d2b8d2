"""The bounded read's SQL helpers (shared, like `traceml.store.reader`): the spans of
each rank's attempts, time spans merged into few OR terms, and the aggregates that show
a window's step rows whole without checking them one by one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from traceml import step_fields


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


_KEY_COLUMNS = ("rank", "restart", "step")  # integers: they order and key the rows


def bounds_sql(fields: Sequence[step_fields.StepField]) -> list[str]:
    """The aggregates :meth:`StoreReader._in_range` asks of these columns."""
    parts = []
    for f in fields:
        c = f.name
        if not f.optional:
            parts.append(f"COUNT({c}) AS n_{c}")
        if f.kind is str:
            choices = ", ".join("'" + v.replace("'", "''") + "'" for v in f.choices)
            parts.append(f"SUM(typeof({c}) NOT IN ('text', 'null') OR {c} NOT IN ({choices})) "
                         f"AS bad_{c}")
            continue
        parts += [f"MIN({c}) AS lo_{c}", f"MAX({c}) AS hi_{c}"]
        if c in _KEY_COLUMNS:
            parts.append(f"SUM(typeof({c}) != 'integer') AS bad_{c}")
    return parts


def bounds_hold(fields: Sequence[step_fields.StepField], b: Mapping[str, Any]) -> bool:
    """Whether the aggregates of :func:`bounds_sql` show every row whole."""
    for f in fields:
        c = f.name
        if not f.optional and b[f"n_{c}"] != b["n"]:
            return False
        if b.get(f"bad_{c}"):
            return False
        if f.kind is not str and not all(
                b[k] is None or step_fields.admits(f, b[k]) for k in (f"lo_{c}", f"hi_{c}")):
            return False
    return True
