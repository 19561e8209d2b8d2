"""The report model every renderer draws from: Report, Section, Primary (offline analysis).

Runs in the offline-analysis process. One :class:`Report` per run, built by
:func:`traceml.report.build.build_report`; text, JSON (and later HTML and the
live views) render this same object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from traceml.diagnosis.arrival import ArrivalSkew
from traceml.diagnosis.ending import Ending
from traceml.diagnosis.finding import Finding
from traceml.diagnosis.operators import CaptureResult
from traceml.diagnosis.process import RankProcess
from traceml.diagnosis.stats import MetricStat
from traceml.diagnosis.step_memory import RankMemory
from traceml.diagnosis.step_time import RankStepTimes
from traceml.diagnosis.system import NodeSystem
from traceml.diagnosis.throughput import JobThroughput, RankThroughput
from traceml.diagnosis.window import Scope
from traceml.records import RunMeta

SCHEMA_VERSION = "1.8"  # 1.8: step_time gpu_communication_ms, gpu_collective_ms; 1.7: meta.nodes[].clock,
# step_time.arrival; 1.6: captures (profiler captures' operators); 1.5: meta.exports;
# 1.4: launcher_lost; 1.3: hook phase, straggler steadiness; 1.2: ending, ...
"""Version of final_summary.json; bump the major part on incompatible changes."""

RankRow = RankStepTimes | RankMemory | RankProcess | NodeSystem | RankThroughput
"""A per-rank row of a section (per node for System)."""

SECTION_NAMES = ("step_time", "step_memory", "process", "system", "throughput")
SECTION_TITLES: Mapping[str, str] = {
    "step_time": "Step Time",
    "step_memory": "Step Memory",
    "process": "Process",
    "system": "System",
    "throughput": "Throughput",
    "ending": "Ending",  # not a section: how the run ended (`Report.ending`), told first
}


@dataclass(frozen=True)
class Section:
    """One report section: findings (diagnosis first), scope, stats and rows."""

    name: str  # one of SECTION_NAMES
    findings: tuple[Finding, ...]  # never empty; the first is the diagnosis
    scope: Scope
    stats: Mapping[str, MetricStat | None]  # fixed keys per section; None = not measured
    ranks: tuple[RankRow, ...]  # per rank, ascending (System: per node)
    job: JobThroughput | None = None  # Throughput only: the job's sums and sources
    # Step Time only: the arrivals at each step's collectives (None: not measured)
    arrival: ArrivalSkew | None = None

    def __post_init__(self) -> None:
        assert self.findings, f"section {self.name} has no finding"

    @property
    def title(self) -> str:
        """Display name, e.g. "Step Time"."""
        return SECTION_TITLES[self.name]

    @property
    def diagnosis(self) -> Finding:
        """The section's first finding."""
        return self.findings[0]


@dataclass(frozen=True)
class Primary:
    """The finding the verdict line shows, and the section it comes from
    (``"ending"`` when it is how the run ended: stalled, crashed)."""

    section: str
    finding: Finding


@dataclass(frozen=True)
class Report:
    """The end-of-run summary of one run."""

    schema_version: str
    meta: RunMeta
    primary: Primary
    step_time: Section
    step_memory: Section
    process: Section
    system: Section
    throughput: Section
    ending: Ending
    captures: tuple[CaptureResult, ...] = ()  # profiler captures, in the order asked

    @property
    def duration_s(self) -> float:
        """Wall time of the run, launch to end."""
        return max(0.0, self.meta.ended_at - self.meta.started_at)

    def section(self, name: str) -> Section:
        """A section by its JSON name."""
        found: Section = getattr(self, name)
        return found

    @property
    def sections(self) -> tuple[Section, ...]:
        """The sections in JSON order (step_time, step_memory, process, system, throughput)."""
        return tuple(self.section(name) for name in SECTION_NAMES)
