"""Per-step series for the charts: phases, memory and the rank x step grid (offline analysis).

Runs wherever a page is built: the collector (dashboard) and offline analysis
(final_summary.html). Long runs are cut into buckets of consecutive step
indices, the same buckets for every rank, so the rank x step heatmap lines up:
phase times are bucket means, memory a bucket maximum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from traceml import phases
from traceml.records import Json, StepRow

SERIES_PHASES = tuple(p.column for p in (*phases.stacked(), phases.TOTAL))
"""Stacked in this order (every phase, then wait) they add up to total_ms."""

SERIES_MEMORY = ("peak_allocated_bytes", "peak_reserved_bytes", "rss_bytes")

MAX_POINTS = 600
"""Points per rank at most; more steps are averaged in buckets."""


@dataclass(frozen=True)
class RankSeries:
    """One rank's steps: x values (first step of each bucket) and one column per metric."""

    rank: int
    steps: tuple[int, ...]
    columns: Mapping[str, tuple[float | None, ...]]  # SERIES_PHASES + SERIES_MEMORY


@dataclass(frozen=True)
class Series:
    """Every rank's series, ranks ascending; ``bucket_steps`` steps per point."""

    ranks: tuple[RankSeries, ...]
    bucket_steps: int


def build_series(steps: Iterable[StepRow], max_points: int = MAX_POINTS) -> Series:
    """Series of every rank that has steps, at most ``max_points`` points per rank."""
    per_rank: dict[int, dict[int, StepRow]] = {}
    for row in steps:
        per_rank.setdefault(row.rank, {})[row.step] = row
    if not per_rank:
        return Series((), 1)
    first = min(min(rows) for rows in per_rank.values())
    last = max(max(rows) for rows in per_rank.values())
    size = max(1, math.ceil((last - first + 1) / max_points))
    ranks = tuple(_rank_series(rank, per_rank[rank], first, size) for rank in sorted(per_rank))
    return Series(ranks, size)


def _rank_series(rank: int, rows: Mapping[int, StepRow], first: int, size: int) -> RankSeries:
    if size == 1:  # every step is a point (always so live): no bucket arithmetic
        ordered = [rows[step] for step in sorted(rows)]
        columns: dict[str, tuple[float | None, ...]] = {
            name: tuple(_value(r, name) for r in ordered)
            for name in SERIES_PHASES + SERIES_MEMORY}
        return RankSeries(rank, tuple(r.step for r in ordered), columns)
    buckets: dict[int, list[StepRow]] = {}
    for step in sorted(rows):
        buckets.setdefault(first + (step - first) // size * size, []).append(rows[step])
    xs = tuple(buckets)
    columns = {}
    for name in SERIES_PHASES:
        columns[name] = tuple(_mean(r.ms(name.removesuffix("_ms")) for r in buckets[x])
                              for x in xs)
    for name in SERIES_MEMORY:
        columns[name] = tuple(_peak(getattr(r, name) for r in buckets[x]) for x in xs)
    return RankSeries(rank, xs, columns)


def _value(row: StepRow, name: str) -> float | None:
    """A series column of one step: ``<phase>_ms`` from its phases, else the field."""
    if name in SERIES_PHASES:
        return row.ms(name.removesuffix("_ms"))
    value: int | None = getattr(row, name)
    return None if value is None else float(value)


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return sum(vals) / len(vals)


def _peak(values: Iterable[int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(max(present)) if present else None


def series_to_json(series: Series) -> dict[str, Json]:
    """Column-wise JSON; times rounded to µs, bytes to whole bytes."""
    return {
        "bucket_steps": series.bucket_steps,
        "ranks": [
            {"rank": rs.rank, "step": list(rs.steps),
             **{name: _rounded(name, values) for name, values in rs.columns.items()}}
            for rs in series.ranks
        ],
    }


def _rounded(name: str, values: Sequence[float | None]) -> list[Json]:
    if name.endswith("_bytes"):
        return [None if v is None else int(v) for v in values]
    return [None if v is None else round(v, 3) for v in values]
