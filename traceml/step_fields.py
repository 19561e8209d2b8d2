"""The step-field table: every column of a stored training step, the one place a step
column is declared (shared: agent-free leaf read by the collector, the store, the
records and the report).

A step of one rank is one row of :data:`STEP_FIELDS` values, in table order: the
store's step blocks (their JSON rows, the steps view) and their bounded read with
its checks (`admits_column`), the relay's columns, the row every reader gets back
(`traceml.records.StepRow`),
the recorded-scenario JSON and the summary's per-rank columns (``reported``) all
derive from it.  Per-phase columns come from `traceml.phases`, so adding a phase
adds its columns here too.  Adding a column is a new entry (with the default a
store written before it reads as) plus the code that measures it.

Standard library and the phase table only.  Like :data:`traceml.phases.PHASES`,
the table is read when the modules that derive from it are imported: a test may
extend it before importing anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from traceml import phases

Value = int | float | str | bool | None
"""What a step column holds."""

MAX_STEP_MS = 1e12
"""The longest time a step column holds (31 years): beyond it, not a rank's."""

MAX_COUNT = float(2**62)
"""Beyond any count or byte size a run stores."""

MAX_RANKS = 1 << 17
"""Ranks a job can have (the wire's bound on a sender's rank)."""

MAX_SPANS = 8
"""Disjoint spans of collectives in flight a step stores (`collective_spans_ms`); a step
with more stores none, and its first launch, last completion and total still tell."""


@dataclass(frozen=True)
class StepField:
    """One column of a stored step."""

    name: str  # the column: store, relay, JSON
    kind: type[int] | type[float] | type[str] | type[bool]
    default: Value = 0  # what a store written before the column existed reads as
    optional: bool = False  # None: not measured
    low: float = 0.0  # bounds of a number a collector stores (of a text: its length)
    high: float = MAX_COUNT
    choices: tuple[str, ...] = ()  # a text column's values
    identity: bool = False  # who ran it (from the sender), not what the step measured
    reported: bool = False  # the summary gives each rank's distribution over its typical
    # steps (``ranks[*].<name>``, and median/worst in ``stats``); None: none measured
    sampled: bool = False  # measured on a sample of steps (CUDA's timed ones): a step's
    # None is left out of its distribution; otherwise, once any step measured it, 0

    @property
    def sql_type(self) -> str:
        return "TEXT" if self.kind is str else "REAL" if self.kind is float else "INTEGER"


def _time(name: str, default: float | None = 0.0, optional: bool = False,
          reported: bool = False, sampled: bool = False) -> StepField:
    """A duration in ms."""
    return StepField(name, float, default, optional, high=MAX_STEP_MS, reported=reported,
                     sampled=sampled)


STEP_FIELDS: tuple[StepField, ...] = (
    StepField("rank", int, 0, high=MAX_RANKS - 1, identity=True),
    StepField("restart", int, 0, identity=True),  # the rank's attempt that ran it
    StepField("node_rank", int, 0, low=-1, identity=True),
    StepField("step", int, 0),  # 0-based per rank
    StepField("t_begin", float, None, optional=True, high=1e11),  # unix seconds
    _time("total_ms"),  # boundary to boundary
    _time("wait_ms"),  # total - every phase, clamped >= 0
    *(_time(p.column) for p in phases.PHASES),  # exclusive time per phase
    *(StepField(p.count_column, int, 0) for p in phases.PHASES),  # calls per phase
    StepField("num_skipped", int, 0),  # GradScaler steps that skipped the update
    StepField("rss_bytes", int, None, optional=True),  # host RSS of the rank at step end
    StepField("peak_allocated_bytes", int, None, optional=True),  # CUDA peaks this step
    StepField("peak_reserved_bytes", int, None, optional=True),
    # GPU time per GPU-timed phase (CUDA events); None off CUDA, or an untimed step; the
    # wait on collectives (DDP's) is reported on its own
    *(_time(p.gpu_column, default=None, optional=True, reported=p.waits, sampled=True)
      for p in phases.gpu_timed()),
    # any collective in flight, exposed or hidden behind compute; None: none timed
    _time("collective_ms", default=None, optional=True, reported=True),
    # the first collective's launch after the step's begin (the rank's arrival at it, on
    # its clock); None: no collective timed
    _time("collective_at_ms", default=None, optional=True),
    _time("collective_end_ms", default=None, optional=True),  # ...the last one's completion
    StepField("samples", int, None, optional=True),  # in the batches the step consumed
    StepField("tokens", int, None, optional=True),  # token ids in them (2-D integer batches)
    StepField("flops", float, None, optional=True, high=1e30),  # of the step, counted once
    StepField("flops_counted", bool, False, high=1),  # the FLOP counter ran in it: left out
    StepField("boundary", str, phases.STEP_BOUNDARIES[0], choices=phases.STEP_BOUNDARIES),
    _time("eval_ms"),  # evaluation wall time that ended where this step began
    StepField("num_eval", int, 0),  # ...in this many passes
    # Where each phase ran (the timeline), ms from the step's begin: its first call's begin
    # and end, and its last call's when it ran more than once; None: it did not run
    *(_time(c, default=None, optional=True) for p in phases.PHASES for c in p.place_columns),
    # CUDA: a DDP model's all-reduces in flight on the GPU, from its first bucket's
    # gradients being ready to the end of DDP's wait; None off CUDA or an untimed step
    _time("gpu_collective_ms", default=None, optional=True, reported=True, sampled=True),
    # The disjoint spans collectives were in flight, when there was a gap between them:
    # "begin-end,begin-end" in ms from the step's begin (to the µs), at most `MAX_SPANS`;
    # None: no gap (collective_at_ms to collective_end_ms is the span), more spans than
    # that, a step merged from micro-batches whose earlier ones had collectives in flight,
    # or none timed (`traceml.records.in_flight_spans`)
    StepField("collective_spans_ms", str, None, optional=True, high=MAX_SPANS * 40),
    # the first collective launched at or after the last backward call began (the rank's
    # arrival at backward's first collective: DDP's first gradient bucket; with gradient
    # accumulation, the last micro-batch's); None: no collective there, or none timed
    _time("gradient_at_ms", default=None, optional=True),
)
"""Every column of a stored step, in storage order; identity columns first."""


def names() -> tuple[str, ...]:
    """Every column name, in table order."""
    return tuple(f.name for f in STEP_FIELDS)


def measured() -> tuple[StepField, ...]:
    """The columns a step measured (after the identity columns), as a relay forwards them."""
    return tuple(f for f in STEP_FIELDS if not f.identity)


def field(name: str) -> StepField:
    """The column called ``name``; KeyError when the table has none."""
    for f in STEP_FIELDS:
        if f.name == name:
            return f
    raise KeyError(f"no step column {name!r}")


def reported() -> tuple[StepField, ...]:
    """The columns the summary gives per rank."""
    return tuple(f for f in STEP_FIELDS if f.reported)


def admits(f: StepField, value: object) -> bool:
    """Whether ``value`` is one a collector stores in column ``f``: its type, its
    bounds (NaN is out of every bound), None only where optional."""
    if value is None:
        return f.optional
    if f.kind is str:
        return (isinstance(value, str) and len(value) <= f.high
                and (not f.choices or value in f.choices))
    if f.kind is not float and type(value) is float:
        return False
    return type(value) in (int, float, bool) and f.low <= value <= f.high  # type: ignore[operator]


def admits_column(f: StepField, column: Sequence[Value]) -> bool:
    """``all(admits(f, v) for v in column)`` for a column parsed from JSON (so no NaN),
    checked as a column, a few passes in C, so a summary's window costs no loop per
    value: of a number column, its sum (which fails on a None, a text or a list, and
    is an integer only when every value is one or a bool), its least value and,
    unless the sum already bounds every value, its greatest; where the sum fails,
    the same of the values that are not None."""
    if f.kind is not str:
        try:
            total = sum(column)  # type: ignore[arg-type]
        except TypeError:  # a None (or worse): the values that are not None, below
            pass
        except OverflowError:  # an integer past floats
            return False
        else:
            return _admits_numbers(f, column, total)
    present: Sequence[Value] = column
    num_none = column.count(None)
    if num_none:
        if not f.optional:
            return False
        if num_none == len(column):
            return True
        present = [v for v in column if v is not None]
    if not present:
        return True
    try:
        if f.kind is str:
            if f.choices:
                return set(present) <= set(f.choices)
            return (set(map(type, present)) == {str}
                    and max(map(len, present)) <= f.high)  # type: ignore[arg-type]
        total = sum(present)  # type: ignore[arg-type]
    except (TypeError, OverflowError):  # a text, a list, an object; an integer past floats
        return False
    return _admits_numbers(f, present, total)


def _admits_numbers(f: StepField, values: Sequence[Value], total: float) -> bool:
    """Whether numbers that sum to ``total`` are all ones ``f`` admits."""
    if not values:
        return True
    if f.kind is not float and type(total) is not int:  # a float in an integer column
        return False
    if not f.low <= min(values) <= f.high:  # type: ignore[type-var,operator]
        return False
    # values at or above 0 sum to at least the greatest (the margin: the sum's rounding)
    return (f.low >= 0 and total <= f.high / 2) or max(values) <= f.high  # type: ignore[type-var,operator]
