"""The compare model every renderer draws from: Comparison and its parts (offline analysis).

Runs in the offline-analysis process. :func:`traceml.compare.build.compare_runs`
builds one :class:`Comparison`; the text and JSON renderers draw this same
object. Deltas are always B - A.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Direction = Literal["better", "worse", "same", "unknown"]
"""How one signal moved from A to B; "unknown" when it could not be compared."""

VerdictLabel = Literal["IMPROVEMENT", "REGRESSION", "NO CHANGE", "MIXED", "INCONCLUSIVE"]

COMPARE_VERSION = "1.0"
"""Version of the compare JSON document."""


@dataclass(frozen=True)
class RunInfo:
    """One side of the comparison, as the report names it."""

    label: str
    path: str
    session_id: str | None
    schema_version: str
    world_size: int | None
    device: str | None
    partial: bool


@dataclass(frozen=True)
class MetricRow:
    """One table row: a metric of A and of B (None = not measured on that side)."""

    key: str  # the summary's stats key, e.g. "total_ms"
    label: str  # what the table shows, e.g. "Total step"
    a: float | None
    b: float | None

    @property
    def delta(self) -> float | None:
        """B - A; None unless both sides measured it."""
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def delta_pct(self) -> float | None:
        """(B - A) as % of A; None when A is 0 or either side is missing."""
        delta = self.delta
        if delta is None or self.a is None or self.a == 0:
            return None
        return 100.0 * delta / abs(self.a)


@dataclass(frozen=True)
class DiagnosisRow:
    """A section's diagnosis on both sides (labels; None when the section is missing)."""

    a: str | None
    b: str | None

    @property
    def changed(self) -> bool:
        """True when the two diagnoses differ."""
        return self.a != self.b


@dataclass(frozen=True)
class SectionCompare:
    """One section's table, or why the section could not be compared."""

    name: str  # JSON name, e.g. "step_time"
    title: str  # e.g. "Step Time"
    diagnosis: DiagnosisRow
    rows: tuple[MetricRow, ...]  # rows measured on at least one side
    inconclusive_why: str | None = None  # set when the section is INCONCLUSIVE

    @property
    def inconclusive(self) -> bool:
        """True when this part of the comparison could not be made."""
        return self.inconclusive_why is not None


@dataclass(frozen=True)
class TimeChange:
    """The noise-gated step-time signal: how the mean and median step moved, and whether
    that counts as a change (see :mod:`traceml.compare.verdict`)."""

    direction: Direction
    a_ms: float | None  # mean step, median over ranks
    b_ms: float | None
    a_p50_ms: float | None  # median step (p50), median over ranks
    b_p50_ms: float | None
    threshold_pct: float  # --threshold-pct
    noise_ms: float | None  # how far step-to-step noise can move a run's median step
    median_moved: bool  # the median step moved past both gates, like the mean
    phase: str | None  # the phase that moved most in the change's direction, e.g. "input"
    phase_delta_ms: float | None
    why: str  # one clause, e.g. "step time rose 15.0% (20.0 -> 23.0 ms per step), ..."

    @property
    def delta_ms(self) -> float | None:
        """B - A of the mean step."""
        return None if self.a_ms is None or self.b_ms is None else self.b_ms - self.a_ms

    @property
    def delta_pct(self) -> float | None:
        """(B - A) as % of A's mean step."""
        delta = self.delta_ms
        return None if delta is None or not self.a_ms else 100.0 * delta / self.a_ms

    @property
    def threshold_ms(self) -> float | None:
        """The relative threshold in ms of A's mean step."""
        return None if self.a_ms is None else self.threshold_pct / 100.0 * self.a_ms


@dataclass(frozen=True)
class MemoryChange:
    """The memory signal: peak growth between the runs, and creep appearing or going."""

    direction: Direction
    metric: str | None  # the stats key that decided, e.g. "rss_peak_bytes"
    label: str | None  # e.g. "peak host RSS"
    a_bytes: float | None
    b_bytes: float | None
    why: str  # one clause


@dataclass(frozen=True)
class OperatorChange:
    """One operator of B's capture against A's: the suspect rank's ms per step."""

    name: str
    communication: bool
    a_ms: float | None  # None: not among A's listed operators
    b_ms: float | None
    a_shapes: str
    b_shapes: str

    @property
    def delta_ms(self) -> float | None:
        """B - A; None when one capture does not list it (each lists its largest only)."""
        return None if self.a_ms is None or self.b_ms is None else self.b_ms - self.a_ms


@dataclass(frozen=True)
class CaptureCompare:
    """B's profiler capture against A's (both profiled a step): which operators moved."""

    a_id: str
    b_id: str
    a_label: str
    b_label: str
    operators: tuple[OperatorChange, ...]  # the largest moves first, collectives last


@dataclass(frozen=True)
class Verdict:
    """The answer: a label and a one-line why."""

    label: VerdictLabel
    why: str


@dataclass(frozen=True)
class Comparison:
    """Everything ``traceml compare`` reports about A and B."""

    a: RunInfo
    b: RunInfo
    threshold_pct: float
    verdict: Verdict
    time: TimeChange
    memory: MemoryChange
    sections: tuple[SectionCompare, ...]  # step_time, step_memory, process, system
    notes: tuple[str, ...]  # schema, topology, device and partial-run differences
    captures: CaptureCompare | None = None  # when both runs have a profiler capture
