"""Step Memory rules: creep, high pressure, imbalance (offline analysis).

Runs in the offline-analysis process. Works on per-rank summaries of the step
window's per-step memory: device peak allocated/reserved (CUDA) and host RSS.
Device capacity comes from the process samples. Creep is a steady trend over
the window: a least-squares line that rises by at least max(64 MiB, 10 % of
where it started) and explains most of the variance (R² >= 0.8); device creep
uses peak *allocated* (live tensors: a leak), host creep uses RSS and also runs
on CPU-only runs. The medians of the window's thirds are kept for the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from traceml.diagnosis import thresholds
from traceml.diagnosis.finding import (
    Finding,
    format_bytes,
    format_ranks,
    grade,
    not_measured,
    order_findings,
)
from traceml.diagnosis.stats import Trend, pct, thirds, trend
from traceml.diagnosis.window import StepWindow
from traceml.records import column

Thirds = tuple[float, float, float]


@dataclass(frozen=True)
class RankMemory:
    """One rank's step memory over the window; None where not measured."""

    rank: int
    node_rank: int | None
    num_steps: int
    peak_allocated_bytes: int | None  # max over the window
    peak_reserved_bytes: int | None
    rss_peak_bytes: int | None
    device_total_bytes: int | None  # capacity, from process samples
    allocated_thirds_bytes: Thirds | None  # medians of early/middle/late thirds
    rss_thirds_bytes: Thirds | None
    allocated_trend: Trend | None = None  # the line through the window's steps
    rss_trend: Trend | None = None

    @property
    def pressure_pct(self) -> float | None:
        """Peak reserved as % of the device's capacity."""
        if self.peak_reserved_bytes is None or self.device_total_bytes is None:
            return None
        return pct(self.peak_reserved_bytes, self.device_total_bytes)

    @property
    def allocated_growth_bytes(self) -> float | None:
        """Peak allocated's trend from the window's first step to its last (creep or
        not); None when too few steps."""
        return self.allocated_trend.growth if self.allocated_trend is not None else None

    @property
    def rss_growth_bytes(self) -> float | None:
        """Host RSS's trend over the window; None when not measured or too few steps."""
        return self.rss_trend.growth if self.rss_trend is not None else None


def rank_memory(
    window: StepWindow, capacity: Mapping[int, int], node_of: Mapping[int, int]
) -> dict[int, RankMemory]:
    """Per-rank memory summaries of the window; ranks without window steps left out."""
    out = {}
    for rank, rows in window.by_rank.items():
        if not rows:
            continue
        allocated, reserved, rss = (
            [v for v in column(rows, name) if v is not None]
            for name in ("peak_allocated_bytes", "peak_reserved_bytes", "rss_bytes"))
        out[rank] = RankMemory(
            rank=rank,
            node_rank=node_of.get(rank),
            num_steps=len(rows),
            peak_allocated_bytes=max(allocated, default=None),
            peak_reserved_bytes=max(reserved, default=None),
            rss_peak_bytes=max(rss, default=None),
            device_total_bytes=capacity.get(rank),
            allocated_thirds_bytes=_thirds_of(allocated),
            rss_thirds_bytes=_thirds_of(rss),
            allocated_trend=_trend_of(allocated),
            rss_trend=_trend_of(rss),
        )
    return out


def _thirds_of(values: Sequence[int]) -> Thirds | None:
    return thirds([float(v) for v in values]) if len(values) >= thresholds.CREEP_MIN_STEPS else None


def _trend_of(values: Sequence[int]) -> Trend | None:
    if len(values) < thresholds.CREEP_MIN_STEPS:
        return None
    return trend([float(v) for v in values])


def creep_growth(line: Trend | None) -> float | None:
    """The trend's growth when memory rose steadily (R² >= 0.8) by at least
    max(64 MiB, 10 % of where it started); else None."""
    if line is None:
        return None
    floor = max(thresholds.CREEP_MIN_GROWTH_BYTES,
                thresholds.CREEP_MIN_GROWTH_PCT * max(line.start, 0.0) / 100)
    steady = line.r2 >= thresholds.CREEP_MIN_R2
    return line.growth if steady and line.growth >= floor else None


def device_creep(mem: Mapping[int, RankMemory]) -> list[Finding]:
    """MEMORY CREEP: device peak allocated rises steadily over the window."""
    if all(m.peak_allocated_bytes is None for m in mem.values()):
        return [_device_not_measured()]
    trends = {r: m.allocated_trend for r, m in mem.items()}
    return _creep(trends, "MEMORY_CREEP", "MEMORY CREEP", "device peak allocated",
                  "Look for tensors kept across steps (losses or outputs stored without "
                  ".detach()/.item(), growing caches); compare torch.cuda.memory_snapshot() "
                  "early and late.")


def rss_creep(mem: Mapping[int, RankMemory]) -> list[Finding]:
    """HOST RSS CREEP: a rank's host RSS rises steadily over the window (CPU runs too)."""
    if all(m.rss_peak_bytes is None for m in mem.values()):
        return [not_measured("HOST RSS", "Host RSS per step was not recorded.")]
    trends = {r: m.rss_trend for r, m in mem.items()}
    return _creep(trends, "RSS_CREEP", "HOST RSS CREEP", "host RSS",
                  "Look for Python objects that accumulate across steps (metric lists, cached "
                  "batches, tensors kept on CPU); tracemalloc snapshots show what grows.")


def _creep(
    trends: Mapping[int, Trend | None], kind: str, label: str, what: str, next_step: str
) -> list[Finding]:
    growth = {r: g for r, t in trends.items() if (g := creep_growth(t)) is not None}
    if not growth:
        return []
    ranks = tuple(sorted(growth, key=lambda r: -growth[r]))
    line = trends[ranks[0]]
    assert line is not None
    end = line.start + line.growth
    why = (
        f"r{ranks[0]} {what} rose steadily over the window's {line.num_steps} steps, "
        f"{format_bytes(line.start)} -> {format_bytes(end)} (+{format_bytes(line.growth)}, "
        f"+{pct(line.growth, line.start) or 0.0:.0f}%; {format_bytes(line.slope_per_step)} "
        f"per step, R^2 {line.r2:.2f})"
    )
    why += f"; also {format_ranks(ranks[1:])}." if len(ranks) > 1 else "."
    evidence = {"rank": ranks[0], "start_bytes": line.start, "end_bytes": end,
                "growth_bytes": line.growth, "slope_bytes_per_step": line.slope_per_step,
                "r2": line.r2}
    return [Finding(kind, label, "warn", why, next_step, ranks, evidence)]


def high_pressure(mem: Mapping[int, RankMemory]) -> list[Finding]:
    """HIGH PRESSURE: device peak reserved >= 92 % of capacity (crit >= 97 %)."""
    if absent := _capacity_not_measured(mem):
        return absent
    pressure = {r: p for r, m in mem.items() if (p := m.pressure_pct) is not None}
    hot = sorted((r for r, p in pressure.items() if p >= thresholds.PRESSURE_WARN_PCT),
                 key=lambda r: -pressure[r])
    if not hot:
        return []
    worst = mem[hot[0]]
    severity = grade(pressure[hot[0]], thresholds.PRESSURE_WARN_PCT, thresholds.PRESSURE_CRIT_PCT)
    why = (
        f"r{worst.rank} device peak reserved reached {format_bytes(worst.peak_reserved_bytes or 0)}"
        f" of {format_bytes(worst.device_total_bytes or 0)} ({pressure[hot[0]]:.1f}%)."
    )
    next_step = ("Close to out-of-memory: lower the batch size, use bf16, activation "
                 "checkpointing, or shard states with FSDP/ZeRO.")
    evidence = {"rank": worst.rank, "pressure_pct": pressure[hot[0]],
                "peak_reserved_bytes": worst.peak_reserved_bytes,
                "device_total_bytes": worst.device_total_bytes}
    return [Finding("HIGH_PRESSURE", "HIGH PRESSURE", severity or "warn", why, next_step,
                    tuple(hot), evidence)]


def skew_pct(mem: Mapping[int, RankMemory]) -> float | None:
    """(max - min) / max of the ranks' peak reserved, in %; None when not measured."""
    peaks = [m.peak_reserved_bytes for m in mem.values() if m.peak_reserved_bytes is not None]
    return pct(max(peaks) - min(peaks), max(peaks)) if peaks else None


def imbalance(mem: Mapping[int, RankMemory]) -> list[Finding]:
    """IMBALANCE: ranks' peak reserved differ >= 20 % while the heaviest is >= 30 % full."""
    if absent := _capacity_not_measured(mem):
        return absent
    skew = skew_pct(mem)
    sized = [m for m in mem.values() if m.peak_reserved_bytes is not None]
    if skew is None or len(sized) < 2 or skew < thresholds.IMBALANCE_SKEW_PCT:
        return []
    heavy = max(sized, key=lambda m: m.peak_reserved_bytes or 0)
    light = min(sized, key=lambda m: m.peak_reserved_bytes or 0)
    if (heavy.pressure_pct or 0.0) < thresholds.IMBALANCE_MIN_PRESSURE_PCT:
        return []
    why = (
        f"Peak reserved differs {skew:.1f}% across ranks: r{heavy.rank} "
        f"{format_bytes(heavy.peak_reserved_bytes or 0)} vs r{light.rank} "
        f"{format_bytes(light.peak_reserved_bytes or 0)} ({heavy.pressure_pct or 0.0:.1f}% full)."
    )
    next_step = ("Even out per-rank work: rank-0-only logging, evaluation or checkpoint "
                 "gathering, uneven batch shapes, or uneven FSDP sharding.")
    evidence = {"rank": heavy.rank, "skew_pct": skew,
                "pressure_pct": heavy.pressure_pct or 0.0}
    return [Finding("IMBALANCE", "IMBALANCE", "warn", why, next_step, (heavy.rank,), evidence)]


def _device_not_measured() -> Finding:
    return not_measured("DEVICE MEMORY", "Device memory was not measured (no CUDA device).")


def _capacity_not_measured(mem: Mapping[int, RankMemory]) -> list[Finding]:
    if all(m.peak_reserved_bytes is None for m in mem.values()):
        return [_device_not_measured()]
    if all(m.device_total_bytes is None for m in mem.values()):
        return [not_measured("DEVICE CAPACITY", "Device memory capacity was not recorded.")]
    return []


def balanced(mem: Mapping[int, RankMemory]) -> Finding:
    """BALANCED: no Step Memory rule fired."""
    worst = max(mem.values(), key=lambda m: m.peak_reserved_bytes or -1)
    if worst.peak_reserved_bytes is not None:
        skew = skew_pct(mem) or 0.0
        fill = f" ({worst.pressure_pct:.1f}%)" if worst.pressure_pct is not None else ""
        why = (f"No pressure, imbalance or creep: worst peak reserved "
               f"{format_bytes(worst.peak_reserved_bytes)}{fill} on r{worst.rank}, "
               f"skew {skew:.1f}%.")
        evidence: dict[str, float | None] = {"skew_pct": skew, "pressure_pct": worst.pressure_pct}
    else:
        top = max(mem.values(), key=lambda m: m.rss_peak_bytes or -1)
        why = (f"Host RSS did not creep (worst peak {format_bytes(top.rss_peak_bytes or 0)} "
               f"on r{top.rank}); device memory not measured.")
        evidence = {}
    return Finding("BALANCED", "BALANCED", "info", why, "Nothing to fix in memory.", (), evidence)


def diagnose_step_memory(
    mem: Mapping[int, RankMemory],
    unmeasured_why: str = "No step was completed by every rank after warm-up.",
) -> tuple[Finding, ...]:
    """The Step Memory findings, diagnosis first (most severe first; else BALANCED)."""
    if not mem:
        return (not_measured("STEP MEMORY", unmeasured_why),)
    if all(m.peak_reserved_bytes is None and m.rss_peak_bytes is None for m in mem.values()):
        return (not_measured("STEP MEMORY", "Neither device memory nor host RSS was recorded."),)
    found = high_pressure(mem) + device_creep(mem) + rss_creep(mem) + imbalance(mem)
    return order_findings(found, balanced(mem))
