"""A Snapshot: the report model plus what a view draws besides it (live views, page).

Runs in the launcher (``--mode=cli``), the collector (``--mode=dashboard``) and
offline analysis (final_summary.html). Every view renders the same
:class:`~traceml.report.model.Report`: live, it is built over the last
``LIVE_WINDOW_STEPS`` aligned steps of the recent rows; at the end, it is the
final summary's report. The snapshot adds a per-rank phase table (median and
worst step of the report's window), gauges and the chart series; with more
than ``WIDE_RANKS`` ranks, spreads across ranks and a downsampled grid instead
of a chart per rank (:mod:`~traceml.report.page.spread`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from traceml import phases
from traceml.diagnosis.stats import stands_out
from traceml.diagnosis.throughput import RankThroughput
from traceml.diagnosis.window import StepWindow, capture_spans, select_window
from traceml.records import Json, RunData, ms_column, rank_totals
from traceml.report.build import build_report, rank_nodes, step_time_alone
from traceml.report.json_codec import report_to_json
from traceml.report.model import SECTION_NAMES, Report, Section
from traceml.report.page.gauges import GaugeRow, gauges_to_json, node_gauges, process_gauges
from traceml.report.page.lanes import StepLanes, build_lanes, lanes_to_json
from traceml.report.page.series import MAX_POINTS, Series, build_series, series_to_json
from traceml.report.page.spread import (
    Grid,
    RankValue,
    Spread,
    build_grid,
    grid_to_json,
    is_wide,
    spread,
    spread_to_json,
)
from traceml.report.text import THROUGHPUT_UNITS
from traceml.store import paused_gc

LIVE_WINDOW_STEPS = 100
"""Aligned steps per rank the live diagnosis and phase table look at..."""

LIVE_WINDOW_ROWS = 25_600
MIN_LIVE_WINDOW_STEPS = 20
"""...fewer beyond 256 ranks: about LIVE_WINDOW_ROWS rows in all, at least
MIN_LIVE_WINDOW_STEPS a rank, so a live refresh at thousands of ranks stays bounded."""


def live_window_steps(num_ranks: int) -> int:
    """Steps per rank of the live window with ``num_ranks`` ranks."""
    return max(MIN_LIVE_WINDOW_STEPS, min(LIVE_WINDOW_STEPS, LIVE_WINDOW_ROWS // max(1, num_ranks)))

TABLE_PARTS = (*phases.stacked(), phases.TOTAL)
TABLE_PHASES = tuple(p.column for p in TABLE_PARTS)
"""The phase table's columns: every phase, wait, total."""

SNAPSHOT_FORMAT = "traceml.snapshot/3"
"""2: ``wide`` (spreads and a downsampled grid at many ranks); 3: ``lanes`` (swimlanes)."""


@dataclass(frozen=True)
class RankPhases:
    """One rank's row of the phase table: median and worst step of the window, per phase."""

    rank: int
    node_rank: int | None
    last_step: int | None  # newest step stored, inside the window or not
    num_steps: int  # window steps
    median_ms: Mapping[str, float]  # empty when the rank has no window step
    worst_ms: Mapping[str, float]


@dataclass(frozen=True)
class WideView:
    """What replaces the per-rank rows and charts at many ranks."""

    phases: Mapping[str, Spread]  # TABLE_PHASES -> the ranks' window medians
    last_step: Spread | None  # the newest step of each rank; the worst is the furthest behind
    throughput: Mapping[str, Spread]  # THROUGHPUT_UNITS keys -> per-rank rates (lowest worst)
    grid: Grid


@dataclass(frozen=True)
class Snapshot:
    """What every view shows at one moment."""

    report: Report
    elapsed_s: float
    ended: bool
    phases: tuple[RankPhases, ...]
    worst_ranks: Mapping[str, int]  # phase -> the rank with clearly the highest median
    blamed: Mapping[int, Mapping[str, str]]  # rank -> phase column -> the finding's label
    nodes: tuple[GaugeRow, ...]
    processes: tuple[GaugeRow, ...]
    series: Series  # empty at many ranks: ``wide`` has the bands and the heatmap
    wide: WideView | None = None  # more than WIDE_RANKS ranks
    lanes: tuple[StepLanes, ...] = ()  # the typical and the slowest step, every rank's phases


def live_snapshot(run: RunData, window_rows: int, now: float | None = None) -> Snapshot:
    """The snapshot of a running job from its recent rows."""
    with paused_gc():
        return build_snapshot(run, live_report(run, window_rows), ended=False, now=now)


def live_report(run: RunData, window_rows: int) -> Report:
    """The report of a running job over the live window of its recent rows."""
    with paused_gc():  # it makes as many objects as the rows (see `paused_gc`)
        return build_report(run, _live_rows(run, window_rows))


def live_step_time(run: RunData, window_rows: int) -> Section:
    """Step Time of a running job over the live window (`live_report`'s, less the advice
    fitted to the other sections)."""
    with paused_gc():
        return step_time_alone(run, _live_rows(run, window_rows))


def _live_rows(run: RunData, window_rows: int) -> int:
    """The live window: the run's own, shortened for many ranks."""
    return min(window_rows, live_window_steps(len({row.rank for row in run.steps})))


def build_snapshot(run: RunData, report: Report, *, ended: bool, now: float | None = None,
                   max_points: int = MAX_POINTS) -> Snapshot:
    """A snapshot of ``run`` around ``report`` (which was built from ``run``)."""
    window = report_window(run, report)
    phases = phase_rows(run, report, window)
    if ended:
        elapsed = report.duration_s
    else:
        elapsed = max(0.0, (time.time() if now is None else now) - run.meta.started_at)
    wide = wide_view(run, report, phases) if is_wide(len(phases)) else None
    series = Series((), wide.grid.bucket_steps) if wide else build_series(run.steps, max_points)
    return Snapshot(report, elapsed, ended, phases, worst_ranks(phases),
                    blamed_cells(report, phases), node_gauges(report), process_gauges(report),
                    series, wide, build_lanes(run, report, window))


def wide_view(run: RunData, report: Report, phases: tuple[RankPhases, ...]) -> WideView:
    """Spreads across ranks of the phase table and the throughput, and the grid of ``run.steps``."""
    per_phase = {p: spread(RankValue(r.rank, r.median_ms[p]) for r in phases if p in r.median_ms)
                 for p in TABLE_PHASES}
    last = spread((RankValue(r.rank, r.last_step) for r in phases if r.last_step is not None),
                  worst="min")
    rows = [r for r in report.throughput.ranks if isinstance(r, RankThroughput)]
    rates = {key: spread((RankValue(r.rank, v) for r in rows if (v := getattr(r, key)) is not None),
                         worst="min")
             for key, _ in THROUGHPUT_UNITS}
    return WideView({p: s for p, s in per_phase.items() if s is not None}, last,
                    {k: s for k, s in rates.items() if s is not None}, build_grid(run.steps))


def report_window(run: RunData, report: Report) -> StepWindow:
    """The aligned steps the report's Step Time section read."""
    return select_window(run.steps, report.step_time.scope.window_rows, run.meta.world_size,
                         capture_spans(run.captures))


def phase_rows(run: RunData, report: Report, window: StepWindow | None = None
               ) -> tuple[RankPhases, ...]:
    """Per rank: median and worst of each phase over the report's step window."""
    if window is None:
        window = report_window(run, report)
    # The newest step of each rank: a summary's read holds only its window's rows.
    last = {rank: t.last_step for rank, t in rank_totals(run).items()}
    node_of = rank_nodes(run)
    out = []
    for rank in sorted(set(last) | set(window.by_rank)):
        rows = window.by_rank.get(rank, ())
        values = {p: ms_column(rows, p.removesuffix("_ms")) for p in TABLE_PHASES}
        out.append(RankPhases(
            rank, node_of.get(rank), last.get(rank), len(rows),
            {p: statistics.median(v) for p, v in values.items() if v},
            {p: max(v) for p, v in values.items() if v}))
    return tuple(out)


def worst_ranks(phases: tuple[RankPhases, ...]) -> dict[str, int]:
    """Per phase, the rank whose median is highest (ties: the lowest rank), when it stands
    out from the median rank's (`traceml.diagnosis.stats.stands_out`, the card's rule)."""
    out = {}
    for phase in TABLE_PHASES:
        measured = [(row.median_ms[phase], -row.rank) for row in phases if phase in row.median_ms]
        if not measured:
            continue
        top, rank = max(measured)
        if len(measured) == 1 or stands_out(top, statistics.median(v for v, _ in measured)):
            out[phase] = -rank
    return out


_COMPUTE_COLUMNS = tuple(p.column for p in phases.PHASES if p.compute)
BLAMED_COLUMNS: Mapping[str, tuple[str, ...]] = {
    "INPUT_STRAGGLER": ("input_ms",), "INPUT_BOUND": ("input_ms",),
    "HOST_STRAGGLER": (phases.WAIT.column,), "WAIT_HEAVY": (phases.WAIT.column,),
    "COMPUTE_STRAGGLER": _COMPUTE_COLUMNS, "STRAGGLER": (phases.TOTAL.column,),
    "COMMUNICATION_BOUND": ("communication_ms",),
}
"""The phase-table columns each Step Time finding that names ranks is about."""


def blamed_cells(report: Report, rows: tuple[RankPhases, ...]) -> dict[int, dict[str, str]]:
    """The cells the Step Time findings put on a rank (warn or crit, naming it): the
    phase table highlights these, not merely each column's highest value, which at a
    straggler is often the rank that waits for it.  A COMPUTE STRAGGLER's cells are
    its compute phases where it is the slowest rank (all of them if none is)."""
    slowest = worst_ranks(rows)
    out: dict[int, dict[str, str]] = {}
    for finding in report.section("step_time").findings:
        if finding.severity == "info" or finding.kind not in BLAMED_COLUMNS:
            continue
        for rank in finding.ranks:
            columns = BLAMED_COLUMNS[finding.kind]
            if finding.kind == "COMPUTE_STRAGGLER":
                columns = tuple(c for c in columns if slowest.get(c) == rank) or columns
            cells = out.setdefault(rank, {})
            for column in columns:
                cells.setdefault(column, finding.label)
    return out


def snapshot_to_json(snap: Snapshot, live: bool) -> dict[str, Json]:
    """The document the page renders; ``summary`` has final_summary.json's shape (and, up
    to ``WIDE_RANKS`` ranks, its contents).

    At many ranks (``wide`` is not null) the document stays bounded: ``phases`` and the
    series' ``ranks`` are empty, and so is each summary section's ``ranks``; the ending
    keeps the incidents of the ranks its findings name (a job-wide stall at 8192 ranks
    is 8192 incidents, ~6 MB).  The per-rank rows and every incident stay in
    final_summary.json."""
    report = snap.report
    if snap.wide is not None:  # the rows are left out before encoding: that is the costly part
        no_rows: dict[str, Any] = {name: dataclasses.replace(report.section(name), ranks=())
                                   for name in SECTION_NAMES}
        named = {rank for finding in report.ending.findings for rank in finding.ranks}
        ending = dataclasses.replace(report.ending, incidents=tuple(
            i for i in report.ending.incidents if i.rank in named))
        report = dataclasses.replace(report, ending=ending, **no_rows)
    return {
        "format": SNAPSHOT_FORMAT,
        "phase_table": [{**row} for row in phases.table_json()],
        "live": live,
        "ended": snap.ended,
        "elapsed_s": round(snap.elapsed_s, 3),
        "summary": report_to_json(report),
        "phases": [] if snap.wide else [_phases_json(row) for row in snap.phases],
        "worst_ranks": dict(snap.worst_ranks),
        "blamed": {str(rank): dict(cells) for rank, cells in snap.blamed.items()},
        "nodes": gauges_to_json(snap.nodes),
        "processes": gauges_to_json(snap.processes),
        "series": series_to_json(snap.series),
        "wide": None if snap.wide is None else _wide_json(snap.wide, len(snap.phases)),
        "lanes": lanes_to_json(snap.lanes),
    }


def _wide_json(wide: WideView, num_ranks: int) -> dict[str, Json]:
    return {
        "num_ranks": num_ranks,
        "phases": {p: spread_to_json(s) for p, s in wide.phases.items()},
        "last_step": spread_to_json(wide.last_step),
        "throughput": {k: spread_to_json(s) for k, s in wide.throughput.items()},
        "grid": grid_to_json(wide.grid),
    }


def _phases_json(row: RankPhases) -> dict[str, Json]:
    return {
        "rank": row.rank, "node_rank": row.node_rank, "last_step": row.last_step,
        "num_steps": row.num_steps,
        "median_ms": {k: round(v, 3) for k, v in row.median_ms.items()},
        "worst_ms": {k: round(v, 3) for k, v in row.worst_ms.items()},
    }
