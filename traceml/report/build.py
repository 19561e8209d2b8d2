"""Build the report: stored run -> window -> rules -> sections -> Report (offline analysis).

Runs in the offline-analysis process (end of run, `traceml report`,
`traceml.summary()`). Pure: the same RunData always gives the same Report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

from traceml import step_fields
from traceml.diagnosis.arrival import ArrivalSkew, arrival_line, arrival_skew, cited
from traceml.diagnosis.ending import diagnose_ending
from traceml.diagnosis.finding import Finding, severity_rank
from traceml.diagnosis.operators import capture_results
from traceml.diagnosis.process import diagnose_process, rank_process
from traceml.diagnosis.stats import Located, MetricStat, Worst, located_stat, metric_stat
from traceml.diagnosis.step_loop import boundary_rule, evaluation_by_rank, input_source
from traceml.diagnosis.step_memory import diagnose_step_memory, rank_memory
from traceml.diagnosis.step_time import (
    PHASES,
    SHARES,
    RankStepTimes,
    diagnose_step_time,
    rank_step_times,
)
from traceml.diagnosis.stragglers import STRAGGLER_KINDS
from traceml.diagnosis.system import diagnose_system, node_system
from traceml.diagnosis.throughput import (
    RankThroughput,
    diagnose_throughput,
    job_throughput,
    rank_throughput,
)
from traceml.diagnosis.window import (
    Scope,
    StepWindow,
    capture_spans,
    in_span,
    missing,
    select_window,
)
from traceml.records import RunData, rank_totals
from traceml.report.model import SCHEMA_VERSION, Primary, Report, Section

PRIMARY_ORDER = ("step_time", "step_memory", "system", "process", "throughput")
"""Section priority when two sections' diagnoses are equally severe."""


def build_report(run: RunData, summary_window_rows: int,
                 placed: StepWindow | None = None) -> Report:
    """The end-of-run report of ``run`` over its last ``summary_window_rows`` aligned
    steps; ``placed``: that window, as the read already placed it over ``run``
    (`traceml.diagnosis.window.PlacingWindow`)."""
    node_of = rank_nodes(run)
    window = placed if placed is not None else _report_window(run, summary_window_rows)
    sections = {
        "step_time": step_time_section(run, window, node_of),
        "step_memory": step_memory_section(run, window, node_of),
        "process": process_section(run, window),
        "system": system_section(run, window),
    }
    sections["step_time"] = fit_advice(sections["step_time"], sections["system"])
    sections["throughput"] = throughput_section(run, window, node_of, sections["step_time"])
    ending = diagnose_ending(run)
    primary = (Primary("ending", ending.headline) if ending.headline is not None
               else choose_primary(sections))
    return Report(SCHEMA_VERSION, run.meta, primary, **sections, ending=ending,
                  captures=capture_results(run.captures))


def step_time_alone(run: RunData, summary_window_rows: int) -> Section:
    """Step Time's section as :func:`build_report` makes it, less the advice fitted to
    the other sections (`fit_advice`): for a caller after its findings alone, at a
    fraction of the whole report's cost (the live capture planner)."""
    return step_time_section(run, _report_window(run, summary_window_rows), rank_nodes(run))


def _report_window(run: RunData, summary_window_rows: int) -> StepWindow:
    return select_window(run.steps, summary_window_rows, run.meta.world_size,
                         capture_spans(run.captures))


SATURATED_INPUT_NEXT = (
    "The host's CPUs are already saturated (see System), so more DataLoader workers will "
    "not help: pre-process or cache the data once, use a cheaper decode or format, or run "
    "fewer ranks or workers per host.")


NO_LOADER_INPUT_NEXT = (
    "Batches are built on the training thread (no DataLoader): build them ahead in a "
    "DataLoader with num_workers > 0 (a Dataset around get_batch), or in a background "
    "thread that keeps the next batches ready; use pinned memory and non_blocking copies.")


def fit_advice(step_time: Section, system: Section) -> Section:
    """Step Time's advice, fitted to what else was found: on a host whose CPUs are
    saturated, INPUT-BOUND's "raise num_workers" would make it worse; a loop
    without a DataLoader has no workers to raise."""
    if any(f.kind == "CPU_PRESSURE" for f in system.findings):
        advice = SATURATED_INPUT_NEXT
    elif step_time.scope.input_source not in (None, "dataloader"):
        advice = NO_LOADER_INPUT_NEXT
    else:
        return step_time
    findings = tuple(dataclasses.replace(f, next=advice)
                     if f.kind == "INPUT_BOUND" else f for f in step_time.findings)
    return dataclasses.replace(step_time, findings=findings)


def choose_primary(sections: Mapping[str, Section]) -> Primary:
    """The most severe actionable diagnosis (ties: PRIMARY_ORDER); else the first measured
    diagnosis in PRIMARY_ORDER (a healthy run: Step Time's COMPUTE-BOUND or BALANCED)."""
    actionable = [name for name in PRIMARY_ORDER if sections[name].diagnosis.actionable]
    if actionable:
        name = min(actionable, key=lambda n: severity_rank(sections[n].diagnosis.severity))
    else:
        measured = [n for n in PRIMARY_ORDER if sections[n].diagnosis.measured]
        name = measured[0] if measured else PRIMARY_ORDER[0]
    return Primary(name, sections[name].diagnosis)


def rank_nodes(run: RunData) -> dict[int, int]:
    """Global rank -> node rank, from the run's node list, then from process samples."""
    node_of = {sample.rank: sample.node_rank for sample in run.process}
    node_of.update({rank: node.node_rank for node in run.meta.nodes for rank in node.ranks})
    return node_of


def _num_nodes(run: RunData) -> int:
    seen = {n.node_rank for n in run.meta.nodes} | {s.node_rank for s in run.system}
    return len(seen)


def _unmeasured_steps_why(run: RunData) -> str:
    if run.meta.mode == "watch":
        return "traceml watch records System and Process telemetry only, no steps."
    if not rank_totals(run):
        return "No training step was recorded."
    return "No step was completed by every rank after warm-up."


def step_time_section(run: RunData, window: StepWindow, node_of: Mapping[int, int]) -> Section:
    """Step Time: per-rank phase distributions, shares and stragglers."""
    times = rank_step_times(window, node_of)
    rows = [times[r] for r in sorted(times)]
    stats = {f"{phase}_ms": _rank_stat(rows, _phase_mean(phase)) for phase in PHASES}
    for f in step_fields.reported():
        stats[f.name] = _rank_stat(rows, _reported_mean(f.name))
    for phase in SHARES:
        stats[f"{phase}_share_pct"] = _rank_stat(rows, _phase_share(phase))
    stats["gpu_ms"] = _rank_stat(rows, lambda t: t.gpu_ms.mean if t.gpu_ms is not None else None)
    stats.update(_evaluation_stats(run, node_of))
    findings = diagnose_step_time(times, _unmeasured_steps_why(run), run.meta.device)
    arrival = arrival_skew(window, {n.node_rank: n.clock for n in run.meta.nodes})
    scope = dataclasses.replace(
        window.scope(node_of, _num_nodes(run)),
        step_boundary=boundary_rule(r for rank_rows in window.by_rank.values() for r in rank_rows),
        input_source=input_source(window.by_rank))
    return Section("step_time", cite_arrival(findings, arrival), scope, stats, tuple(rows),
                   arrival=arrival)


def cite_arrival(findings: Iterable[Finding], arrival: ArrivalSkew | None) -> tuple[Finding, ...]:
    """A straggler finding whose rank came last into the step's collectives at most steps
    says so, with the arrivals in its evidence."""
    out = []
    for f in findings:
        if arrival is not None and f.kind in STRAGGLER_KINDS and f.ranks and cited(
                arrival, f.ranks[0]):
            f = dataclasses.replace(
                f, why=f"{f.why} {arrival_line(arrival)}",
                evidence={**f.evidence, "arrival_skew_ms": arrival.median_ms,
                          "arrival_last_pct": arrival.last_pct})
        out.append(f)
    return tuple(out)


def _reported_mean(name: str) -> Callable[[RankStepTimes], float | None]:
    def mean(t: RankStepTimes) -> float | None:
        dist = t.reported.get(name)
        return dist.mean if dist is not None else None
    return mean


def _evaluation_stats(run: RunData, node_of: Mapping[int, int]) -> dict[str, MetricStat | None]:
    """Evaluation kept out of the steps over the whole run: wall time and passes
    per rank (median and worst); None when no rank evaluated."""
    evals = evaluation_by_rank(rank_totals(run).values())
    located = [(Located(ms, rank, node_of.get(rank)), Located(n, rank, node_of.get(rank)))
               for rank, (ms, n) in sorted(evals.items())]
    return {"eval_total_ms": metric_stat([ms for ms, _ in located]),
            "num_eval": metric_stat([n for _, n in located])}


def _phase_mean(phase: str) -> Callable[[RankStepTimes], float]:
    return lambda times: times.mean(phase)


def _phase_share(phase: str) -> Callable[[RankStepTimes], float | None]:
    return lambda times: times.share_pct(phase)


def throughput_section(run: RunData, window: StepWindow, node_of: Mapping[int, int],
                       step_time: Section) -> Section:
    """Throughput: samples/s, tokens/s, achieved TFLOP/s and MFU per rank and for the job;
    LOW MFU with advice fitting Step Time's findings."""
    per_rank = rank_throughput(window, node_of, run.flop_counts, run.meta.peak_tflops)
    rows = [per_rank[r] for r in sorted(per_rank)]
    window_rows = [row for rank_rows in window.by_rank.values() for row in rank_rows]
    job = job_throughput(per_rank, window_rows, run.flop_counts, run.meta)
    stats = {key: _rank_stat(rows, _field(key), worst="min") for key in THROUGHPUT_STATS}
    kinds = [f.kind for f in step_time.findings if f.actionable]  # a borderline one is no cause
    findings = diagnose_throughput(per_rank, job, kinds, _unmeasured_steps_why(run))
    return Section("throughput", findings, window.scope(node_of, _num_nodes(run)), stats,
                   tuple(rows), job)


THROUGHPUT_STATS = ("samples_per_step", "tokens_per_step", "samples_per_s", "tokens_per_s",
                    "achieved_tflops", "mfu_pct")
"""Throughput's per-rank stats (worst: the lowest rank)."""


def _field(name: str) -> Callable[[RankThroughput], float | None]:
    return lambda row: getattr(row, name)


def step_memory_section(run: RunData, window: StepWindow, node_of: Mapping[int, int]) -> Section:
    """Step Memory: per-rank peaks, capacity pressure and creep over the window."""
    capacity: dict[int, int] = {}
    for sample in run.process:
        if sample.device_total_bytes is not None:
            capacity[sample.rank] = max(capacity.get(sample.rank, 0), sample.device_total_bytes)
    mem = rank_memory(window, capacity, node_of)
    rows = [mem[r] for r in sorted(mem)]
    stats = {
        "peak_allocated_bytes": _rank_stat(rows, lambda m: m.peak_allocated_bytes),
        "peak_reserved_bytes": _rank_stat(rows, lambda m: m.peak_reserved_bytes),
        "pressure_pct": _rank_stat(rows, lambda m: m.pressure_pct),
        "allocated_growth_bytes": _rank_stat(rows, lambda m: m.allocated_growth_bytes),
        "rss_peak_bytes": _rank_stat(rows, lambda m: m.rss_peak_bytes),
        "rss_growth_bytes": _rank_stat(rows, lambda m: m.rss_growth_bytes),
    }
    findings = diagnose_step_memory(mem, _unmeasured_steps_why(run))
    return Section("step_memory", findings, window.scope(node_of, _num_nodes(run)), stats,
                   tuple(rows))


def process_section(run: RunData, window: StepWindow) -> Section:
    """Process: per-rank CPU, RSS and device memory over the samples."""
    samples = in_span(run.process, window.time_span())
    procs = rank_process(samples)
    rows = list(procs.values())
    stats = {
        "cpu_avg_pct": _rank_stat(rows, lambda p: p.cpu_avg_pct),
        "cpu_share_pct": _rank_stat(rows, lambda p: p.cpu_share_pct),
        "rss_peak_bytes": _rank_stat(rows, lambda p: p.rss_peak_bytes),
        "rss_pct": _rank_stat(rows, lambda p: p.rss_pct),
        "device_allocated_peak_bytes": _rank_stat(rows, lambda p: p.device_allocated_peak_bytes),
        "device_reserved_peak_bytes": _rank_stat(rows, lambda p: p.device_reserved_peak_bytes),
        "device_reserved_pct": _rank_stat(rows, lambda p: p.reserved_pct),
    }
    ranks = tuple(procs)
    scope = Scope(window.window_rows, ranks, missing(ranks, run.meta.world_size),
                  tuple(sorted({p.node_rank for p in rows})), _num_nodes(run),
                  num_samples=len(samples))
    return Section("process", diagnose_process(procs), scope, stats, tuple(rows))


def system_section(run: RunData, window: StepWindow) -> Section:
    """System: per-node CPU, RAM and the job's GPUs over the samples."""
    samples = in_span(run.system, window.time_span())
    nodes = node_system(samples, {n.node_rank: n.ranks for n in run.meta.nodes})
    rows = list(nodes.values())
    gpus = [g for node in rows for g in node.gpus]
    stats = {
        "cpu_avg_pct": _node_stat((n.cpu_avg_pct, n.node_rank, None) for n in rows),
        "ram_peak_pct": _node_stat((n.ram_peak_pct, n.node_rank, None) for n in rows),
        "gpu_util_avg_pct": _node_stat(((g.util_avg_pct, g.node_rank, g.index) for g in gpus),
                                       worst="min"),
        "gpu_temp_peak_c": _node_stat((g.temp_peak_c, g.node_rank, g.index) for g in gpus),
        "gpu_mem_used_peak_bytes": _node_stat(
            (g.mem_used_peak_bytes, g.node_rank, g.index) for g in gpus),
        "gpu_power_avg_w": _node_stat((g.power_avg_w, g.node_rank, g.index) for g in gpus),
    }
    ranks = tuple(sorted(r for n in rows for r in n.ranks))
    scope = Scope(window.window_rows, ranks, missing(ranks, run.meta.world_size),
                  tuple(nodes), _num_nodes(run), num_samples=len(samples))
    return Section("system", diagnose_system(nodes), scope, stats, tuple(rows))


class _Ranked(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def node_rank(self) -> int | None: ...


_Row = TypeVar("_Row", bound=_Ranked)


def _rank_stat(rows: Sequence[_Row], value: Callable[[_Row], float | None],
               worst: Worst = "max") -> MetricStat | None:
    """Median and worst (highest, or lowest) of a per-rank value; None when no rank
    measured it."""
    kept = [(v, row) for row in rows if (v := value(row)) is not None]
    return located_stat([v for v, _ in kept],
                        lambda i: Located(kept[i][0], kept[i][1].rank, kept[i][1].node_rank), worst)


def _node_stat(
    values: Iterable[tuple[float | None, int, int | None]], worst: Worst = "max"
) -> MetricStat | None:
    """Median and worst of per-node (or per-GPU) values given as (value, node, gpu)."""
    located = [Located(v, node=node, gpu=gpu) for v, node, gpu in values if v is not None]
    return metric_stat(located, worst)

