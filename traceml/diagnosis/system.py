"""System rules: CPU and RAM pressure, low GPU utilization, high GPU temperature (offline analysis).

Runs in the offline-analysis process. Works on per-node summaries of the
system samples. Only GPUs present in the samples are judged: the sampler
already restricts them to the job's GPUs (CUDA_VISIBLE_DEVICES honoured), so
a job without GPU samples gets "not measured", never a guess.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from traceml.diagnosis import thresholds
from traceml.diagnosis.finding import Finding, Severity, grade, not_measured, order_findings
from traceml.records import SystemSample


@dataclass(frozen=True)
class GpuSummary:
    """One GPU of one node over the samples; None where not measured."""

    node_rank: int
    index: int
    num_samples: int
    util_avg_pct: float | None
    temp_peak_c: float | None
    mem_used_peak_bytes: int | None
    mem_total_bytes: int | None
    power_avg_w: float | None


@dataclass(frozen=True)
class NodeSystem:
    """One node's host telemetry over the samples."""

    node_rank: int
    host: str
    ranks: tuple[int, ...]  # global ranks on this node (from the run's metadata)
    num_samples: int
    cpu_avg_pct: float
    cpu_peak_pct: float
    ram_avg_pct: float
    ram_peak_pct: float
    ram_total_bytes: int
    gpus: tuple[GpuSummary, ...]


def node_system(
    samples: Iterable[SystemSample], ranks_of: Mapping[int, tuple[int, ...]]
) -> dict[int, NodeSystem]:
    """Per-node summaries of the system samples; ``ranks_of`` maps node rank to its ranks."""
    per_node: dict[int, list[SystemSample]] = {}
    for sample in samples:
        per_node.setdefault(sample.node_rank, []).append(sample)
    return {node: _summarize(node, rows, ranks_of.get(node, ()))
            for node, rows in sorted(per_node.items())}


def _summarize(node: int, rows: list[SystemSample], ranks: tuple[int, ...]) -> NodeSystem:
    per_gpu: dict[int, list[tuple[float | None, float | None, int | None, int | None,
                                  float | None]]] = {}
    for row in rows:
        for g in row.gpus:
            values = (g.util_pct, g.temp_c, g.mem_used_bytes, g.mem_total_bytes, g.power_w)
            per_gpu.setdefault(g.index, []).append(values)
    gpus = tuple(
        GpuSummary(node, index, len(vals), _mean(v[0] for v in vals), _max(v[1] for v in vals),
                   _max(v[2] for v in vals), _max(v[3] for v in vals), _mean(v[4] for v in vals))
        for index, vals in sorted(per_gpu.items())
    )
    return NodeSystem(
        node_rank=node,
        host=rows[-1].host,
        ranks=ranks,
        num_samples=len(rows),
        cpu_avg_pct=statistics.fmean(r.cpu_pct for r in rows),
        cpu_peak_pct=max(r.cpu_pct for r in rows),
        ram_avg_pct=statistics.fmean(r.ram_pct for r in rows),
        ram_peak_pct=max(r.ram_pct for r in rows),
        ram_total_bytes=rows[-1].ram_total_bytes,
        gpus=gpus,
    )


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


_Num = TypeVar("_Num", int, float)


def _max(values: Iterable[_Num | None]) -> _Num | None:
    return max((v for v in values if v is not None), default=None)


def cpu_pressure(nodes: Mapping[int, NodeSystem]) -> list[Finding]:
    """CPU PRESSURE: host CPU average >= 85 %."""
    hot = _over(nodes, {n: s.cpu_avg_pct for n, s in nodes.items()}, thresholds.CPU_PRESSURE_PCT)
    if not hot:
        return []
    worst = nodes[hot[0]]
    why = f"n{worst.node_rank} ({worst.host}) host CPU averaged {worst.cpu_avg_pct:.1f}%."
    next_step = ("The host's CPUs are saturated: fewer DataLoader workers or ranks per node, "
                 "preprocess offline, or look for other jobs on the host.")
    return [_node_finding("CPU_PRESSURE", "CPU PRESSURE", "warn", why, next_step, nodes, hot,
                          {"node": worst.node_rank, "cpu_avg_pct": worst.cpu_avg_pct})]


def ram_pressure(nodes: Mapping[int, NodeSystem]) -> list[Finding]:
    """RAM PRESSURE: host RAM peak >= 85 % (crit >= 95 %)."""
    hot = _over(nodes, {n: s.ram_peak_pct for n, s in nodes.items()}, thresholds.RAM_PRESSURE_PCT)
    if not hot:
        return []
    worst = nodes[hot[0]]
    severity = grade(worst.ram_peak_pct, thresholds.RAM_PRESSURE_PCT,
                     thresholds.RAM_PRESSURE_CRIT_PCT)
    why = f"n{worst.node_rank} ({worst.host}) host RAM peaked at {worst.ram_peak_pct:.1f}%."
    next_step = ("Host RAM is nearly full: fewer DataLoader workers or a smaller prefetch_factor, "
                 "memory-mapped datasets shared by the ranks, or other jobs off the host.")
    return [_node_finding("RAM_PRESSURE", "RAM PRESSURE", severity or "warn", why, next_step,
                          nodes, hot,
                          {"node": worst.node_rank, "ram_peak_pct": worst.ram_peak_pct})]


def low_gpu_util(nodes: Mapping[int, NodeSystem]) -> list[Finding]:
    """LOW GPU UTIL: a job GPU's average utilization < 30 %."""
    gpus = [g for s in nodes.values() for g in s.gpus if g.util_avg_pct is not None]
    if not gpus:
        return [_gpu_not_measured("GPU UTIL")]
    low = sorted((g for g in gpus if (g.util_avg_pct or 0.0) < thresholds.LOW_GPU_UTIL_PCT),
                 key=lambda g: g.util_avg_pct or 0.0)
    if not low:
        return []
    worst = low[0]
    why = (f"n{worst.node_rank} gpu{worst.index} utilization averaged "
           f"{worst.util_avg_pct or 0.0:.1f}% ({len(low)} of {len(gpus)} GPUs below "
           f"{thresholds.LOW_GPU_UTIL_PCT:.0f}%).")
    next_step = ("The GPUs idle much of the time: see Step Time for input or wait, raise the "
                 "batch size or DataLoader workers.")
    evidence = {"node": worst.node_rank, "gpu": worst.index,
                "util_avg_pct": worst.util_avg_pct, "num_low_gpus": len(low)}
    return [_node_finding("LOW_GPU_UTIL", "LOW GPU UTIL", "warn", why, next_step, nodes,
                          _unique(g.node_rank for g in low), evidence)]


def high_gpu_temp(nodes: Mapping[int, NodeSystem]) -> list[Finding]:
    """HIGH GPU TEMP: a job GPU's peak temperature >= 85 C."""
    gpus = [g for s in nodes.values() for g in s.gpus if g.temp_peak_c is not None]
    if not gpus:
        return [_gpu_not_measured("GPU TEMP")]
    hot = sorted((g for g in gpus if (g.temp_peak_c or 0.0) >= thresholds.HIGH_GPU_TEMP_C),
                 key=lambda g: -(g.temp_peak_c or 0.0))
    if not hot:
        return []
    worst = hot[0]
    why = (f"n{worst.node_rank} gpu{worst.index} reached {worst.temp_peak_c or 0.0:.1f}C "
           f"({len(hot)} of {len(gpus)} GPUs at or above {thresholds.HIGH_GPU_TEMP_C:.0f}C).")
    next_step = ("Hot GPUs throttle their clocks and turn into stragglers: check cooling and "
                 "airflow, and clocks with nvidia-smi -q -d PERFORMANCE.")
    evidence = {"node": worst.node_rank, "gpu": worst.index,
                "temp_peak_c": worst.temp_peak_c}
    return [_node_finding("HIGH_GPU_TEMP", "HIGH GPU TEMP", "warn", why, next_step, nodes,
                          _unique(g.node_rank for g in hot), evidence)]


def _over(nodes: Mapping[int, NodeSystem], values: Mapping[int, float], limit: float) -> list[int]:
    """Node ranks with a value >= limit, worst first."""
    return sorted((n for n in nodes if values[n] >= limit), key=lambda n: -values[n])


def _unique(values: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(values))


def _node_finding(
    kind: str, label: str, severity: Severity, why: str, next_step: str,
    nodes: Mapping[int, NodeSystem], hit: Sequence[int], evidence: Mapping[str, float | None],
) -> Finding:
    ranks = tuple(r for n in hit for r in nodes[n].ranks)
    return Finding(kind, label, severity, why, next_step, ranks, evidence, tuple(hit))


def _gpu_not_measured(what: str) -> Finding:
    return not_measured(what, "No GPU samples: the job used no GPU, or NVML was unavailable.")


def normal(nodes: Mapping[int, NodeSystem]) -> Finding:
    """NORMAL: no System rule fired."""
    cpu = max(s.cpu_avg_pct for s in nodes.values())
    ram = max(s.ram_peak_pct for s in nodes.values())
    utils = [g.util_avg_pct for s in nodes.values() for g in s.gpus if g.util_avg_pct is not None]
    sampled = any(s.gpus for s in nodes.values())
    measured = "CPU, RAM and GPU" if utils else "CPU and RAM"
    why = f"{measured} showed no system pressure: CPU avg {cpu:.1f}%, RAM peak {ram:.1f}%"
    if utils:
        why += f", lowest GPU util {min(utils):.1f}%."
    else:  # MIG slices and some vGPUs report memory and temperature but no utilization
        why += " (GPUs sampled, but none reported utilization)." if sampled else \
            " (no GPU was sampled)."
    return Finding("NORMAL", "NORMAL", "info", why, "Nothing to fix on the hosts.")


def diagnose_system(nodes: Mapping[int, NodeSystem]) -> tuple[Finding, ...]:
    """The System findings, diagnosis first (most severe first; else NORMAL)."""
    if not nodes:
        return (not_measured("SYSTEM", "No system samples were recorded."),)
    found = (ram_pressure(nodes) + cpu_pressure(nodes) + high_gpu_temp(nodes)
             + low_gpu_util(nodes))
    return order_findings(found, normal(nodes))
