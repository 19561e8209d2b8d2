"""Stored rows checked and converted into the diagnosis' typed samples (a row whose
values no collector writes raises ValueError or TypeError, and the reader skips it),
and the run's `RunData` and `RunMeta` assembled from them and the store's records
(shared: the launcher, offline analysis and the live views read through it)."""

from __future__ import annotations

import dataclasses
import gc
import operator
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import orjson

from traceml import stacks, step_fields
from traceml.clocks import REFERENCE, Exchange, estimate
from traceml.errors import ProtocolError
from traceml.records import (
    TOTALED,
    Capture,
    GpuSample,
    Incident,
    NodeInfo,
    ProcessSample,
    RankTotals,
    RunData,
    RunMeta,
    StepRow,
    SystemSample,
    totals_of,
)
from traceml.store.records import RunRecords, SenderState
from traceml.wire.identity import MAX_WORLD_SIZE, Sender
from traceml.wire.records import RunEnd, RunStart

_Run = TypeVar("_Run", RunStart, RunEnd)

LIMIT = float(2**62)  # beyond any count, byte size, time or duration a run stores


def checked_number(value: Any, nullable: bool = True, low: float = -LIMIT) -> Any:
    """A stored number as a collector writes it; ValueError otherwise."""
    if value is None and nullable:
        return None
    if type(value) not in (int, float) or not low <= value <= LIMIT:  # NaN fails too
        raise ValueError(f"{value!r} is not a stored number")
    return value


def checked_integer(value: Any, low: int = -1, high: float = LIMIT) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{value!r} is not a stored integer")
    return value


def checked_text(value: Any) -> str:
    if type(value) is not str:
        raise ValueError(f"{value!r} is not text")
    return value


def _numbers(r: Mapping[str, Any], columns: Iterable[str]) -> dict[str, Any]:
    """The row's ``columns``, each None or a number a collector writes."""
    return {c: checked_number(r.get(c)) for c in columns}


def checked_record(record: _Run) -> _Run:
    """A run record whose numbers are finite (a stored one may not be)."""
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if type(value) in (int, float) and not -LIMIT <= value <= LIMIT:
            raise ProtocolError(f"{f.name} out of range")
    if isinstance(record, RunStart) and not 0 <= record.expected_world_size <= MAX_WORLD_SIZE:
        raise ProtocolError("expected_world_size out of range")
    return record


def sender_state(r: Mapping[str, Any]) -> SenderState:
    rank = r["rank"]
    world_size = r["world_size"]
    sender = Sender(role=checked_text(r["role"]), host=checked_text(r["host"]), pid=checked_integer(r["pid"]),
                    node_rank=checked_integer(r["node_rank"]),
                    rank=None if rank is None else checked_integer(rank, 0, MAX_WORLD_SIZE - 1),
                    local_rank=r["local_rank"],
                    world_size=(None if world_size is None
                                else checked_integer(world_size, 1, MAX_WORLD_SIZE)),
                    restart=checked_integer(r["restart"], 0))
    return SenderState(sender, checked_number(r["first_seen"], False), checked_number(r["last_seen"], False),
                       checked_integer(r["num_messages"], 0), checked_integer(r["num_gaps"], 0),
                       checked_integer(r["last_seq"]), checked_integer(r["num_sent"], 0),
                       checked_integer(r["num_dropped"], 0), bool(r["said_bye"]))


def checked_step(values: Sequence[Any]) -> StepRow:
    """A stored step's values (every column of `traceml.step_fields`, in table order)
    as a StepRow; ValueError for a value a collector does not write."""
    for f, v in zip(step_fields.STEP_FIELDS, values):
        if not step_fields.admits(f, v):
            raise ValueError(f"{v!r} is not a stored {f.name}")
    return StepRow(values)


_PROCESS_VALUES = ("cpu_pct", "rss_bytes", "host_ram_total_bytes", "num_cpus",
                   "device_allocated_bytes", "device_reserved_bytes", "device_total_bytes")
_PROCESS_COLUMNS = ("rank", "node_rank", "t", *_PROCESS_VALUES)  # a process row's, in order


def clock_exchange(r: Mapping[str, Any]) -> tuple[str, int, Exchange]:
    """A stored exchange: the launcher that made it and its four times (unix seconds)."""
    return (checked_text(r["host"]), checked_integer(r["pid"], 0),
            Exchange(*(checked_number(r[t], False, 0.0) for t in ("t1", "t2", "t3", "t4"))))


def process_samples(names: Sequence[str], rows: Sequence[Sequence[Any]]
                    ) -> tuple[list[ProcessSample], int]:
    """Stored process rows (tuples of ``names``' columns) as samples, and how many
    would not convert (skipped).  The values are checked a column at a time, a few
    passes in C (a wide job's window reads tens of thousands of rows), and row by row
    (:func:`process_sample`) only when a column fails.  SQLite keeps no NaN (it
    stores NULL), so a column's least and greatest values bound all of them."""
    at = {name: i for i, name in enumerate(names)}
    if rows and all(c in at for c in _PROCESS_COLUMNS):  # a table without one: an edited file
        columns = [list(map(operator.itemgetter(at[c]), rows)) for c in _PROCESS_COLUMNS]
        if _admits_process(columns):
            return [ProcessSample(rank, node, t, cpu or 0.0, rss or 0, ram or 0, cpus or 1,
                                  *device)
                    for rank, node, t, cpu, rss, ram, cpus, *device in zip(*columns)], 0
    out = []
    for row in rows:
        try:
            out.append(process_sample(dict(zip(names, row))))
        except (TypeError, ValueError, KeyError):
            pass
    return out, len(rows) - len(out)


def _admits_process(columns: Sequence[Sequence[Any]]) -> bool:
    """Whether every value of these columns (`process_samples`' order) is one
    `process_sample` takes."""
    rank, node_rank, t, *values = columns
    return (_all_within(rank, {int}, 0, MAX_WORLD_SIZE - 1)
            and _all_within(node_rank, {int}, -1, LIMIT)
            and _all_within(t, {int, float}, -LIMIT, LIMIT)
            and all(_all_within([v for v in column if v is not None], {int, float}, -LIMIT, LIMIT)
                    for column in values))


def _all_within(column: Sequence[Any], kinds: set[type], low: float, high: float) -> bool:
    """Whether every value is of one of ``kinds`` (no bool) and within ``low`` to ``high``."""
    return not column or (set(map(type, column)) <= kinds
                          and low <= min(column) and max(column) <= high)


def process_sample(r: Mapping[str, Any]) -> ProcessSample:
    v = _numbers(r, _PROCESS_VALUES)
    return ProcessSample(
        rank=checked_integer(r["rank"], 0, MAX_WORLD_SIZE - 1), node_rank=checked_integer(r["node_rank"]),
        t=checked_number(r["t"], False), cpu_pct=v["cpu_pct"] or 0.0,
        rss_bytes=v["rss_bytes"] or 0, host_ram_total_bytes=v["host_ram_total_bytes"] or 0,
        num_cpus=v["num_cpus"] or 1, device_allocated_bytes=v["device_allocated_bytes"],
        device_reserved_bytes=v["device_reserved_bytes"],
        device_total_bytes=v["device_total_bytes"],
    )


def incident_from_row(r: Mapping[str, Any]) -> Incident:
    detail = orjson.loads(checked_text(r["detail"]))
    if not isinstance(detail, dict) or not all(
            isinstance(v, (str, int, float)) or v is None for v in detail.values()):
        raise TypeError("incident detail is not an object of scalars")
    phase, source = r["phase"], r["stack_source"]
    return Incident(
        what=checked_text(r["what"]), rank=checked_integer(r["rank"], 0, MAX_WORLD_SIZE - 1),
        node_rank=checked_integer(r["node_rank"]), host=checked_text(r["host"]),
        pid=checked_integer(r["pid"], 0),
        began_at=checked_number(r["began_at"], False), detected_at=checked_number(r["detected_at"], False),
        cleared_at=checked_number(r["cleared_at"]),
        step=None if r["step"] is None else checked_integer(r["step"], 0),
        phase=None if phase is None else checked_text(phase),
        open_phases=tuple(checked_text(p) for p in orjson.loads(checked_text(r["open_phases"]))),
        stack=stacks.from_json(orjson.loads(checked_text(r["stack"]))),
        stack_source=None if source is None else checked_text(source), detail=detail)


def capture_from_row(r: Mapping[str, Any]) -> Capture:
    def text(key: str) -> str | None:
        return None if r[key] is None else checked_text(r[key])

    operators = orjson.loads(checked_text(r["operators"]))
    if type(operators) is not list:
        raise TypeError("operators is not a list")
    ops = []
    for o in operators:
        name, shapes, calls, self_ms, device_ms, part = o
        ops.append((checked_text(name), checked_text(shapes), checked_number(calls, False, 0),
                    checked_number(self_ms, False, 0), checked_number(device_ms, True, 0),
                    checked_text(part)))
    return Capture(
        capture_id=checked_text(r["capture_id"]),
        rank=checked_integer(r["rank"], 0, MAX_WORLD_SIZE - 1), role=checked_text(r["role"]),
        trigger=checked_text(r["trigger"]), label=checked_text(r["label"]), phase=text("phase"),
        asked_at=checked_number(r["asked_at"], False),
        start_after=checked_integer(r["start_after"], 0),
        steps_asked=checked_integer(r["steps_asked"], 1),
        reported_at=checked_number(r["reported_at"]),
        num_steps=checked_integer(r["num_steps"], 0),
        began_at=checked_number(r["began_at"]), ended_at=checked_number(r["ended_at"]),
        host=text("host"), path=text("path"), trace_bytes=checked_integer(r["trace_bytes"], 0),
        cut=text("cut"), error=text("error"), operators=tuple(ops))


def system_sample(r: Mapping[str, Any]) -> SystemSample:
    v = _numbers(r, ("cpu_pct", "ram_pct", "ram_total_bytes"))
    gpus = orjson.loads(r["gpus"] or "[]")
    if type(gpus) is not list:
        raise ValueError("gpus is not a list")
    return SystemSample(node_rank=checked_integer(r["node_rank"]), host=checked_text(r["host"]),
                        t=checked_number(r["t"], False), cpu_pct=v["cpu_pct"] or 0.0,
                        ram_pct=v["ram_pct"] or 0.0, ram_total_bytes=v["ram_total_bytes"] or 0,
                        gpus=tuple(_gpu_sample(g) for g in gpus))


def _gpu_sample(values: Any) -> GpuSample:
    if type(values) is not list:
        raise ValueError("a GPU sample is not a list")
    index, *rest = values
    return GpuSample(checked_integer(index, 0), *(checked_number(x) for x in rest))


def group_totals(rank: int, g: Mapping[str, Any]) -> RankTotals:
    """One attempt's sums as SQL gave them; ValueError when one is not what a
    collector's rows add up to."""
    return RankTotals(
        rank=rank, num_rows=checked_integer(g["num_rows"], 1), last_step=checked_integer(g["last_step"], 0),
        sum_ms={p.name: float(checked_number(g[p.column] or 0.0, False, 0.0)) for p in TOTALED},
        eval_ms=float(checked_number(g["eval_ms"] or 0.0, False, 0.0)),
        num_eval=checked_integer(g["num_eval"] or 0, 0), device_measured=bool(g["num_cuda"]))


def merged_totals(parts: Sequence[RankTotals]) -> RankTotals:
    """One rank's totals from those of its attempts."""
    if len(parts) == 1:
        return parts[0]
    return RankTotals(
        rank=parts[0].rank, num_rows=sum(p.num_rows for p in parts),
        last_step=max(p.last_step for p in parts),
        sum_ms={p.name: sum(t.sum_ms.get(p.name, 0.0) for t in parts) for p in TOTALED},
        eval_ms=sum(p.eval_ms for p in parts), num_eval=sum(p.num_eval for p in parts),
        device_measured=any(p.device_measured for p in parts))


# -- the run, described from its records --------------------------------------------------

_NO_START = RunStart(session_id="", command=(), started_at=0.0, traceml_version="",
                     torch_version="", python_version="", summary_window_rows=0, mode="run")


@contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cycle collector off while many rows are made: a wide job's summary
    makes a million step rows, a live view's first poll hundreds of thousands (none
    in a cycle), and every collection would walk them all again (a third of a
    summary's time at 8192 ranks, 40 % of that poll's).  After it, on the main
    thread, what was made goes straight to the oldest generation (frozen, then
    thawed there): the first young collection would otherwise walk it all once
    more, only for the rows to be freed by their counts or kept for long.  Not on
    another thread (a live view's, in the collector): a freeze would age every
    thread's new objects, the message loop's cyclic garbage with them, which would
    then wait for a full collection.  Not when the process froze objects of its
    own either: thawing would thaw those too.  Another thread pausing at the same
    time is harmless: the collector stays off until the first of them to pause
    ends."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if (threading.current_thread() is threading.main_thread()
                    and not gc.get_freeze_count()):
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def run_data(records: RunRecords, steps: tuple[StepRow, ...], process: tuple[ProcessSample, ...],
             system: tuple[SystemSample, ...], incidents: tuple[Incident, ...] = (),
             totals: tuple[RankTotals, ...] | None = None) -> RunData:
    """The run as the diagnosis reads it: these samples (all, the window's, or the
    recent ones a live view keeps), what ``records`` say about the run and each rank's
    whole-run ``totals`` (None: ``steps`` are all there is; added up once, here)."""
    totals = totals_of(steps) if totals is None else totals
    meta = _run_meta(records, totals, process)
    return RunData(meta, steps, process, system, incidents=incidents, totals=totals)


def _run_meta(records: RunRecords, totals: tuple[RankTotals, ...],
              process: tuple[ProcessSample, ...]) -> RunMeta:
    start = records.start or _NO_START
    world_size, missing = _ranks(records, totals)
    exit_code = records.end.exit_code if records.end is not None else None
    complete = records.end.telemetry_complete if records.end is not None else True
    lost_at = records.launcher_lost_at if records.end is None else None
    if lost_at is not None:  # no end will come: the record stops where telemetry did
        complete = False
    cuda = any(t.device_measured for t in totals) or any(
        p.device_total_bytes is not None for p in process)
    senders = records.senders
    return RunMeta(
        count_flops=bool(start.count_flops),
        peak_tflops=start.peak_tflops or None,
        session_id=start.session_id, command=list(start.command),
        started_at=start.started_at,
        ended_at=(records.end.ended_at if records.end is not None
                  else lost_at if lost_at is not None else start.started_at),
        exit_code=exit_code, partial=bool(missing) or exit_code != 0 or not complete,
        world_size=world_size, missing_ranks=missing,
        nodes=_nodes(senders, records.clock_exchanges, records.clock_reference),
        device="cuda" if cuda else "cpu",
        versions={"traceml": start.traceml_version, "torch": start.torch_version,
                  "python": start.python_version},
        transport={"sent": sum(s.num_sent for s in senders),
                   "dropped": sum(s.num_dropped for s in senders),
                   "gaps": sum(s.num_gaps for s in senders),
                   "rejected": sum(records.rejected.values())},
        mode=start.mode, rejected=dict(records.rejected), telemetry_complete=complete,
        lost=records.launcher_lost_role if lost_at is not None else None,
        exports={name: dict(tally) for name, tally in records.exports.items()},
    )


def _ranks(records: RunRecords, totals: tuple[RankTotals, ...]) -> tuple[int, tuple[int, ...]]:
    """The world size and the ranks missing from it."""
    start = records.start or _NO_START
    ranked = [s for s in records.senders if s.sender.rank is not None]
    reported = [s.sender.world_size for s in records.senders if s.sender.world_size]
    world_size = max(reported + [start.expected_world_size, len({s.sender.rank for s in ranked}),
                                 1 + max((t.rank for t in totals), default=-1)])
    # A rank that never said goodbye was lost (killed, or its node died): its data
    # stops early.  Watch mode has no agent to say goodbye.
    seen = {s.sender.rank for s in ranked if s.said_bye or start.mode != "run"}
    return world_size, tuple(r for r in range(world_size) if r not in seen)


def _nodes(senders: Sequence[SenderState],
           exchanges: Sequence[tuple[str, int, Exchange]] = (),
           reference: tuple[str, int] | None = None) -> tuple[NodeInfo, ...]:
    """The job's nodes, each with its clock against the collector's node (the reference)
    when its launcher measured one (its exchanges, found by the host and pid of the
    launcher's system sampler); the reference's own clock reads 0."""
    hosts: dict[int, str] = {}
    ranks: dict[int, set[int]] = {}
    launchers: dict[tuple[str, int], int] = {}
    for s in senders:
        node = s.sender.node_rank
        if node < 0:
            continue  # a c10d launcher before it learnt its node rank
        hosts.setdefault(node, s.sender.host)
        ranks.setdefault(node, set())
        if s.sender.rank is not None:
            ranks[node].add(s.sender.rank)
        if s.sender.role == "system":
            launchers[s.sender.host, s.sender.pid] = node
    by_node: dict[int, list[Exchange]] = {}
    for host, pid, exchange in exchanges:
        of = launchers.get((host, pid))
        if of is not None:
            by_node.setdefault(of, []).append(exchange)
    clocks = {n: estimate(e) for n, e in by_node.items()}
    if reference is not None and reference in launchers:
        clocks[launchers[reference]] = REFERENCE
    elif reference is None and by_node and 0 in hosts and 0 not in by_node:
        clocks[0] = REFERENCE  # a store that did not record its reference: node 0's
    return tuple(NodeInfo(n, hosts[n], tuple(sorted(ranks[n])), clocks.get(n))
                 for n in sorted(hosts))
