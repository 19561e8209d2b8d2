"""Swimlanes: every rank's phases in two steps of the window, side by side on the
reference node's clock (the page's "Steps of every rank"; collector and offline analysis).

Two steps of the report's window are drawn: the typical one (the step whose slowest rank
took the median of the window's slowest ranks) and the slowest (its slowest rank took the
longest, when that is `SLOWER_BY` beyond the typical one).  Each lane is a rank's step
from its begin, placed against the earliest rank's begin at that step, so a rank that
began late or came last into the all-reduce shows as such, with its phases where they
ran (`traceml.report.timeline.placed_phases`: what cannot be placed is not drawn, and
the lane says how much).  Up to `MAX_LANES` ranks get a lane each; beyond, the slowest,
the fastest and the median rank at that step and as many of the ranks the Step Time
findings single out as fit, and a density band: per phase, how many of all the ranks
were in it, over the step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from traceml import phases
from traceml.diagnosis.window import StepWindow
from traceml.records import Json, RunData, StepRow, in_flight_spans, ms_column
from traceml.report.model import Report
from traceml.report.timeline import NodeClocks, placed_phases

MAX_LANES = 16
"""Ranks drawn one lane each; beyond, the chosen ones and a density band."""

SLOWER_BY = 1.05
"""The slowest step is drawn beside the typical one when its slowest rank took this many
times as long (else it is the typical step again, give or take noise)."""

DENSITY_BUCKETS = 200
"""Time buckets of the density band across the step."""


@dataclass(frozen=True)
class Lane:
    """One rank's step: when it began (ms after the earliest rank), its phases."""

    rank: int
    node_rank: int
    begin_ms: float
    total_ms: float
    phases: tuple[tuple[str, float, float], ...]  # (phase, begin, end) ms from its begin
    in_flight: tuple[tuple[float, float], ...]  # spans collectives were in flight
    not_drawn_ms: Mapping[str, float]


@dataclass(frozen=True)
class StepLanes:
    """One drawn step: why it was chosen, its lanes, and at many ranks the density band."""

    label: str  # "typical step 41", "slowest step 55"
    step: int
    span_ms: float  # from the earliest begin to the latest end
    lanes: tuple[Lane, ...]
    num_ranks: int
    density: Mapping[str, tuple[int, ...]] | None = None  # phase -> ranks in it per bucket


def build_lanes(run: RunData, report: Report, window: StepWindow) -> tuple[StepLanes, ...]:
    """The typical and the slowest step of ``window`` (one when they are the same);
    none when the window has no step, or no rank's phases were placed."""
    ranks = [r for r in window.ranks if window.by_rank[r]]
    if not ranks or not window.steps:
        return ()
    columns = [window.by_rank[r] for r in ranks]
    slowest_rank_ms = [max(at_step) for at_step in zip(*(ms_column(rows, "total")
                                                          for rows in columns))]
    if not any(rows[i].value(phases.PHASES[1].place_columns[0]) is not None
               for rows in columns for i in range(len(window.steps))):
        return ()  # a store written before phases were placed
    order = sorted(range(len(window.steps)), key=lambda i: (slowest_rank_ms[i], i))
    typical, slowest = order[(len(order) - 1) // 2], order[-1]
    # The ranks a finding singles out (not one about every rank, as INPUT-BOUND may be)
    named = [r for f in report.step_time.findings if f.severity != "info"
             and 2 * len(f.ranks) < len(ranks) + 1 for r in f.ranks]
    clocks = NodeClocks.of(run, [rows[0] for rows in columns])
    chosen = [(f"typical step {window.steps[typical]}", typical)]
    if slowest_rank_ms[slowest] > SLOWER_BY * slowest_rank_ms[typical]:
        chosen.append((f"slowest step {window.steps[slowest]}", slowest))
    return tuple(_step_lanes(label, window.steps[i], [rows[i] for rows in columns], clocks, named)
                 for label, i in chosen)


def _step_lanes(label: str, step: int, rows: Sequence[StepRow], clocks: NodeClocks,
                named: Sequence[int]) -> StepLanes:
    begins = [clocks.to_reference(r.node_rank, r.t_begin) if r.t_begin is not None else None
              for r in rows]
    known = [b for b in begins if b is not None]
    origin = min(known) if known else 0.0
    lanes = [_lane(row, 0.0 if b is None else (b - origin) * 1e3) for row, b in zip(rows, begins)]
    span = max((lane.begin_ms + lane.total_ms for lane in lanes), default=0.0)
    if len(lanes) <= MAX_LANES:
        return StepLanes(label, step, span, tuple(lanes), len(lanes))
    by_total = sorted(lanes, key=lambda lane: (lane.begin_ms + lane.total_ms, lane.rank))
    extremes = [by_total[-1].rank, by_total[0].rank, by_total[len(by_total) // 2].rank]
    present = {lane.rank for lane in lanes}
    picks = set(extremes)  # always drawn; the singled-out ranks fill the lanes left
    for rank in named:
        if len(picks) >= MAX_LANES:
            break
        if rank in present:
            picks.add(rank)
    shown = tuple(lane for lane in lanes if lane.rank in picks)
    return StepLanes(label, step, span, shown, len(lanes), _density(lanes, span))


def _lane(row: StepRow, begin_ms: float) -> Lane:
    drawn, _, missing = placed_phases(row)
    return Lane(row.rank, row.node_rank, begin_ms, row.total_ms,
                tuple((p.name, b, e) for b, e, p in drawn), in_flight_spans(row), dict(missing))


def _density(lanes: Sequence[Lane], span_ms: float) -> dict[str, tuple[int, ...]]:
    """Per phase, how many ranks were in it (their innermost drawn phase) at the middle of
    each of `DENSITY_BUCKETS` buckets across the step: difference arrays, a few additions
    per slice, so 8192 lanes cost little."""
    n = DENSITY_BUCKETS
    if span_ms <= 0:
        return {}
    width = span_ms / n
    diff = {p.name: [0] * (n + 1) for p in phases.PHASES}

    def bucket(t_ms: float) -> int:  # the first bucket whose middle is at or after t_ms
        return min(n, max(0, math.ceil(t_ms / width - 0.5)))

    for lane in lanes:
        open_: list[tuple[str, float]] = []  # (phase, end): the slices containing this one
        for name, begin, end in lane.phases:  # by begin, nested ones inside their parent
            while open_ and open_[-1][1] <= begin:
                open_.pop()
            first, stop = bucket(lane.begin_ms + begin), bucket(lane.begin_ms + end)
            diff[name][first] += 1
            diff[name][stop] -= 1
            if open_:  # the parent is not the innermost phase there
                diff[open_[-1][0]][first] -= 1
                diff[open_[-1][0]][stop] += 1
            open_.append((name, end))
    out = {}
    for name, d in diff.items():
        counts = tuple(itertools.accumulate(d[:n]))
        if any(counts):
            out[name] = counts
    return out


def lanes_to_json(lanes: Sequence[StepLanes]) -> list[Json]:
    return [{
        "label": s.label, "step": s.step, "span_ms": round(s.span_ms, 3),
        "num_ranks": s.num_ranks,
        "lanes": [{"rank": lane.rank, "node_rank": lane.node_rank,
                   "begin_ms": round(lane.begin_ms, 3), "total_ms": round(lane.total_ms, 3),
                   "phases": [[n, round(b, 3), round(e, 3)] for n, b, e in lane.phases],
                   "in_flight": [[round(b, 3), round(e, 3)] for b, e in lane.in_flight],
                   "not_drawn_ms": dict(lane.not_drawn_ms)} for lane in s.lanes],
        "density": None if s.density is None else {k: list(v) for k, v in s.density.items()},
    } for s in lanes]
