"""The steps as a timeline (``traceml export --perfetto``): every rank's steps and phases
on the reference node's clock, as Chrome trace-event JSON, the format ui.perfetto.dev and
chrome://tracing open (gzip when the file name ends in ``.gz``).

One process per node, two tracks per rank: its steps with their phases nested in them,
and its collectives in flight.  A phase is drawn where it ran: `StepRow` keeps each
phase's first call and its last (`traceml.collector.step_parts.Placement`), so a phase
that ran once or twice is drawn whole; of one called more often (gradient accumulation)
the calls between are not placed, and the step's args say how much of its time is not
drawn (``not_drawn_ms``), as for a call that would cross another without nesting in it.
Collectives in flight are one slice from the first launch to the last completion when
they were in flight all that time, a slice per span when there were gaps between them and
the collector kept the spans (``collective_spans_ms``: up to eight), else two instants (the
union's total in their args).
Stalls, resumes, crashes, outlier steps and profiler captures are instant events; process
memory and CPU, host CPU and RAM and the GPUs, counters.

Times are microseconds from a whole unix second before the first step (``otherData``
says which), on the clock of the node the collector ran on: each node's
measured offset (`traceml.clocks`), moved by its drift, is taken off its times.  A node
whose clock was not measured keeps its own times, and the trace says so.
"""

from __future__ import annotations

import gzip
import math
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from traceml import phases
from traceml.clocks import REFERENCE, NodeClock, offset_at
from traceml.diagnosis.outliers import find_outliers
from traceml.records import RunData, StepRow, in_flight_spans
from traceml.version import __version__

MAX_RANK_STEPS = 20_000
"""The most steps (summed over ranks) one export writes, about 10 MB of JSON before gzip:
beyond it the latest steps are kept."""

PROGRESS_INCIDENTS = {"stall": "stall", "exception": "crash", "exit": "exit"}
"""Incident kinds (`traceml.wire.incidents`) by the name their instant takes."""

@dataclass(frozen=True)
class StepRange:
    """The steps an export holds: ``first`` to ``last``, inclusive."""

    first: int
    last: int
    capped: bool = False  # the range asked for was cut to `MAX_RANK_STEPS`

    @property
    def num_steps(self) -> int:
        return max(0, self.last - self.first + 1)


def choose_steps(last_steps: Mapping[int, int], window: int,
                 asked: tuple[int, int | None] | None,
                 ranks: Collection[int] | None) -> StepRange | None:
    """The steps to export: those ``asked`` (to the last any chosen rank stored), else
    the summary's window (the last ``window`` steps every chosen rank reached), cut to
    the latest that fit `MAX_RANK_STEPS`; None when no chosen rank stored one of them."""
    chosen = [last for rank, last in last_steps.items() if ranks is None or rank in ranks]
    if not chosen:
        return None
    if asked is None:
        upper = min(chosen)
        first, last = max(0, upper - window + 1), upper
    else:
        first = asked[0]  # to the last any chosen rank stored, at most
        last = max(chosen) if asked[1] is None else min(asked[1], max(chosen))
        if first > last:
            return None
    most = max(1, MAX_RANK_STEPS // len(chosen))
    if last - first + 1 > most:
        return StepRange(last - most + 1, last, capped=True)
    return StepRange(first, last)


@dataclass(frozen=True)
class NodeClocks:
    """Each node's offset against the reference clock (None: not measured)."""

    by_node: Mapping[int, NodeClock | None]
    single: bool  # one node: one clock

    @classmethod
    def of(cls, run: RunData, rows: Sequence[StepRow]) -> NodeClocks:
        """The clocks of ``run``'s nodes, for ``rows``."""
        nodes = {n.node_rank for n in run.meta.nodes} | {r.node_rank for r in rows}
        return cls({n.node_rank: n.clock for n in run.meta.nodes}, len(nodes) <= 1)

    def to_reference(self, node: int, t: float) -> float:
        """``t`` on node ``node``'s clock as the reference clock reads it."""
        clock = self.by_node.get(node)
        if self.single or clock is None:
            return t
        return t - offset_at(clock, t)[0]

    def unaligned(self, nodes: Collection[int]) -> list[int]:
        return [] if self.single else sorted(n for n in nodes if self.by_node.get(n) is None)


def _us_at(origin: float) -> Callable[[float], float]:
    """Unix seconds as the trace's microseconds: from ``origin`` (a whole second), so that
    a double keeps nanoseconds and a phase that ends where the next begins still does."""
    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)
    return us


def _pid(node: int) -> int:
    return node + 1 if node >= 0 else 1_000_000  # 0 is no process in the trace format


def _steps_tid(rank: int) -> int:
    return 2 * rank + 1


def _comm_tid(rank: int) -> int:
    return 2 * rank + 2


NOT_DRAWN_MS = 0.001
"""A phase whose drawn calls' own time falls short of its time by more than this (1 µs,
the positions' resolution) has time not drawn, which the step's args give."""


def placed_phases(row: StepRow) -> tuple[list[tuple[float, float, phases.Phase]], list[str],
                                         dict[str, float]]:
    """The phase calls of ``row`` drawn as slices, (begin, end) in ms from the step's
    begin, properly nested; what is not drawn and why; and per phase its ms not drawn
    (its time less its drawn calls' own time: calls between its first and last, calls
    that would cross another)."""
    total = row.total_ms
    candidates, left_out = [], []
    for phase in phases.PHASES:
        at, end, last_at, last_end = (row.value(c) for c in phase.place_columns)
        if not row.value(phase.count_column) and not row.ms(phase.name):
            continue
        if at is None or end is None:
            left_out.append(f"{phase.name}: not placed (stored before phases were)")
            continue
        candidates.append((min(at, total), min(max(at, end), total), phase))
        if last_at is not None and last_end is not None:
            candidates.append((min(last_at, total), min(max(last_at, last_end), total), phase))
    candidates.sort(key=lambda c: (c[0], -c[1], c[2].name))
    drawn: list[tuple[float, float, phases.Phase]] = []
    own: list[float] = []
    open_: list[int] = []  # indices into drawn
    for begin, end, phase in candidates:
        while open_ and drawn[open_[-1]][1] <= begin:
            open_.pop()
        if open_ and end > drawn[open_[-1]][1]:  # crosses the open slice without nesting
            left_out.append(f"{phase.name}: a call overlaps {drawn[open_[-1]][2].name} "
                            "without nesting in it")
            continue
        if open_:
            own[open_[-1]] -= end - begin
        drawn.append((begin, end, phase))
        own.append(end - begin)
        open_.append(len(drawn) - 1)
    missing: dict[str, float] = {}
    for phase in phases.PHASES:
        short = row.ms(phase.name) - sum(o for (_, _, p), o in zip(drawn, own) if p is phase)
        if short > NOT_DRAWN_MS:
            missing[phase.name] = round(short, 3)
            if not any(line.startswith(f"{phase.name}:") for line in left_out):
                left_out.append(f"{phase.name}: {short:.3f} ms of its calls not placed "
                                "(those between its first and last, or nested ones)")
    return drawn, left_out, missing


def _step_args(row: StepRow, left_out: Sequence[str], missing: Mapping[str, float]
               ) -> dict[str, Any]:
    args: dict[str, Any] = {"rank": row.rank, "step": row.step, "total_ms": row.total_ms,
                            "wait_ms": row.wait_ms}
    if row.restart:
        args["attempt"] = row.restart
    if row.flops_counted:
        args["flops_counted"] = True  # the FLOP counter ran in it: slower, out of the summary
    for phase in phases.PHASES:
        calls = row.value(phase.count_column)
        if calls or row.ms(phase.name):
            args[phase.column] = row.ms(phase.name)
            args[phase.count_column] = calls
    if row.collective_ms is not None:
        args["in_flight_ms"] = row.collective_ms
    if left_out:
        args["not_drawn"] = list(left_out)
    if missing:
        args["not_drawn_ms"] = dict(missing)
    return args


def _step_events(row: StepRow, begin_us: float, dur_us: float, cut_ms: float, node: int
                 ) -> Iterator[dict[str, Any]]:
    """The step's slice (``dur_us`` long: ``cut_ms`` less than the step, whose next one
    began inside it), its phases' and its collectives in flight."""
    pid, tid = _pid(node), _steps_tid(row.rank)

    def at_us(ms: float) -> float:
        return round(begin_us + min(ms * 1e3, dur_us), 3)

    drawn, left_out, missing = placed_phases(row)
    name = f"step {row.step}" + (f" (attempt {row.restart})" if row.restart else "")
    yield {"ph": "X", "cat": "step", "name": name, "pid": pid, "tid": tid, "ts": begin_us,
           "dur": dur_us, "args": _step_args(row, left_out, missing) | (
               {"cut_ms": cut_ms, "cut": "the rank's next step began inside this one"}
               if cut_ms else {})}
    for at, end, phase in drawn:
        calls = row.value(phase.count_column)
        args = {"step": row.step, "calls": calls, phase.column: row.ms(phase.name)}
        yield {"ph": "X", "cat": "phase", "name": phase.name, "pid": pid, "tid": tid,
               "ts": at_us(at), "dur": round(at_us(end) - at_us(at), 3), "args": args}
    at, end, total = (row.value("collective_at_ms"), row.value("collective_end_ms"),
                      row.collective_ms)
    if at is None or total is None:
        return
    at = min(at, row.total_ms)
    comm = {"pid": pid, "tid": _comm_tid(row.rank), "cat": "collective"}
    args = {"in_flight_ms": total, "step": row.step}
    spans = in_flight_spans(row)
    if spans:
        for begin, end in spans:
            yield {**comm, "ph": "X", "name": "collectives in flight", "ts": at_us(begin),
                   "dur": round(at_us(end) - at_us(begin), 3),
                   "args": args | {"spans": len(spans)} if len(spans) > 1 else args}
        return
    yield {**comm, "ph": "i", "s": "t", "name": "first collective launched",
           "ts": at_us(at), "args": args}
    if end is not None:
        yield {**comm, "ph": "i", "s": "t", "name": "last collective completed",
               "ts": at_us(min(max(end, at), row.total_ms)), "args": args}


def _metadata(run: RunData, rows: Sequence[StepRow], unaligned: Collection[int]
              ) -> Iterator[dict[str, Any]]:
    hosts = {n.node_rank: n.host for n in run.meta.nodes}
    nodes = sorted({r.node_rank for r in rows})
    for node in nodes:
        label = f"node {node}" + (f" ({hosts[node]})" if hosts.get(node) else "")
        if node in unaligned:
            label += " (clock not measured: its own times)"
        yield {"ph": "M", "name": "process_name", "pid": _pid(node), "args": {"name": label}}
        yield {"ph": "M", "name": "process_sort_index", "pid": _pid(node),
               "args": {"sort_index": _pid(node)}}
    for rank, node in sorted({(r.rank, r.node_rank) for r in rows}):
        for tid, label in ((_steps_tid(rank), f"r{rank} steps"),
                           (_comm_tid(rank), f"r{rank} collectives in flight")):
            yield {"ph": "M", "name": "thread_name", "pid": _pid(node), "tid": tid,
                   "args": {"name": label}}
            yield {"ph": "M", "name": "thread_sort_index", "pid": _pid(node), "tid": tid,
                   "args": {"sort_index": tid}}


def _instants(run: RunData, rows: Sequence[StepRow], clocks: NodeClocks, span: tuple[float, float],
              node_of: Mapping[int, int], us: Callable[[float], float]
              ) -> Iterator[dict[str, Any]]:
    def instant(rank: int, node: int, t: float, name: str, args: dict[str, Any]
                ) -> dict[str, Any]:
        return {"ph": "i", "s": "t", "cat": "incident", "name": name,
                "pid": _pid(node_of[rank]), "tid": _steps_tid(rank),
                "ts": us(clocks.to_reference(node, t)), "args": args}

    def inside(t: float | None) -> bool:
        return t is not None and span[0] <= t <= span[1]

    for inc in run.incidents:
        if inc.rank not in node_of:
            continue
        args = {"step": inc.step, "phase": inc.phase, "detected_at": inc.detected_at}
        if inc.stack:
            args["where"] = f"{inc.stack[-1].file}:{inc.stack[-1].line}"
        if inside(inc.began_at):
            name = PROGRESS_INCIDENTS.get(inc.what, inc.what)
            yield instant(inc.rank, inc.node_rank, inc.began_at, name, args)
        if inc.cleared_at is not None and inside(inc.cleared_at):
            yield instant(inc.rank, inc.node_rank, inc.cleared_at, "resume", args)
    for cap in run.captures:
        if cap.rank in node_of and inside(cap.began_at) and cap.began_at is not None:
            yield instant(cap.rank, node_of[cap.rank], cap.began_at,
                          f"profiler capture ({cap.role})",
                          {"trigger": cap.label, "path": cap.path, "steps": cap.num_steps})
    by_rank: dict[int, list[StepRow]] = {}
    for row in rows:
        by_rank.setdefault(row.rank, []).append(row)
    for rank, own in by_rank.items():
        found = find_outliers(rank, own)
        slow = set(found.steps)
        for row in own:
            if row.step in slow and row.t_begin is not None:
                yield instant(rank, row.node_rank, row.t_begin, f"outlier step {row.step}",
                              {"total_ms": row.total_ms, "median_ms": found.median_ms})


def _counters(run: RunData, clocks: NodeClocks, node_of: Mapping[int, int],
              us: Callable[[float], float]) -> Iterator[dict[str, Any]]:
    mib = 1 << 20
    for p in run.process:
        if p.rank not in node_of:
            continue
        pid, ts = _pid(p.node_rank), us(clocks.to_reference(p.node_rank, p.t))
        memory = {"rss": round(p.rss_bytes / mib, 1)}
        if p.device_allocated_bytes is not None:
            memory["device allocated"] = round(p.device_allocated_bytes / mib, 1)
        if p.device_reserved_bytes is not None:
            memory["device reserved"] = round(p.device_reserved_bytes / mib, 1)
        yield {"ph": "C", "name": f"r{p.rank} memory MiB", "pid": pid, "ts": ts, "args": memory}
        yield {"ph": "C", "name": f"r{p.rank} CPU %", "pid": pid, "ts": ts,
               "args": {"cpu": round(p.cpu_pct, 1)}}
    nodes = set(node_of.values())
    for s in run.system:
        if s.node_rank not in nodes:
            continue
        pid, ts = _pid(s.node_rank), us(clocks.to_reference(s.node_rank, s.t))
        yield {"ph": "C", "name": "host CPU %", "pid": pid, "ts": ts,
               "args": {"cpu": round(s.cpu_pct, 1)}}
        yield {"ph": "C", "name": "host RAM %", "pid": pid, "ts": ts,
               "args": {"ram": round(s.ram_pct, 1)}}
        for gpu in s.gpus:
            values = {k: v for k, v in (("util %", gpu.util_pct),
                                        ("memory MiB", None if gpu.mem_used_bytes is None
                                         else round(gpu.mem_used_bytes / mib, 1)))
                      if v is not None}
            if values:
                yield {"ph": "C", "name": f"gpu{gpu.index}", "pid": pid, "ts": ts,
                       "args": values}


ROUNDING_US = 1.0
"""A step stored to end later than its rank's next one begins by less than this is float
rounding (one clock read ends a step and begins the next); by more, the next step began
inside it (``trace_step`` with a fetch of the next batch inside the block).  Either way
its slice ends where the next begins, as the viewers need; by more, its args say so."""


def _durations(rows: Sequence[StepRow], starts: Sequence[float]) -> list[tuple[float, float]]:
    """Each step's slice length (µs), cut where its rank's next step begins, and the ms
    cut off beyond float rounding (0.0: none)."""
    durations = [(round(r.total_ms * 1e3, 3), 0.0) for r in rows]
    by_rank: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_rank.setdefault(row.rank, []).append(i)
    for indices in by_rank.values():
        indices.sort(key=lambda i: starts[i])
        for i, j in zip(indices, indices[1:]):
            over = starts[i] + durations[i][0] - starts[j]
            if over > 0.0:
                durations[i] = (round(max(0.0, starts[j] - starts[i]), 3),
                                round(over / 1e3, 3) if over > ROUNDING_US else 0.0)
    return durations


def trace(run: RunData, steps: StepRange | None = None, to_the_end: bool = True
          ) -> dict[str, Any]:
    """The trace-event document of ``run``'s steps (those of ``steps``, default all).
    ``to_the_end``: the steps run to the ranks' last, so the incidents after them (the
    crash, the stall that ended the run) are drawn too."""
    rows = [r for r in run.steps if r.t_begin is not None
            and (steps is None or steps.first <= r.step <= steps.last)]
    clocks = NodeClocks.of(run, rows)
    unaligned = clocks.unaligned({r.node_rank for r in rows})
    node_of = {r.rank: r.node_rank for r in rows}
    events: list[dict[str, Any]] = list(_metadata(run, rows, unaligned))
    begins = [clocks.to_reference(r.node_rank, r.t_begin) for r in rows
              if r.t_begin is not None]
    origin = float(math.floor(min(begins, default=run.meta.started_at) - 1.0))
    us = _us_at(origin)
    starts = [us(b) for b in begins]
    for row, begin, (dur, cut_ms) in zip(rows, starts, _durations(rows, starts)):
        events += _step_events(row, begin, dur, cut_ms, row.node_rank)
    if rows:
        span = (min(r.t_begin for r in rows if r.t_begin is not None),
                math.inf if to_the_end else max(r.t for r in rows if r.t is not None))
        events += _instants(run, rows, clocks, span, node_of, us)
        events += _counters(run, clocks, node_of, us)
    clock_notes = {str(node): ("reference" if clocks.single or clock == REFERENCE
                               else "not measured" if clock is None
                               else {"offset_ms": clock.offset_ms,
                                     "uncertainty_ms": clock.uncertainty_ms,
                                     "drift_ppm": clock.drift_ppm})
                   for node, clock in sorted(clocks.by_node.items())}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": f"traceml {__version__}",
                          "session": run.meta.session_id,
                          "clock": "the reference node's clock (the collector's): ts is "
                                   "microseconds since ts_origin_unix_s",
                          "ts_origin_unix_s": origin,
                          "clocks": clock_notes,
                          "not_aligned_nodes": unaligned,
                          "steps": None if steps is None else [steps.first, steps.last],
                          "capped": bool(steps is not None and steps.capped)}}


def write_trace(document: dict[str, Any], path: Path) -> int:
    """Write ``document`` to ``path`` (gzip for a name ending in .gz), whole or not at
    all; its size in bytes."""
    data = orjson.dumps(document)
    if path.name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=6, mtime=0)
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return len(data)
