"""Arrival skew at collectives: how late the last rank entered the first collective of
each step's backward (offline analysis).

Runs in the offline-analysis process.  A rank arrives at its step's first gradient
collective when it launches the first collective of its backward (`gradient_launch_ms`
after its step's begin: for DDP, its first bucket's all-reduce; not the broadcast of
BatchNorm's statistics that DDP begins each forward with, nor a metric's all-reduce in
forward, where ranks meet before the work of the step that differs).  The others wait
there for the last one, so the spread between the first and the last arrival at one
step is the direct evidence for a straggler, across nodes too: every rank's times are
put on the collector's node's clock with its node's measured offset
(`traceml.clocks`), and the result carries the offsets' uncertainty.  Not measured
(None) with fewer than two ranks, without a collective timed on every rank, or when a
node of the window has no measured clock: then a spread could be the clocks.  A step
whose collectives were in flight from before its backward without the spans that say
where backward's first began (`traceml.records.in_flight_spans`) is left out.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from traceml import phases
from traceml.clocks import NodeClock, offset_at
from traceml.diagnosis.window import StepWindow
from traceml.records import StepRow, column, in_flight_spans, ms_column

LAST_CITED_PCT = 50.0
"""A straggler finding cites the arrivals when its rank came last at this % of the steps
or more."""

MIN_STEPS = 5
"""Arrivals over fewer steps (where every rank timed a collective) are not measured."""



_BACKWARD_AT = phases.PHASES[phases.code("backward")].place_columns[0]


def gradient_launch_ms(row: StepRow) -> float | None:
    """When ``row``'s rank launched the first collective of its backward, ms after its
    step's begin: the first collective's launch when it came in backward or after, or
    backward was not placed (a store from before placements); else the first span of
    collectives in flight that began in backward; None when no collective was timed, or
    collectives were in flight from before backward and their spans were not kept."""
    at: float | None = row.value("collective_at_ms")
    backward = row.value(_BACKWARD_AT)
    if at is None or backward is None or at >= backward - 0.001:
        return at
    return next((b for b, _ in in_flight_spans(row) if b >= backward - 0.001), None)


@dataclass(frozen=True)
class ArrivalSkew:
    """The last rank's arrival at each step's first collective of backward after the
    first rank's, over the window's steps where every rank timed one."""

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
    arrivals, ends = [], []
    for rows in rows_of:
        offset = [offsets[n] for n in column(rows, "node_rank")]
        begins = column(rows, "t_begin")
        arrivals.append([None if b is None or at is None else b + at / 1e3 - o
                         for b, at, o in zip(begins, map(gradient_launch_ms, rows), offset)])
        ends.append([None if b is None else b + ms / 1e3 - o
                     for b, ms, o in zip(begins, ms_column(rows, "total"), offset)])
    slack = uncertainty / 1e3 + END_SLACK_S
    spreads, lasts = [], Counter[int]()
    worst: tuple[float, int, int | None] | None = None
    for step, at_step, end_step in zip(window.steps, zip(*arrivals), zip(*ends)):
        if None in at_step or None in end_step:
            continue
        first, last = min(at_step), max(at_step)
        if last > min(end_step) + slack:  # not one iteration's collective
            continue
        runner_up = sorted(at_step)[-2]
        spread = (last - first) * 1e3
        rank = ranks[at_step.index(last)] if (last - runner_up) * 1e3 > uncertainty else None
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
    return (f"r{skew.last_rank} entered the first collective of backward last at "
            f"{skew.last_pct:.0f}% of {skew.num_steps} steps; {spread}{clocks}.")
