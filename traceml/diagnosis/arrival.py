"""Arrival skew at collectives: how late the last rank entered each step's first
collective (offline analysis).

Runs in the offline-analysis process.  A rank arrives at its step's first collective
when it launches it (`collective_at_ms` after its step's begin: for DDP, its first
gradient bucket's all-reduce).  The others wait there for the last one, so the spread
between the first and the last arrival at one step is the direct evidence for a
straggler, across nodes too: every rank's times are put on the collector's node's
clock with its node's measured offset (`traceml.clocks`), and the result carries the
offsets' uncertainty.  Not measured (None) with fewer than two ranks, without a collective timed
on every rank, or when a node of the window has no measured clock: then a spread could
be the clocks.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from traceml.clocks import NodeClock
from traceml.diagnosis.window import StepWindow
from traceml.records import column

LAST_CITED_PCT = 50.0
"""A straggler finding cites the arrivals when its rank came last at this % of the steps
or more."""


@dataclass(frozen=True)
class ArrivalSkew:
    """The last rank's arrival at each step's first collective after the first rank's,
    over the window's steps where every rank timed one."""

    median_ms: float
    worst_ms: float
    worst_step: int
    worst_rank: int  # the last to arrive at the worst step
    last_rank: int  # the rank that arrived last most often (the lowest of equals)
    last_pct: float  # ...at this % of the steps
    num_steps: int
    uncertainty_ms: float  # of each spread, from the nodes' clock offsets (0 on one node)


def arrival_skew(window: StepWindow, node_of: Mapping[int, int],
                 clocks: Mapping[int, NodeClock | None]) -> ArrivalSkew | None:
    """The window's arrival skew (see the module docstring); ``clocks``: each node's clock
    against the reference node's (`traceml.clocks.REFERENCE` for that one; None: not
    measured)."""
    ranks = sorted(r for r, rows in window.by_rank.items() if rows)
    if len(ranks) < 2:
        return None
    nodes = {node_of.get(r) for r in ranks}
    offsets: dict[int | None, float] = {}
    uncertainties = [0.0]
    if len(nodes) > 1:  # ranks on several hosts: their clocks differ
        for node in nodes:
            clock = clocks.get(node) if node is not None else None
            if clock is None:
                return None
            offsets[node] = clock.offset_ms / 1e3
            uncertainties.append(clock.uncertainty_ms)
    arrivals = []
    for r in ranks:
        rows = window.by_rank[r]
        offset = offsets.get(node_of.get(r), 0.0)
        arrivals.append([None if b is None or at is None else b + at / 1e3 - offset
                         for b, at in zip(column(rows, "t_begin"), column(rows, "collective_at_ms"))])
    spreads, lasts = [], Counter[int]()
    worst: tuple[float, int, int] | None = None
    for step, at_step in zip(window.steps, zip(*arrivals)):
        if None in at_step:
            continue
        first, last = min(at_step), max(at_step)
        rank = ranks[at_step.index(last)]
        spread = (last - first) * 1e3
        spreads.append(spread)
        lasts[rank] += 1
        if worst is None or spread > worst[0]:
            worst = (spread, step, rank)
    if worst is None:
        return None
    last_rank, num = min(lasts.items(), key=lambda kv: (-kv[1], kv[0]))
    top = sorted(uncertainties)[-2:]
    return ArrivalSkew(statistics.median(spreads), worst[0], worst[1], worst[2], last_rank,
                       100.0 * num / len(spreads), len(spreads), sum(top))


def arrival_line(skew: ArrivalSkew) -> str:
    """One sentence of the arrivals, for a finding or the card."""
    clocks = f" (clocks +/- {skew.uncertainty_ms:.2f} ms)" if skew.uncertainty_ms else ""
    return (f"r{skew.last_rank} entered the step's first collective last at "
            f"{skew.last_pct:.0f}% of {skew.num_steps} steps; the last rank came "
            f"{skew.median_ms:.1f} ms after the first (median), {skew.worst_ms:.1f} ms at "
            f"worst (step {skew.worst_step}, r{skew.worst_rank}){clocks}.")
