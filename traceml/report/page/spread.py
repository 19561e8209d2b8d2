"""Views of many ranks: spreads across ranks, the worst ranks, a downsampled heatmap (page model).

Runs wherever a snapshot is built (launcher, collector, offline analysis). With
more than ``WIDE_RANKS`` ranks a chart or a table row per rank is unreadable and
the page's document would grow with ranks x steps, so the views show instead:

* per phase, the median, p90 and worst across ranks of each rank's median step,
  the worst rank named, and the ``NUM_WORST`` worst ranks;
* percentile bands over steps: per step bucket, the median, p90 and max across
  ranks of each rank's bucket mean;
* the rank x step heatmap cut to at most ``HEAT_MAX_ROWS`` rank buckets x
  ``MAX_BUCKETS`` step buckets: a cell is the max over the bucket's ranks of each
  rank's mean over the bucket's steps, so one slow rank stays visible.

Everything is computed here, in Python, from the rows given (the recent or
window rows, never assumed to be the whole run), so the document stays bounded
however many ranks and steps there are.
"""

from __future__ import annotations

import base64
import functools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from traceml.diagnosis.stats import Worst, quantile
from traceml.records import Json, StepRow, column, ms_column
from traceml.report.page.series import SERIES_MEMORY, SERIES_PHASES

WIDE_RANKS = 32
"""More ranks than this: spreads and the worst ranks instead of a row or chart per rank."""

NUM_WORST = 8
"""The worst ranks named per metric."""

HEAT_MAX_ROWS = 256
MAX_BUCKETS = 256
"""Rank buckets (heatmap rows) and step buckets (heatmap columns, band points) at most."""

ABOVE, NOT_MEASURED = 254, 255
"""A heatmap cell is one byte: 0..253 from its metric's ``lo`` to ``hi``, then these two."""


def is_wide(num_ranks: int) -> bool:
    """Whether ``num_ranks`` ranks get the many-rank views."""
    return num_ranks > WIDE_RANKS


@dataclass(frozen=True)
class RankValue:
    """A rank's value of one metric (its median phase time, its rate, its newest step)."""

    rank: int
    value: float


@dataclass(frozen=True)
class Spread:
    """One metric across ranks. ``worst`` is "max" (times, memory) or "min" (rates); ``p90``
    is the value 90 % of ranks do better than (the 10th percentile when lower is worse)."""

    worst: Worst
    num_ranks: int
    median: float
    p90: float
    worst_ranks: tuple[RankValue, ...]  # the worst first, at most NUM_WORST

    @property
    def worst_value(self) -> float:
        return self.worst_ranks[0].value

    @property
    def worst_rank(self) -> int:
        return self.worst_ranks[0].rank


def spread(values: Iterable[RankValue], worst: Worst = "max",
           num_worst: int = NUM_WORST) -> Spread | None:
    """Median, p90 and the ``num_worst`` worst ranks (ties: the lower rank); None without values."""
    sign = 1.0 if worst == "max" else -1.0
    ranked = sorted(values, key=lambda v: (-sign * v.value, v.rank))
    if not ranked:
        return None
    ordered = sorted(v.value for v in ranked)
    p90 = quantile(ordered, 0.9 if worst == "max" else 0.1)
    return Spread(worst, len(ranked), quantile(ordered, 0.5), p90, tuple(ranked[:num_worst]))


def spread_to_json(s: Spread | None) -> Json:
    if s is None:
        return None
    return {"worst": s.worst, "num_ranks": s.num_ranks, "median": _round(s.median),
            "p90": _round(s.p90),
            "worst_ranks": [{"rank": v.rank, "value": _round(v.value)} for v in s.worst_ranks]}


def _round(value: float) -> float:
    return round(value, 3)


_is_value = functools.partial(operator.is_not, None)  # not None, as a C-level test


@dataclass(frozen=True)
class Grid:
    """Ranks x steps, downsampled: rank buckets (rows) x step buckets (columns)."""

    row_ranks: tuple[tuple[int, int], ...]  # per row: its first and last rank
    steps: tuple[int, ...]  # per column: its first step
    bucket_steps: int
    heat: Mapping[str, tuple[float | None, ...]]  # per metric: rows x columns, row-major
    bands: Mapping[str, tuple[tuple[float | None, ...], ...]]  # per metric: median, p90, max


def memory_metric(steps: Sequence[StepRow]) -> str | None:
    """The memory the page charts: device peak reserved, else allocated, else host RSS."""
    for name in SERIES_MEMORY:
        if any(map(_is_value, column(steps, name))):
            return name
    return None


def build_grid(steps: Sequence[StepRow], max_rows: int = HEAT_MAX_ROWS,
               max_columns: int = MAX_BUCKETS) -> Grid:
    """The heatmap and the bands of every phase (and the charted memory) over ``steps``."""
    by_rank: dict[int, list[StepRow]] = {}
    for rank, row in zip(column(steps, "rank"), steps):
        by_rank.setdefault(rank, []).append(row)
    if not by_rank:
        return Grid((), (), 1, {}, {})
    step_indexes = column(steps, "step")
    first, last = min(step_indexes), max(step_indexes)
    size = max(1, math.ceil((last - first + 1) / max_columns))
    num_columns = (last - first) // size + 1
    ranks = sorted(by_rank)
    per_row = max(1, math.ceil(len(ranks) / max_rows))
    row_ranks = tuple((ranks[i], ranks[min(i + per_row, len(ranks)) - 1])
                      for i in range(0, len(ranks), per_row))
    memory = memory_metric(steps)
    metrics = list(SERIES_PHASES) + ([memory] if memory is not None else [])
    buckets = {rank: [(step - first) // size for step in column(rows, "step")]
               for rank, rows in by_rank.items()}  # each row's column, once per rank
    heat, bands = {}, {}
    for name in metrics:
        means = [_bucket_means(buckets[rank], _values(by_rank[rank], name), num_columns)
                 for rank in ranks]
        if name in SERIES_PHASES:  # memory has its band chart only
            heat[name] = _heat(means, per_row, num_columns)
        bands[name] = _bands(means, num_columns)
    steps_x = tuple(first + i * size for i in range(num_columns))
    return Grid(row_ranks, steps_x, size, heat, bands)


def _values(rows: Sequence[StepRow], name: str) -> Sequence[float | None]:
    """The rows' values of a phase column (``*_ms``) or of a memory field."""
    if name in SERIES_PHASES:
        return ms_column(rows, name.removesuffix("_ms"))
    return column(rows, name)


def _bucket_means(buckets: Sequence[int], values: Sequence[float | None],
                  num_columns: int) -> list[float | None]:
    """One rank's mean per step bucket of its ``values`` (None: no measured step in
    it), each value in its row's bucket (``buckets``)."""
    if len(buckets) == num_columns and buckets == list(range(num_columns)):
        # a step a bucket, every step there (the live window): the mean is the value
        return [None if v is None else 0.0 + v for v in values]
    sums, counts = [0.0] * num_columns, [0] * num_columns
    for i, v in zip(buckets, values):
        if v is not None:
            sums[i] += v
            counts[i] += 1
    return [s / n if n else None for s, n in zip(sums, counts)]


def _heat(means: Sequence[Sequence[float | None]], per_row: int,
          num_columns: int) -> tuple[float | None, ...]:
    """Row-major cells: the max over each rank bucket's ranks."""
    out: list[float | None] = []
    for start in range(0, len(means), per_row):
        block = means[start:start + per_row]
        for col in range(num_columns):
            present = [m[col] for m in block if m[col] is not None]
            out.append(max(present) if present else None)  # type: ignore[type-var]
    return tuple(out)


def _bands(means: Sequence[Sequence[float | None]],
           num_columns: int) -> tuple[tuple[float | None, ...], ...]:
    """Per step bucket: median, p90 and max across ranks."""
    median, p90, top = [], [], []
    for values in (zip(*means) if means else [()] * num_columns):  # a bucket's, of each rank
        ordered = sorted(filter(_is_value, values))
        median.append(quantile(ordered, 0.5) if ordered else None)
        p90.append(quantile(ordered, 0.9) if ordered else None)
        top.append(ordered[-1] if ordered else None)
    return tuple(median), tuple(p90), tuple(top)


def grid_to_json(grid: Grid) -> dict[str, Json]:
    """Bands as rounded numbers; each heatmap as ``{lo, hi, cells}``, ``cells`` base64 bytes."""
    return {
        "row_ranks": [list(pair) for pair in grid.row_ranks],
        "steps": list(grid.steps),
        "bucket_steps": grid.bucket_steps,
        "heat": {name: _heat_json(cells) for name, cells in grid.heat.items()},
        "bands": {name: {label: [None if v is None else _rounded(name, v) for v in values]
                         for label, values in zip(("median", "p90", "max"), bands)}
                  for name, bands in grid.bands.items()},
    }


def _rounded(name: str, value: float) -> float:
    return float(int(value)) if name.endswith("_bytes") else _round(value)


def _heat_json(cells: Sequence[float | None]) -> dict[str, Json]:
    """Levels 0..253 span the cells' 2nd..98th percentile, so one slow step does not darken
    the rest; 254 is above it (a straggler's row stands out in its own colour), 255 not
    measured. When that span is empty (most cells alike), it is the cells' min..max."""
    measured = sorted(v for v in cells if v is not None)
    if not measured:
        return {"lo": 0.0, "hi": 0.0, "cells": _b64(bytes([NOT_MEASURED] * len(cells)))}
    lo, hi = quantile(measured, 0.02), quantile(measured, 0.98)
    if hi <= lo:
        lo, hi = measured[0], measured[-1]
    scale = (ABOVE - 1) / (hi - lo) if hi > lo else 0.0
    levels = bytes(NOT_MEASURED if v is None else ABOVE if v > hi
                   else max(0, round((v - lo) * scale)) for v in cells)
    return {"lo": _round(lo), "hi": _round(hi), "cells": _b64(levels)}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
