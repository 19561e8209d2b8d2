"""Process rules: GPU memory reserved overhang, high RSS, high CPU (offline analysis).

Runs in the offline-analysis process. Works on per-rank summaries of the
process samples (CPU %, RSS, device memory), taken every sample interval.
A rank's CPU share is its node's CPUs divided by the ranks sampled on that node.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from traceml.diagnosis import thresholds
from traceml.diagnosis.finding import (
    Finding,
    format_bytes,
    grade,
    not_measured,
    order_findings,
)
from traceml.diagnosis.stats import pct
from traceml.records import ProcessSample


@dataclass(frozen=True)
class RankProcess:
    """One rank's process telemetry over the samples; None where not measured."""

    rank: int
    node_rank: int
    num_samples: int
    cpu_avg_pct: float  # 100 = one core
    cpu_peak_pct: float
    num_cpus: int  # of the node
    num_node_ranks: int  # ranks sampled on the node
    rss_peak_bytes: int
    host_ram_total_bytes: int
    device_allocated_peak_bytes: int | None
    device_reserved_peak_bytes: int | None
    device_total_bytes: int | None

    @property
    def cpu_share_pct(self) -> float | None:
        """Average CPU as % of this rank's cores (node CPUs / ranks on the node)."""
        return pct(self.cpu_avg_pct * self.num_node_ranks, 100.0 * self.num_cpus)

    @property
    def rss_pct(self) -> float | None:
        """Peak RSS as % of the host's RAM."""
        return pct(self.rss_peak_bytes, self.host_ram_total_bytes)

    @property
    def reserved_pct(self) -> float | None:
        """Peak reserved device memory as % of the device."""
        if self.device_reserved_peak_bytes is None or self.device_total_bytes is None:
            return None
        return pct(self.device_reserved_peak_bytes, self.device_total_bytes)

    @property
    def reserved_ratio(self) -> float | None:
        """Peak reserved / peak allocated device memory (the allocator's overhang)."""
        reserved, allocated = self.device_reserved_peak_bytes, self.device_allocated_peak_bytes
        if reserved is None or allocated is None:
            return None
        return reserved / allocated if allocated > 0 else (float("inf") if reserved else 1.0)


def rank_process(samples: Iterable[ProcessSample]) -> dict[int, RankProcess]:
    """Per-rank summaries of the process samples."""
    per_rank: dict[int, list[ProcessSample]] = {}
    for sample in samples:
        per_rank.setdefault(sample.rank, []).append(sample)
    node_ranks: dict[int, set[int]] = {}
    for rank, rows in per_rank.items():
        node_ranks.setdefault(rows[-1].node_rank, set()).add(rank)
    return {rank: _summarize(rank, rows, node_ranks) for rank, rows in sorted(per_rank.items())}


def _summarize(rank: int, rows: list[ProcessSample], node_ranks: dict[int, set[int]]) -> RankProcess:
    last = rows[-1]
    return RankProcess(
        rank=rank,
        node_rank=last.node_rank,
        num_samples=len(rows),
        cpu_avg_pct=statistics.fmean(s.cpu_pct for s in rows),
        cpu_peak_pct=max(s.cpu_pct for s in rows),
        num_cpus=last.num_cpus,
        num_node_ranks=len(node_ranks[last.node_rank]),
        rss_peak_bytes=max(s.rss_bytes for s in rows),
        host_ram_total_bytes=last.host_ram_total_bytes,
        device_allocated_peak_bytes=_peak(s.device_allocated_bytes for s in rows),
        device_reserved_peak_bytes=_peak(s.device_reserved_bytes for s in rows),
        device_total_bytes=_peak(s.device_total_bytes for s in rows),
    )


def _peak(values: Iterable[int | None]) -> int | None:
    return max((v for v in values if v is not None), default=None)


def reserved_overhang(procs: Mapping[int, RankProcess]) -> list[Finding]:
    """GPU MEMORY RESERVED OVERHANG: peak reserved >= 1.5x peak allocated and >= 30 %
    of the device: the caching allocator holds memory no tensor uses."""
    if all(p.reserved_ratio is None or p.reserved_pct is None for p in procs.values()):
        return [not_measured("GPU MEMORY", "Device memory of the ranks was not measured.")]
    hit = [p for p in procs.values()
           if (p.reserved_ratio or 0.0) >= thresholds.OVERHANG_RATIO
           and (p.reserved_pct or 0.0) >= thresholds.OVERHANG_MIN_RESERVED_PCT]
    if not hit:
        return []
    hit.sort(key=lambda p: -(p.reserved_ratio or 0.0))
    worst = hit[0]
    ratio, reserved_pct = worst.reserved_ratio or 0.0, worst.reserved_pct or 0.0
    why = (
        f"r{worst.rank} reserved {format_bytes(worst.device_reserved_peak_bytes or 0)} "
        f"({reserved_pct:.1f}% of the device) against a peak allocated of "
        f"{format_bytes(worst.device_allocated_peak_bytes or 0)}"
    )
    why += f" ({ratio:.2f}x)." if math.isfinite(ratio) else "."
    next_step = ("Fragmentation or cached blocks: try PYTORCH_CUDA_ALLOC_CONF="
                 "expandable_segments:True, keep tensor shapes steady, or empty_cache() after eval.")
    evidence = {"rank": worst.rank, "reserved_ratio": ratio, "reserved_pct": reserved_pct}
    return [Finding("GPU_MEMORY_RESERVED_OVERHANG", "GPU MEMORY RESERVED OVERHANG", "warn", why,
                    next_step, tuple(p.rank for p in hit), evidence)]


def high_rss(procs: Mapping[int, RankProcess]) -> list[Finding]:
    """HIGH RSS: a rank's peak RSS >= 80 % of host RAM (crit >= 95 %)."""
    hit = sorted((p for p in procs.values() if (p.rss_pct or 0.0) >= thresholds.HIGH_RSS_WARN_PCT),
                 key=lambda p: -(p.rss_pct or 0.0))
    if not hit:
        return []
    worst, worst_pct = hit[0], hit[0].rss_pct or 0.0
    severity = grade(worst_pct, thresholds.HIGH_RSS_WARN_PCT, thresholds.HIGH_RSS_CRIT_PCT)
    why = (f"r{worst.rank} RSS peaked at {format_bytes(worst.rss_peak_bytes)} of "
           f"{format_bytes(worst.host_ram_total_bytes)} host RAM ({worst_pct:.1f}%).")
    next_step = ("Cut host memory: fewer or lighter DataLoader workers, memory-mapped or "
                 "shared datasets instead of a copy per rank.")
    return [Finding("HIGH_RSS", "HIGH RSS", severity or "warn", why, next_step,
                    tuple(p.rank for p in hit), {"rank": worst.rank, "rss_pct": worst_pct})]


def high_cpu(procs: Mapping[int, RankProcess]) -> list[Finding]:
    """HIGH CPU: a rank's average CPU >= 95 % of its cores (node CPUs / ranks on the node)."""
    hit = sorted((p for p in procs.values()
                  if (p.cpu_share_pct or 0.0) >= thresholds.HIGH_CPU_SHARE_PCT),
                 key=lambda p: -(p.cpu_share_pct or 0.0))
    if not hit:
        return []
    worst, share = hit[0], hit[0].cpu_share_pct or 0.0
    cores = worst.num_cpus / worst.num_node_ranks
    why = (f"r{worst.rank} averaged {worst.cpu_avg_pct:.0f}% CPU, {share:.1f}% of its "
           f"{cores:g}-core share of the node.")
    next_step = ("The rank saturates its CPUs: move preprocessing into DataLoader workers, "
                 "set torch threads (OMP_NUM_THREADS) to the cores per rank, or add CPUs.")
    evidence = {"rank": worst.rank, "cpu_avg_pct": worst.cpu_avg_pct, "cpu_share_pct": share}
    return [Finding("HIGH_CPU", "HIGH CPU", "warn", why, next_step,
                    tuple(p.rank for p in hit), evidence)]


def normal(procs: Mapping[int, RankProcess]) -> Finding:
    """NORMAL: no Process rule fired."""
    cpu = max(procs.values(), key=lambda p: p.cpu_avg_pct)
    rss = max(procs.values(), key=lambda p: p.rss_peak_bytes)
    device = [p for p in procs.values() if p.device_reserved_peak_bytes is not None]
    measured = "CPU, RSS and device memory" if device else "CPU and RSS"
    why = (f"{measured} looked normal: CPU avg worst {cpu.cpu_avg_pct:.0f}% "
           f"(r{cpu.rank}), RSS peak {format_bytes(rss.rss_peak_bytes)} (r{rss.rank})")
    if device:
        top = max(device, key=lambda p: p.device_reserved_peak_bytes or 0)
        why += (f", device memory reserved peak "
                f"{format_bytes(top.device_reserved_peak_bytes or 0)} (r{top.rank})")
    why += "."
    return Finding("NORMAL", "NORMAL", "info", why, "Nothing to fix in the processes.")


def diagnose_process(procs: Mapping[int, RankProcess]) -> tuple[Finding, ...]:
    """The Process findings, diagnosis first (most severe first; else NORMAL)."""
    if not procs:
        return (not_measured("PROCESS", "No process samples were recorded."),)
    found = high_rss(procs) + reserved_overhang(procs) + high_cpu(procs)
    return order_findings(found, normal(procs))
