"""System and process gauges from the report's System and Process sections (live views, page).

Runs wherever a snapshot is built (launcher, collector, offline analysis). A
gauge is a label, a fill (0..100, None: text only) and the text to show; the
terminal and the page draw the same gauges. Live, the sections cover the
recent window (about the last minute of samples); in final_summary.html, the run.
More than ``WIDE_RANKS`` rows of one kind (nodes, GPUs, ranks) become three: the
median, p90 and worst of each gauge, each naming whose it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from traceml.diagnosis.finding import format_bytes
from traceml.diagnosis.process import RankProcess
from traceml.diagnosis.system import GpuSummary, NodeSystem
from traceml.records import Json
from traceml.report.model import Report
from traceml.report.page.spread import is_wide


@dataclass(frozen=True)
class Gauge:
    """One bar: ``pct`` is its fill (None: no bar), ``text`` the value shown."""

    label: str
    pct: float | None
    text: str
    order: float | None = None  # what a spread ranks by when there is no fill (temperature)
    low_is_worse: bool = False  # GPU utilization: an idle GPU is the one to look at

    @property
    def rank_by(self) -> float | None:
        """Higher is worse: what a spread across rows orders them by."""
        value = self.pct if self.pct is not None else self.order
        return None if value is None else -value if self.low_is_worse else value


@dataclass(frozen=True)
class GaugeRow:
    """The gauges of one node (``n0 host``) or one rank (``r3``)."""

    name: str
    gauges: tuple[Gauge, ...]


def node_gauges(report: Report) -> tuple[GaugeRow, ...]:
    """Per node: host CPU average and RAM peak; then one row per GPU the job uses:
    utilization, peak memory used and peak temperature."""
    hosts, gpus = [], []
    for node in report.system.ranks:
        assert isinstance(node, NodeSystem)
        hosts.append(GaugeRow(f"n{node.node_rank} {node.host}", (
            Gauge("CPU", node.cpu_avg_pct, f"{node.cpu_avg_pct:.0f}%"),
            Gauge("RAM", node.ram_peak_pct, f"{node.ram_peak_pct:.0f}%"))))
        gpus.append([GaugeRow(f"n{node.node_rank} gpu{gpu.index}", tuple(_gpu_gauges(gpu)))
                     for gpu in node.gpus])
    if is_wide(len(hosts)) or is_wide(sum(map(len, gpus))):
        return (*spread_rows(hosts, "nodes"), *spread_rows([g for n in gpus for g in n], "GPUs"))
    return tuple(row for host, node_gpus in zip(hosts, gpus) for row in (host, *node_gpus))


def _gpu_gauges(gpu: GpuSummary) -> Iterable[Gauge]:
    if gpu.util_avg_pct is not None:
        yield Gauge("util", gpu.util_avg_pct, f"{gpu.util_avg_pct:.0f}%", low_is_worse=True)
    if gpu.mem_used_peak_bytes is not None and gpu.mem_total_bytes:
        yield Gauge("mem", 100.0 * gpu.mem_used_peak_bytes / gpu.mem_total_bytes,
                    _of(gpu.mem_used_peak_bytes, gpu.mem_total_bytes))
    if gpu.temp_peak_c is not None:
        yield Gauge("temp", None, f"{gpu.temp_peak_c:.0f}C", order=gpu.temp_peak_c)


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
    return spread_rows(rows, "ranks") if is_wide(len(rows)) else tuple(rows)


def spread_rows(rows: Sequence[GaugeRow], what: str) -> tuple[GaugeRow, ...]:
    """``what median``, ``what p90`` and ``what worst``: per gauge label, the gauge of the
    row at that place when the rows are ordered by it (lower median; ties: the first row),
    its text followed by the row's name (``r17``, ``n3 gpu2``)."""
    labels = list(dict.fromkeys(g.label for row in rows for g in row.gauges))
    picked: dict[str, list[Gauge]] = {"median": [], "p90": [], "worst": []}
    for label in labels:
        ranked = sorted(((g.rank_by, i, g, _owner(row.name)) for i, row in enumerate(rows)
                         for g in row.gauges if g.label == label and g.rank_by is not None),
                        key=lambda item: (item[0], -item[1]))
        if not ranked:
            continue
        last = len(ranked) - 1
        for place, index in (("median", last // 2), ("p90", math.ceil(0.9 * last)),
                             ("worst", last)):
            _, _, gauge, owner = ranked[index]
            picked[place].append(dataclasses.replace(gauge, text=f"{gauge.text} {owner}"))
    return tuple(GaugeRow(f"{what} {place}", tuple(gauges)) for place, gauges in picked.items()
                 if gauges)


def _owner(name: str) -> str:
    """``r17`` of ``r17 n2``; a node's host is left out, a GPU keeps its node."""
    first, _, rest = name.partition(" ")
    return name if rest.startswith("gpu") else first


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
