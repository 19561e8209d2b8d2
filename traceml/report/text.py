"""final_summary.txt: the report as the boxed text card printed at the end (offline analysis).

Runs in the offline-analysis process. Layout of the seed README's example: a
header with the duration, the verdict and one next step, then one block per
section (System, Process, Step Time, Step Memory) with Diagnosis, Scope, Stats,
Ranks (Step Time) and Why. Long lines wrap inside the box. ASCII only.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

from traceml import phases
from traceml.diagnosis.finding import Finding, format_bytes, format_ranks
from traceml.diagnosis.stats import MetricStat
from traceml.report.model import Report, Section

CARD_ORDER = ("system", "process", "step_time", "step_memory")

_CARD_STATS: dict[str, tuple[tuple[str, str], ...]] = {
    "system": (("cpu_avg_pct", "CPU"), ("ram_peak_pct", "RAM peak"),
               ("gpu_util_avg_pct", "GPU util"), ("gpu_temp_peak_c", "GPU temp")),
    "process": (("cpu_avg_pct", "CPU avg"), ("rss_peak_bytes", "RSS peak"),
                ("device_reserved_pct", "GPU reserved")),
    "step_memory": (("peak_reserved_bytes", "peak reserved"), ("pressure_pct", "pressure"),
                    ("rss_peak_bytes", "RSS peak")),
}
"""Stats each non-Step-Time block shows, as (stats key, display name)."""

_STEP_PARTS = (phases.TOTAL, *phases.share_metrics())
"""The Step Time stats the card shows: total, the phases outside compute, compute, wait
(communication only when some rank spent time in it)."""


def render_text(report: Report, width: int = 78) -> str:
    """The boxed summary card, ``width`` characters wide, ending in a newline."""
    rule = "+" + "-" * (width - 2) + "+"
    text = width - 6
    header = f"TraceML Run Summary | duration {report.duration_s:.1f}s"
    if report.meta.partial:
        header += " | PARTIAL"
    body = ["", *_overview(report), ""]
    for name in CARD_ORDER:
        body += [*_section_lines(report.section(name), report), ""]
    lines = [rule, *_boxed([header], text, width), rule, *_boxed(body[:-1], text, width), rule]
    return "\n".join(lines) + "\n"


def _boxed(items: Sequence[str], text: int, width: int) -> list[str]:
    """Wrap each item to ``text`` columns (continuations indented) and frame it."""
    out = []
    for item in items:
        wrapped = textwrap.wrap(item, text, subsequent_indent="  ", break_on_hyphens=False)
        out += ["|  " + part.ljust(width - 4) + "|" for part in wrapped or [""]]
    return out


def _overview(report: Report) -> list[str]:
    meta, primary = report.meta, report.primary.finding
    verdict = f"Verdict: {primary.label}{_severity(primary)}"
    where = [report.section(report.primary.section).title]
    if primary.ranks:
        where.append(format_ranks(primary.ranks))
    lines = [f"{verdict} ({', '.join(where)})"]
    if primary.next:
        lines.append(f"Next: {primary.next}")
    exit_text = "running" if meta.exit_code is None else f"exit {meta.exit_code}"
    nodes = _count(report.system.scope.num_nodes, "node")
    lines.append(f"Run: {_count(meta.world_size, 'rank')} on {nodes} | "
                 f"{meta.device} | {exit_text} | session {meta.session_id}")
    if meta.partial:
        gone = f"; missing ranks {format_ranks(meta.missing_ranks)}" if meta.missing_ranks else ""
        lines.append(f"PARTIAL: the run ended before every rank finished{gone}.")
    dropped, gaps = meta.transport.get("dropped", 0), meta.transport.get("gaps", 0)
    if dropped or gaps:
        lines.append(f"Telemetry: {dropped} messages dropped, {gaps} sequence gaps; "
                     "some samples are missing.")
    if not meta.telemetry_complete:
        lines.append("Telemetry stopped early: the collector died or hung before the run "
                     "ended; the exit status and end time are the launcher's.")
    if meta.rejected:
        lines.append(rejected_line(meta.rejected))
    return lines


def rejected_line(rejected: Mapping[str, int]) -> str:
    """One line: what the collector refused (and stored rows skipped), by reason."""
    parts = ", ".join(f"{reason} {n}" for reason, n in
                      sorted(rejected.items(), key=lambda item: (-item[1], item[0])))
    return f"Rejected: {sum(rejected.values())} ({parts}); none of it is in this summary."


def _count(num: int, noun: str) -> str:
    return f"{num} {noun}" if num == 1 else f"{num} {noun}s"


def _severity(finding: Finding) -> str:
    return f" [{finding.severity}]" if finding.actionable else ""


def _section_lines(section: Section, report: Report) -> list[str]:
    diagnosis = section.diagnosis
    lines = [section.title, f"- Diagnosis: {diagnosis.label}{_severity(diagnosis)}"]
    if not diagnosis.measured:
        return [*lines, f"- Why: {diagnosis.why}"]
    lines.append(f"- Scope: {_scope(section, report)}")
    if section.name == "step_time":
        lines += _step_time_stats(section)
    elif stats := _stats_text(section):
        lines.append(f"- Stats: {stats}")
    lines.append(f"- Why: {diagnosis.why}")
    if diagnosis.actionable:
        lines.append(f"- Next: {diagnosis.next}")
    lines += [f"- Also: {f.label}{_severity(f)}: {f.why}" for f in section.findings[1:]
              if f.measured]
    absent = [f.label.removesuffix(" NOT MEASURED") for f in section.findings if not f.measured]
    if absent:
        lines.append(f"- Not measured: {', '.join(absent)}")
    return lines


def _scope(section: Section, report: Report) -> str:
    scope = section.scope
    missing = f" | missing {format_ranks(scope.missing_ranks)}" if scope.missing_ranks else ""
    if section.name == "system":
        return f"nodes {len(scope.nodes)}/{scope.num_nodes} | samples {scope.num_samples}"
    if section.name == "process":
        return (f"ranks {len(scope.ranks)}/{report.meta.world_size} | "
                f"samples {scope.num_samples}{missing}")
    warm = f", {scope.num_warmup_steps} warm-up steps left out" if scope.num_warmup_steps else ""
    return (f"last {scope.num_steps} aligned steps across {_count(len(scope.ranks), 'rank')}"
            f"{warm}{missing}")


def _step_time_stats(section: Section) -> list[str]:
    def spent(part: phases.Phase) -> bool:
        stat = section.stats.get(part.column)
        return stat is not None and stat.worst > 0
    shown = [(p, stat) for p in phases.visible(_STEP_PARTS, spent)
             if (stat := section.stats.get(p.column))]
    stats = " | ".join(f"{p.name} {stat.median:.1f}/{stat.worst:.1f}ms{_in_flight(p, section)}"
                       for p, stat in shown)
    lines = [f"- Stats: median/worst | {stats}"]
    if len(section.scope.ranks) > 1:
        ranks = " | ".join(f"{p.name} r{stat.median_rank}/r{stat.worst_rank}"
                           for p, stat in shown)
        lines.append(f"- Ranks: median/worst | {ranks}")
    return lines


def _in_flight(part: phases.Phase, section: Section) -> str:
    """`` (in flight 8.1ms)`` after communication: collectives' whole time, the
    part backward hid included."""
    stat = section.stats.get("collective_ms")
    return f" (in flight {stat.median:.1f}ms)" if part.collective and stat else ""


def _stats_text(section: Section) -> str:
    parts = []
    for key, name in _CARD_STATS[section.name]:
        stat = section.stats.get(key)
        if stat is not None:
            parts.append(f"{name} med/worst {_pair(key, stat)} {_where(stat)}".rstrip())
    return " | ".join(parts)


def _pair(key: str, stat: MetricStat) -> str:
    """``median/worst`` in the unit the key names: ``3.0/3.5 GiB``, ``20.1%/22.0%``."""
    if key.endswith("_bytes"):
        median, worst = format_bytes(stat.median), format_bytes(stat.worst)
        unit = median.rpartition(" ")[2]
        if worst.endswith(" " + unit):
            return f"{median.removesuffix(' ' + unit)}/{worst}"
        return f"{median}/{worst}"
    for suffix, unit, digits in (("_ms", "ms", 1), ("_c", "C", 1), ("_w", "W", 0)):
        if key.endswith(suffix):
            return f"{stat.median:.{digits}f}{unit}/{stat.worst:.{digits}f}{unit}"
    return f"{stat.median:.1f}%/{stat.worst:.1f}%"


def _where(stat: MetricStat) -> str:
    if stat.worst_rank is not None:
        return f"r{stat.worst_rank}"
    if stat.worst_node is None:
        return ""
    return f"n{stat.worst_node}" + (f" gpu{stat.worst_gpu}" if stat.worst_gpu is not None else "")
