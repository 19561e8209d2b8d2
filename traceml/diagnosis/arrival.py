"""Arrival skew at collectives: how late the last rank entered each step's collectives
(offline analysis).

Runs in the offline-analysis process.  A rank arrives at a collective when it launches
it; the others wait there for the last one, so the spread between the first and the last
arrival at one step is the direct evidence for a straggler, across nodes too.  A step has
two meeting points: its first collective (`collective_at_ms` after the step's begin) and
backward's first (`gradient_at_ms`: the first launched at or after the last backward call
began, for DDP its first gradient bucket).  They differ where the step meets before
backward: DDP's broadcast of BatchNorm's statistics as forward begins (the ranks meet
there before the work that differs: the lateness shows at backward's), or a metric
all-reduced after forward as the step's first collective (a slow forward shows there,
and backward's is then even).  The window is read at the point whose median spread is
the larger (a choice per step would take the larger of two noises); a step that lacks
it on some rank is read at the other.  A step where either point's last arrival comes
after some rank's step ended is left out.  Every rank's times are put on the
collector's node's clock with its node's measured offset (`traceml.clocks`), and the
result carries the offsets' uncertainty.  Not measured
(None) with fewer than two ranks, without a collective timed on every rank, or when a
node of the window has no measured clock: then a spread could be the clocks.
"""

from __future__ import annotations

import statistics
import typing
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from traceml.clocks import NodeClock, offset_at
from traceml.diagnosis.window import StepWindow
from traceml.records import column, ms_column

LAST_CITED_PCT = 50.0
"""A straggler finding cites the arrivals when its rank came last at this % of the steps
or more."""

MIN_STEPS = 5
"""Arrivals over fewer steps (where every rank timed a collective) are not measured."""


ARRIVAL_COLUMNS = ("collective_at_ms", "gradient_at_ms")
"""The step's meeting points: its first collective's launch, and backward's first."""


@dataclass(frozen=True)
class ArrivalSkew:
    """The last rank's arrival after the first rank's at each step's collectives (at the
    meeting point whose median spread over the window is the larger: the step's first
    collective or backward's first), over the window's steps where every rank timed one."""

    median_ms: float
    worst_ms: float
    worst_step: int
    worst_rank: int | None  # the last to arrive at the worst step (None: within the clocks)
    last_rank: int | None  # the rank last most often (the lowest of equals); None: no step
    # had a last rank by more than the clocks' uncertainty
    last_pct: float  # ...last at this % of the steps
    num_steps: int
    uncertainty_ms: float  # of each arrival's difference, from the nodes' clock offsets (0
    # on one node)


def arrival_skew(window: StepWindow, clocks: Mapping[int, NodeClock | None]) -> ArrivalSkew | None:
    """The window's arrival skew (see the module docstring); ``clocks``: each node's clock
    against the reference node's (`traceml.clocks.REFERENCE` for that one; None: not
    measured).

    A rank is last at a step only when it came after the next one by more than the
    clocks' uncertainty.  A step whose last arrival comes after some rank's step ended
    is left out: that rank had left the collective, so the steps are not the same
    iteration (a rank's lost events renumbered its steps), or the clocks are wrong."""
    ranks = sorted(r for r, rows in window.by_rank.items() if rows)
    if len(ranks) < 2:
        return None
    span = window.time_span()
    middle = None if span is None else (span[0] + span[1]) / 2
    offsets: dict[int, float] = {}
    uncertainties: dict[int, float] = {}
    rows_of = [window.by_rank[r] for r in ranks]
    nodes = {n for rows in rows_of for n in column(rows, "node_rank")}
    for node in nodes:
        if len(nodes) == 1:  # one host: one clock
            offsets[node], uncertainties[node] = 0.0, 0.0
            continue
        clock = clocks.get(node)
        if clock is None or middle is None:
            return None
        offsets[node], uncertainties[node] = offset_at(clock, middle)
    uncertainty = sum(sorted(uncertainties.values())[-2:])
    points: list[list[list[float | None]]] = [[] for _ in ARRIVAL_COLUMNS]
    ends = []
    for rows in rows_of:
        offset = [offsets[n] for n in column(rows, "node_rank")]
        begins = column(rows, "t_begin")
        for arrivals, name in zip(points, ARRIVAL_COLUMNS):
            arrivals.append([None if b is None or at is None else b + at / 1e3 - o
                             for b, at, o in zip(begins, column(rows, name), offset)])
        ends.append([None if b is None else b + ms / 1e3 - o
                     for b, ms, o in zip(begins, ms_column(rows, "total"), offset)])
    slack = uncertainty / 1e3 + END_SLACK_S
    met: list[tuple[int, list[tuple[float, int | None] | None]]] = []  # (step, per point)
    by_step = zip(window.steps, zip(*ends), *(zip(*arrivals) for arrivals in points))
    for step, end_step, *at_points in by_step:
        if None in end_step:
            continue
        latest = min(end_step) + slack
        if any(None not in at and max(typing.cast(tuple[float, ...], at)) > latest
               for at in at_points):
            continue  # a rank's step had ended: not one iteration (steps renumbered)
        met.append((step, [_spread(at, uncertainty) for at in at_points]))

    def median_at(i: int) -> float:
        values = [read[0] for _, at_points in met if (read := at_points[i]) is not None]
        return statistics.median(values) if values else -1.0

    order = sorted(range(len(points)), key=lambda i: -median_at(i))  # the larger first
    spreads, lasts = [], Counter[int]()
    worst: tuple[float, int, int | None] | None = None
    for step, at_points in met:
        read = next((at_points[i] for i in order if at_points[i] is not None), None)
        if read is None:
            continue
        spread, last_index = read
        rank = None if last_index is None else ranks[last_index]
        spreads.append(spread)
        if rank is not None:
            lasts[rank] += 1
        if worst is None or spread > worst[0]:
            worst = (spread, step, rank)
    if worst is None or len(spreads) < MIN_STEPS:
        return None
    last_rank, num = (min(lasts.items(), key=lambda kv: (-kv[1], kv[0])) if lasts
                      else (None, 0))
    return ArrivalSkew(statistics.median(spreads), worst[0], worst[1], worst[2], last_rank,
                       100.0 * num / len(spreads), len(spreads), uncertainty)


END_SLACK_S = 0.001  # a step's end and the next arrival read on one clock within this


def _spread(at_step: tuple[float | None, ...], uncertainty_ms: float
            ) -> tuple[float, int | None] | None:
    """The ms from the first rank's arrival to the last's, and the last one's index when
    it came after the next by more than ``uncertainty_ms``; None when a rank has no
    arrival."""
    if None in at_step:
        return None
    times = typing.cast(tuple[float, ...], at_step)
    first, last = min(times), max(times)
    runner_up = sorted(times)[-2]
    return ((last - first) * 1e3,
            times.index(last) if (last - runner_up) * 1e3 > uncertainty_ms else None)


def cited(skew: ArrivalSkew | None, rank: int) -> bool:
    """Whether a finding about ``rank`` cites the arrivals: it came last at most steps,
    by more than the clocks' uncertainty."""
    return (skew is not None and skew.last_rank == rank and skew.last_pct >= LAST_CITED_PCT
            and skew.median_ms > skew.uncertainty_ms)


def arrival_line(skew: ArrivalSkew) -> str:
    """One sentence of the arrivals, for a finding or the card."""
    clocks = f" (clocks +/- {skew.uncertainty_ms:.2f} ms)" if skew.uncertainty_ms else ""
    spread = (f"the last rank came {skew.median_ms:.1f} ms after the first (median), "
              f"{skew.worst_ms:.1f} ms at worst (step {skew.worst_step}"
              + (f", r{skew.worst_rank})" if skew.worst_rank is not None else ")"))
    if skew.last_rank is None:
        return (f"no rank came last by more than the clocks' uncertainty over "
                f"{skew.num_steps} steps; {spread}{clocks}.")
    return (f"r{skew.last_rank} entered the step's collectives last at "
            f"{skew.last_pct:.0f}% of {skew.num_steps} steps; {spread}{clocks}.")
