"""System and process gauges from the report's System and Process sections (live views, page).

Runs wherever a snapshot is built (launcher, collector, offline analysis). A
gauge is a label, a fill (0..100, None: text only) and the text to show; the
terminal and the page draw the same gauges. Live, the sections cover the
recent window (about the last minute of samples); in final_summary.html, the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from traceml.diagnosis.finding import format_bytes
from traceml.diagnosis.process import RankProcess
from traceml.diagnosis.samples import Json
from traceml.diagnosis.system import GpuSummary, NodeSystem
from traceml.report.model import Report


@dataclass(frozen=True)
class Gauge:
    """One bar: ``pct`` is its fill (None: no bar), ``text`` the value shown."""

    label: str
    pct: float | None
    text: str


@dataclass(frozen=True)
class GaugeRow:
    """The gauges of one node (``n0 host``) or one rank (``r3``)."""

    name: str
    gauges: tuple[Gauge, ...]


def node_gauges(report: Report) -> tuple[GaugeRow, ...]:
    """Per node: host CPU average and RAM peak; then one row per GPU the job uses:
    utilization, peak memory used and peak temperature."""
    rows = []
    for node in report.system.ranks:
        assert isinstance(node, NodeSystem)
        rows.append(GaugeRow(f"n{node.node_rank} {node.host}", (
            Gauge("CPU", node.cpu_avg_pct, f"{node.cpu_avg_pct:.0f}%"),
            Gauge("RAM", node.ram_peak_pct, f"{node.ram_peak_pct:.0f}%"))))
        rows += [GaugeRow(f"n{node.node_rank} gpu{gpu.index}", tuple(_gpu_gauges(gpu)))
                 for gpu in node.gpus]
    return tuple(rows)


def _gpu_gauges(gpu: GpuSummary) -> Iterable[Gauge]:
    if gpu.util_avg_pct is not None:
        yield Gauge("util", gpu.util_avg_pct, f"{gpu.util_avg_pct:.0f}%")
    if gpu.mem_used_peak_bytes is not None and gpu.mem_total_bytes:
        yield Gauge("mem", 100.0 * gpu.mem_used_peak_bytes / gpu.mem_total_bytes,
                    _of(gpu.mem_used_peak_bytes, gpu.mem_total_bytes))
    if gpu.temp_peak_c is not None:
        yield Gauge("temp", None, f"{gpu.temp_peak_c:.0f}C")


def process_gauges(report: Report) -> tuple[GaugeRow, ...]:
    """Per rank: process CPU (text: 100% = one core; bar: of the rank's share of the
    node's cores), peak RSS and peak reserved device memory."""
    rows = []
    procs = [p for p in report.process.ranks if isinstance(p, RankProcess)]
    for proc in sorted(procs, key=lambda p: p.rank):
        share = proc.cpu_share_pct  # fill: of this rank's share of the node's cores
        gauges = [Gauge("CPU", share, f"{proc.cpu_avg_pct:.0f}%"),
                  Gauge("RSS", proc.rss_pct, format_bytes(proc.rss_peak_bytes))]
        reserved, total = proc.device_reserved_peak_bytes, proc.device_total_bytes
        if reserved is not None and total:
            gauges.append(Gauge("GPU mem", proc.reserved_pct, _of(reserved, total)))
        rows.append(GaugeRow(f"r{proc.rank} n{proc.node_rank}", tuple(gauges)))
    return tuple(rows)


def _of(used: float, total: float) -> str:
    """``10.0/80.0 GiB``, or ``512.0 MiB/80.0 GiB`` when the units differ."""
    part, whole = format_bytes(used), format_bytes(total)
    unit = whole.rpartition(" ")[2]
    return f"{part.removesuffix(' ' + unit)}/{whole}"


def gauges_to_json(rows: Iterable[GaugeRow]) -> list[Json]:
    """``[{"name": ..., "gauges": [{"label", "pct", "text"}]}]``."""
    return [{"name": row.name,
             "gauges": [{"label": g.label, "pct": None if g.pct is None else round(g.pct, 1),
                         "text": g.text} for g in row.gauges]} for row in rows]
