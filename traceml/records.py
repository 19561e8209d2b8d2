"""The records every package shares: the stored telemetry of one run, and their JSON.

A leaf (the standard library, traceml.phases, traceml.step_fields and traceml.stacks): the collector and
the store build these records, the rules (traceml.diagnosis) read them, the reports
and live views show them.  The store reader builds a :class:`RunData` from SQLite;
recorded test scenarios store one as JSON (`traceml.records_json`). "Not measured" is
``None`` throughout, a measured zero is ``0``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from traceml import phases, step_fields
from traceml.clocks import NodeClock
from traceml.stacks import Frame

Json = None | bool | int | float | str | list["Json"] | dict[str, "Json"]
"""A JSON value as the standard library's ``json`` module reads and writes it."""

_INDEX = {f.name: i for i, f in enumerate(step_fields.STEP_FIELDS)}
_DEFAULTS = tuple(f.default for f in step_fields.STEP_FIELDS)
_MS_INDEX = {"total": _INDEX["total_ms"], "wait": _INDEX["wait_ms"],
             **{p.name: _INDEX[p.column] for p in phases.PHASES}}
_COMPUTE_INDEX = tuple(_MS_INDEX[n] for n in phases.compute_names())
_COUNT_INDEX = tuple(_INDEX[p.count_column] for p in phases.PHASES)
_GPU_INDEX = tuple(_INDEX[p.gpu_column] for p in phases.gpu_compute())
_GPU_WAIT_INDEX = tuple(_INDEX[p.gpu_column] for p in phases.gpu_timed() if p.waits)


def _column(name: str) -> Any:
    """A typed view of one column: a C-level getter, as cheap as a tuple index."""
    return property(operator.itemgetter(_INDEX[name]), doc=f"The {name} column.")


class StepRow(tuple[Any, ...]):
    """One training step of one rank: its :data:`traceml.step_fields.STEP_FIELDS`
    values, in table order (what the store's steps table holds, row for row).

    A tuple, so that a wide job's summary (a million rows) costs one object per row
    and a stored row needs no conversion; build one with :meth:`of`.  The typed views
    below are those the rules read; any column reads with :meth:`value`."""

    __slots__ = ()

    rank: int = _column("rank")
    restart: int = _column("restart")
    node_rank: int = _column("node_rank")
    step: int = _column("step")  # 0-based per rank
    t_begin: float | None = _column("t_begin")  # unix seconds
    total_ms: float = _column("total_ms")  # boundary to boundary
    wait_ms: float = _column("wait_ms")  # total - every phase, clamped >= 0
    num_skipped: int = _column("num_skipped")
    rss_bytes: int | None = _column("rss_bytes")  # host RSS of the rank at step end
    peak_allocated_bytes: int | None = _column("peak_allocated_bytes")  # None off CUDA
    peak_reserved_bytes: int | None = _column("peak_reserved_bytes")
    collective_ms: float | None = _column("collective_ms")  # None: untimed
    samples: int | None = _column("samples")  # None: not measured
    tokens: int | None = _column("tokens")
    flops: float | None = _column("flops")  # None: unknown
    boundary: str = _column("boundary")  # one of `traceml.phases.STEP_BOUNDARIES`
    eval_ms: float = _column("eval_ms")  # evaluation that ended where this step began
    num_eval: int = _column("num_eval")
    num_input: int = _column(phases.PHASES[0].count_column)  # DataLoader fetches

    @classmethod
    def of(cls, **values: Any) -> StepRow:
        """A row from column values by name; a column not named takes its default.
        TypeError for a name the table does not have."""
        row = list(_DEFAULTS)
        for name, value in values.items():
            try:
                row[_INDEX[name]] = value
            except KeyError:
                raise TypeError(f"StepRow has no column {name!r}") from None
        return cls(row)

    def replace(self, **changes: Any) -> StepRow:
        """This row with some columns changed."""
        row = list(self)
        for name, value in changes.items():
            row[_INDEX[name]] = value
        return StepRow(row)

    def value(self, name: str) -> Any:
        """Any column by name; KeyError for one the table does not have."""
        return self[_INDEX[name]]

    def columns(self) -> dict[str, Any]:
        """The row by column name."""
        return dict(zip(step_fields.names(), self))

    def __repr__(self) -> str:
        return "StepRow(" + ", ".join(f"{k}={v!r}" for k, v in self.columns().items()) + ")"

    @property
    def flops_counted(self) -> bool:
        """The FLOP counter ran in this step: out of the timing window."""
        return bool(self[_FLOPS_COUNTED])

    @property
    def t(self) -> float | None:
        """Unix seconds at the step's end; lets sample sections use the step window."""
        begin = self[_T_BEGIN]
        return None if begin is None else begin + self[_TOTAL] / 1e3

    @property
    def gpu_ms(self) -> float | None:
        """GPU time of the GPU-timed phases; None off CUDA (or a step not timed)."""
        times = [self[i] for i in _GPU_INDEX]
        return None if not times or None in times else float(sum(times))

    @property
    def phase_ms(self) -> dict[str, float]:
        """Exclusive time per phase name (`traceml.phases`)."""
        return {p.name: self[_MS_INDEX[p.name]] for p in phases.PHASES}

    @property
    def counts(self) -> tuple[int, ...]:
        """How many times each phase ran in the step, in phase order."""
        return tuple(self[i] for i in _COUNT_INDEX)

    def ms(self, name: str) -> float:
        """Time of a phase, or of ``total``, ``compute`` or ``wait``."""
        if name == "compute":
            return float(sum(self[i] for i in _COMPUTE_INDEX))
        return float(self[_MS_INDEX[name]])


_FLOPS_COUNTED, _T_BEGIN, _TOTAL = _INDEX["flops_counted"], _INDEX["t_begin"], _INDEX["total_ms"]
_RANK = _INDEX["rank"]


def ms_column(rows: Sequence[StepRow], name: str) -> list[float]:
    """``[row.ms(name) for row in rows]``, without a call per row (a wide job has
    millions)."""
    if name == "compute":
        parts = (map(operator.itemgetter(i), rows) for i in _COMPUTE_INDEX)
        return list(map(float, map(sum, zip(*parts))))
    return list(map(operator.itemgetter(_MS_INDEX[name]), rows))


def column(rows: Iterable[StepRow], name: str) -> list[Any]:
    """``[row.value(name) for row in rows]``, without a call per row."""
    return list(map(operator.itemgetter(_INDEX[name]), rows))


def gpu_column(rows: Sequence[StepRow], with_wait: bool = False) -> list[float]:
    """The GPU times of the rows that carry them (``row.gpu_ms`` where not None),
    without a call per row: none off CUDA.  ``with_wait``: the compute stream's wait on
    collectives (DDP's, ``gpu_communication_ms``) added, over the rows that timed it."""
    index = (*_GPU_INDEX, *_GPU_WAIT_INDEX) if with_wait else _GPU_INDEX
    if not index or not rows:
        return []
    get = operator.itemgetter(*index)
    if len(index) == 1:
        return [float(t) for t in map(get, rows) if t is not None]
    return [float(sum(ts)) for ts in map(get, rows) if None not in ts]


IN_FLIGHT_SLACK = 0.01
"""Collectives were in flight the whole time from the first launch to the last completion
when their union is within this fraction of that time."""


def in_flight_spans(row: StepRow) -> tuple[tuple[float, float], ...]:
    """When collectives were in flight, ms from the step's begin (within the step; a
    span that would begin at the step's end is left out): one span from the first
    launch to the last completion when they were in flight all that time, else the
    disjoint spans the collector kept (``collective_spans_ms``), each time only when they
    begin at the first launch, end at the last completion and add up to the step's total
    in flight (within `IN_FLIGHT_SLACK`, or the µs each stored end was rounded to); none
    otherwise (gaps whose spans were not kept, a malformed column) or when none was
    timed."""
    at, end, total = (row.value("collective_at_ms"), row.value("collective_end_ms"),
                      row.collective_ms)
    if at is None or end is None or total is None or end < at:
        return ()
    spans = [(at, end)]
    if abs((end - at) - total) > max(0.001, IN_FLIGHT_SLACK * (end - at)):
        spans = _spans_column(row.value("collective_spans_ms"))
        rounding = 0.001 * (len(spans) + 1)  # each end to the µs; the others are not
        if (not spans or abs(spans[0][0] - at) > rounding or abs(spans[-1][1] - end) > rounding
                or abs(sum(e - b for b, e in spans) - total)
                > max(rounding, IN_FLIGHT_SLACK * total)):
            return ()
    limit = row.total_ms
    return tuple((min(b, limit), min(e, limit)) for b, e in spans if b < limit or len(spans) == 1)


def _spans_column(text: str | None) -> list[tuple[float, float]]:
    """``collective_spans_ms`` ("begin-end,...", ms) as spans: two to
    `step_fields.MAX_SPANS`, each after the last with a gap between; none when absent or
    not that."""
    if not text:
        return []
    spans: list[tuple[float, float]] = []
    try:
        for pair in text.split(",", step_fields.MAX_SPANS):
            begin, end = map(float, pair.split("-"))
            if not (math.isfinite(begin) and math.isfinite(end) and 0 <= begin <= end):
                return []
            if spans and begin <= spans[-1][1]:
                return []
            spans.append((begin, end))
    except ValueError:
        return []
    return spans if 1 < len(spans) <= step_fields.MAX_SPANS else []


@dataclass(frozen=True)
class FlopCount:
    """One FLOP count of a rank (`traceml.agent.flops`): one training step run under
    torch's FLOP counter, or the reason it was not counted."""

    t: float  # unix seconds, when the count ended
    flops: float | None  # FLOPs of the step; None: abstained (``reason``)
    dtype: str | None  # what most of them ran in: "bf16", "fp16", "tf32", "fp32", ...
    dtype_share: float | None  # ...that dtype's share of the FLOPs, 0..1
    device_name: str | None  # as torch.cuda.get_device_name() reports it; "cpu" on CPU
    sm_count: int | None  # the device's multiprocessors (a MIG slice has fewer)
    reason: str | None  # why flops is None
    ran: bool = True  # the counter ran in a step (that step is out of the window)
    rank: int = 0

    def values(self) -> list[Any]:
        """Every field but ``rank``, in order: how a relay forwards it, how it is stored."""
        return [self.t, self.flops, self.dtype, self.dtype_share, self.device_name,
                self.sm_count, self.reason, self.ran]


@dataclass(frozen=True)
class ProcessSample:
    """Process telemetry of one rank, taken every sample interval."""

    rank: int
    node_rank: int
    t: float  # unix seconds
    cpu_pct: float  # process CPU %, 100 = one core
    rss_bytes: int
    host_ram_total_bytes: int
    num_cpus: int
    device_allocated_bytes: int | None = None
    device_reserved_bytes: int | None = None
    device_total_bytes: int | None = None


@dataclass(frozen=True)
class GpuSample:
    """One GPU of a node at one sample time."""

    index: int
    util_pct: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None
    temp_c: float | None
    power_w: float | None


@dataclass(frozen=True)
class SystemSample:
    """Host telemetry of one node, taken every sample interval."""

    node_rank: int
    host: str
    t: float
    cpu_pct: float  # host-wide, 0..100
    ram_pct: float
    ram_total_bytes: int
    gpus: tuple[GpuSample, ...] = ()


@dataclass(frozen=True)
class NodeInfo:
    """One node of the job and the global ranks it ran."""

    node_rank: int
    host: str
    ranks: tuple[int, ...]
    # Its clock against node 0's (`traceml.clocks`); None: node 0, one node, not measured.
    clock: NodeClock | None = None


@dataclass(frozen=True)
class RunMeta:
    """What was run, where, and how it ended."""

    session_id: str
    command: list[str]
    started_at: float  # unix seconds
    ended_at: float
    exit_code: int | None
    partial: bool
    world_size: int
    missing_ranks: tuple[int, ...]
    nodes: tuple[NodeInfo, ...]
    device: str  # "cpu" | "cuda"
    versions: dict[str, str]  # traceml, torch, python
    transport: dict[str, int]  # sent, dropped, gaps, rejected
    mode: str = "run"  # "run" or "watch" (watch: no step sections measured)
    count_flops: bool = True  # False with --no-flops
    peak_tflops: float | None = None  # --peak-tflops; None: the peak table's
    # Messages the collector rejected and stored rows skipped, by reason.
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    # False: the collector died or hung before the end; what came after is missing.
    telemetry_complete: bool = True
    # The launcher vanished before the end (kill -9): exit status unknown, ranks unstopped.
    # What vanished before recording the end: "launcher" (kill -9), or "process" (the one
    # training process of traceml.init()); None: nothing did.
    lost: str | None = None
    # How the collector's metrics exports went: exporter ("otlp") -> endpoint, sent,
    # failed, error (`traceml.live.otlp`); empty when none ran.
    exports: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Incident:
    """A stall or a crash of one rank, as the collector stored it."""

    what: str  # "stall" | "exception" | "exit" (`traceml.wire.incidents.INCIDENTS`)
    rank: int
    node_rank: int
    host: str
    pid: int
    began_at: float  # unix seconds: the stall's last progress, the crash's moment
    detected_at: float
    cleared_at: float | None = None  # a stall's end, once steps resumed
    step: int | None = None  # the rank's step in progress (0-based), None: unknown
    phase: str | None = None  # the innermost open phase; None: outside every phase
    open_phases: tuple[str, ...] = ()  # outermost first
    stack: tuple[Frame, ...] = ()  # outermost first
    stack_source: str | None = None  # "python" | "faulthandler"
    detail: Mapping[str, str | int | float | None] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Capture:
    """One rank's part of a profiler capture: node 0's ask, then the rank's report
    (`traceml.wire.captures`); its operators are ``(name, input shapes, calls, host
    self ms, device self ms or None, part)``, each per captured step (part: where in the
    step it ran, ``compute``, ``input`` or ``optimizer``)."""

    capture_id: str
    rank: int
    role: str  # "suspect" | "reference"
    trigger: str  # the finding's kind that asked ("manual": ``traceml capture``)
    label: str  # what the report calls the trigger ("COMPUTE STRAGGLER r1", "manual")
    phase: str | None  # the finding's phase
    asked_at: float  # unix seconds
    start_after: int  # the rank's iterations ended before the first profiled step
    steps_asked: int
    reported_at: float | None = None  # None: the rank never reported
    num_steps: int = 0
    began_at: float | None = None
    ended_at: float | None = None
    host: str | None = None
    path: str | None = None
    trace_bytes: int = 0
    cut: str | None = None
    error: str | None = None
    operators: tuple[tuple[str, str, float, float, float | None, str], ...] = ()
    # The profiled steps as traceml timed them (the store's rows): (phase, "compute",
    # "total") -> ms per step, the same steps the operators come from
    step_ms: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class RankTotals:
    """One rank's stored steps over the whole run, every attempt's rows: what a
    summary says of the run beyond its window (the store sums them in SQL)."""

    rank: int
    num_rows: int  # stored step rows (a step a restart ran again counts again)
    last_step: int  # the highest step index
    sum_ms: Mapping[str, float]  # the rows' time per phase name, "total" and "wait"
    eval_ms: float = 0.0  # evaluation wall time kept out of the steps (rows with passes)
    num_eval: int = 0  # ...in this many passes
    device_measured: bool = False  # some step has a CUDA memory peak

    def mean_ms(self, name: str) -> float:
        """Mean time per stored row of a phase, ``total`` or ``wait``."""
        return self.sum_ms.get(name, 0.0) / self.num_rows if self.num_rows else 0.0


TOTALED = (*phases.PHASES, phases.TOTAL, phases.WAIT)
"""What :attr:`RankTotals.sum_ms` holds, by name."""


@dataclass(frozen=True)
class RunData:
    """Everything the diagnosis needs about one run.

    ``steps`` holds the rows the reader loaded: every stored one, or (the final
    summary's bounded read) each rank's steps around the summary window only.
    ``totals`` says what the whole run's steps add up to per rank; None (a
    hand-built run) means ``steps`` is the whole run: see :func:`rank_totals`."""

    meta: RunMeta
    steps: tuple[StepRow, ...]
    process: tuple[ProcessSample, ...]
    system: tuple[SystemSample, ...]
    flop_counts: tuple[FlopCount, ...] = ()
    incidents: tuple[Incident, ...] = ()
    totals: tuple[RankTotals, ...] | None = None  # per rank, ascending
    captures: tuple[Capture, ...] = ()  # profiler captures, in the order they were asked


def totals_of(steps: Sequence[StepRow]) -> tuple[RankTotals, ...]:
    """Per rank, what these step rows add up to (ascending by rank), a column at a
    time (a live view of thousands of ranks adds up hundreds of thousands of rows)."""
    by_rank: dict[int, list[StepRow]] = {}
    for row in steps:
        by_rank.setdefault(row[_RANK], []).append(row)
    out = []
    for rank in sorted(by_rank):
        rows = by_rank[rank]
        num_eval = column(rows, "num_eval")
        evals = _added((ms for ms, n in zip(column(rows, "eval_ms"), num_eval) if n))
        out.append(RankTotals(
            rank, len(rows), max(column(rows, "step")),
            {p.name: _added(map(float, ms_column(rows, p.name))) for p in TOTALED},
            evals, sum(num_eval), any(v is not None for v in column(rows, "peak_allocated_bytes"))))
    return tuple(out)


def _added(values: Iterable[float]) -> float:
    """0.0 plus each value in turn, at C speed (``sum`` of floats compensates its
    rounding from Python 3.12 on: the same rows would add up differently by version)."""
    return functools.reduce(operator.add, values, 0.0)


def rank_totals(run: RunData) -> dict[int, RankTotals]:
    """Rank -> its whole run's totals (from ``steps`` when the run carries none)."""
    totals = run.totals if run.totals is not None else totals_of(run.steps)
    return {t.rank: t for t in totals}
