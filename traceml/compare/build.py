"""Build the comparison: two summaries -> tables, notes and verdict (offline analysis).

Runs in the offline-analysis process. Pure: the same two summaries and
threshold always give the same :class:`~traceml.compare.model.Comparison`.
Table values are the summaries' stats medians: the median over ranks of each
rank's value (over nodes or GPUs for System). Rows that neither side measured
are left out, so a CPU-only pair shows no GPU rows and is not INCONCLUSIVE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from traceml import phases
from traceml.compare.model import (
    CaptureCompare,
    Comparison,
    DiagnosisRow,
    MetricRow,
    OperatorChange,
    RunInfo,
    SectionCompare,
)
from traceml.compare.summary import RunSummary, SectionData
from traceml.compare.throughput import speed_change
from traceml.compare.verdict import memory_change, step_signal, time_change, verdict
from traceml.report.model import SECTION_NAMES, SECTION_TITLES

SECTION_ROWS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "step_time": (*((p.column, p.label) for p in (phases.TOTAL, *phases.stacked(),
                                                   phases.COMPUTE)),
                  ("collective_ms", "Collectives in flight")),
    "step_memory": (
        ("peak_allocated_bytes", "Peak allocated"), ("peak_reserved_bytes", "Peak reserved"),
        ("pressure_pct", "Device pressure"), ("allocated_growth_bytes", "Allocated growth"),
        ("rss_peak_bytes", "Host RSS peak"), ("rss_growth_bytes", "Host RSS growth"),
    ),
    "process": (
        ("cpu_avg_pct", "CPU avg"), ("cpu_share_pct", "CPU share of cores"),
        ("rss_peak_bytes", "RSS peak"), ("rss_pct", "RSS of host RAM"),
        ("device_allocated_peak_bytes", "Device allocated peak"),
        ("device_reserved_peak_bytes", "Device reserved peak"),
        ("device_reserved_pct", "Device reserved"),
    ),
    "system": (
        ("cpu_avg_pct", "Host CPU avg"), ("ram_peak_pct", "Host RAM peak"),
        ("gpu_util_avg_pct", "GPU util avg"), ("gpu_temp_peak_c", "GPU temp peak"),
        ("gpu_mem_used_peak_bytes", "GPU memory used peak"),
        ("gpu_power_avg_w", "GPU power avg"),
    ),
    "throughput": (
        ("samples_per_step", "Samples per step"), ("samples_per_s", "Samples/s"),
        ("tokens_per_step", "Tokens per step"), ("tokens_per_s", "Tokens/s"),
        ("achieved_tflops", "Achieved TFLOP/s"), ("mfu_pct", "MFU"),
    ),
}
"""The rows of each section's table, as (stats key, display name), in order."""

COMMUNICATION_ROWS = {*(p.column for p in phases.PHASES if p.collective), "collective_ms"}
"""Rows left out when neither side spent time in collectives (a single-process pair)."""

PRESSURE_KINDS = {"CPU_PRESSURE", "RAM_PRESSURE"}
"""System findings that make step times of that run depend on other load."""

NOISE_ROWS = (("step_p50_ms", "Median step (p50)"), ("step_iqr_ms", "Step spread (IQR)"))
"""Step Time rows that show what the noise gate saw (medians over ranks)."""


def compare_runs(a: RunSummary, b: RunSummary, threshold_pct: float) -> Comparison:
    """Compare B against A with a step-time threshold of ``threshold_pct`` % of A's step."""
    time = speed_change(time_change(a.section("step_time"), b.section("step_time"), threshold_pct),
                        a.section("throughput"), b.section("throughput"))
    unfit = unfit_for_speed(a, b)
    if unfit is not None:
        time = dataclasses.replace(time, direction="unknown", why=unfit)
    memory = memory_change(a.section("step_memory"), b.section("step_memory"))
    sections = tuple(section_compare(name, a.section(name), b.section(name))
                     for name in SECTION_NAMES)
    return Comparison(run_info(a), run_info(b), threshold_pct, verdict(time, memory), time,
                      memory, sections, notes(a, b), capture_compare(a, b))


COMPARED_OPERATORS = 8


def capture_compare(a: RunSummary, b: RunSummary) -> CaptureCompare | None:
    """B's capture against A's: the same finding kind's when both have one, else each
    run's first; None unless both runs have a capture that profiled a step."""
    if not a.captures or not b.captures:
        return None
    kinds = {c.trigger for c in a.captures}
    cb = next((c for c in b.captures if c.trigger in kinds), b.captures[0])
    ca = next((c for c in a.captures if c.trigger == cb.trigger), a.captures[0])
    rows = []
    for name in {*ca.operators, *cb.operators}:
        oa, ob = ca.operators.get(name), cb.operators.get(name)
        collective = any(o[3] for o in (oa, ob) if o is not None)
        rows.append(OperatorChange(name, collective, oa[0] if oa else None,
                                   ob[0] if ob else None, oa[2] if oa else "",
                                   ob[2] if ob else ""))
    rows.sort(key=lambda r: (r.delta_ms is None, r.communication, -abs(r.delta_ms or 0.0)))
    return CaptureCompare(ca.capture_id, cb.capture_id, ca.label, cb.label,
                          tuple(rows[:COMPARED_OPERATORS]))


BROKEN_ENDINGS = ("stalled", "crashed", "failed", "launcher_lost")
"""Endings whose step times do not say how fast the job trains."""


def unfit_for_speed(a: RunSummary, b: RunSummary) -> str | None:
    """Why step time must not be compared: a side stalled or crashed (None: it may)."""
    for side, run in (("A", a), ("B", b)):
        if run.ending in BROKEN_ENDINGS:
            return (f"step time is not compared: {side} {run.ending} ({run.ending_label}), so "
                    "its steps do not say how fast the job trains; fix that and compare again")
    return None


def run_info(run: RunSummary) -> RunInfo:
    """How the report names one side."""
    return RunInfo(run.label, run.path, run.session_id, run.schema_version, run.world_size,
                   run.device, run.partial)


def section_compare(name: str, a: SectionData | None, b: SectionData | None) -> SectionCompare:
    """One section's diagnosis row and table; INCONCLUSIVE when a side lacks it."""
    diagnosis = DiagnosisRow(a.diagnosis_label if a else None, b.diagnosis_label if b else None)
    rows = tuple(row for row in metric_rows(name, a, b)
                 if (row.a or row.b) or (row.key not in COMMUNICATION_ROWS
                                          and (row.a is not None or row.b is not None)))
    return SectionCompare(name, SECTION_TITLES[name], diagnosis, rows, inconclusive_why(a, b))


def metric_rows(name: str, a: SectionData | None, b: SectionData | None) -> list[MetricRow]:
    """Every row of a section's table, measured or not."""
    rows = [MetricRow(key, label, _stat(a, key), _stat(b, key))
            for key, label in SECTION_ROWS[name]]
    if name == "step_time":
        rows += noise_rows(a, b)
    return rows


def noise_rows(a: SectionData | None, b: SectionData | None) -> list[MetricRow]:
    """The median step (p50) and step-to-step spread (IQR) of each side."""
    sig_a = step_signal(a.rank_dists.get("total_ms", ())) if a else None
    sig_b = step_signal(b.rank_dists.get("total_ms", ())) if b else None
    p50, iqr = NOISE_ROWS
    return [
        MetricRow(p50[0], p50[1], sig_a.p50_ms if sig_a else None,
                  sig_b.p50_ms if sig_b else None),
        MetricRow(iqr[0], iqr[1], sig_a.iqr_ms if sig_a else None,
                  sig_b.iqr_ms if sig_b else None),
    ]


def _stat(section: SectionData | None, key: str) -> float | None:
    return section.stats.get(key) if section is not None else None


def inconclusive_why(a: SectionData | None, b: SectionData | None) -> str | None:
    """Why a section cannot be compared; None when it can."""
    absent = [side for side, s in (("A", a), ("B", b)) if s is None]
    if absent:
        return f"missing in {' and '.join(absent)}"
    unmeasured = [side for side, s in (("A", a), ("B", b)) if s is not None and not s.measured]
    if unmeasured:
        return f"not measured in {' and '.join(unmeasured)}"
    return None


def notes(a: RunSummary, b: RunSummary) -> tuple[str, ...]:
    """What differs between the runs beyond their numbers, one sentence each."""
    out = []
    if a.schema_version != b.schema_version:
        out.append(f"Summary schema versions differ (A {a.schema_version}, B "
                   f"{b.schema_version}); values only one side has are not compared.")
    if a.world_size != b.world_size:
        out.append(f"World sizes differ (A {_ranks(a.world_size)}, B {_ranks(b.world_size)}); "
                   "values are medians over ranks.")
    if a.device != b.device:
        out.append(f"Devices differ (A {a.device or 'unknown'}, B {b.device or 'unknown'}).")
    for side, run in (("A", a), ("B", b)):
        if run.partial:
            out.append(f"{side} is a partial run (it ended early or a rank never reported); "
                       "its numbers cover only what ran.")
        if _busy_machine(run):
            out.append(f"{side}'s machine was under CPU or RAM pressure (see System); other "
                       "load there can move step times.")
        if run.problems:
            out.append(f"{side} does not fully match summary schema {run.schema_version} "
                       f"({len(run.problems)} problems, first: {run.problems[0]}).")
    return tuple(out)


def _busy_machine(run: RunSummary) -> bool:
    system = run.section("system")
    return system is not None and bool(PRESSURE_KINDS & set(system.finding_kinds))


def _ranks(num: int | None) -> str:
    if num is None:
        return "unknown"
    return f"{num} rank" if num == 1 else f"{num} ranks"
