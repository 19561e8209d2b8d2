"""final_summary.txt: the report as the boxed text card printed at the end (offline analysis).

Runs in the offline-analysis process. Layout of the seed README's example: a
header with the duration, the verdict and one next step, then one block per
section (System, Process, Step Time, Step Memory) with Diagnosis, Scope, Stats,
Ranks (Step Time), Job, Peak and FLOPs (Throughput) and Why. Long lines wrap inside the box. ASCII only.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

from traceml import phases
from traceml.clocks import REFERENCE
from traceml.diagnosis.arrival import arrival_line
from traceml.diagnosis.ending import STOPPING_EXCEPTIONS
from traceml.diagnosis.ending_text import RANKS_NAMED
from traceml.diagnosis.finding import Finding, format_bytes, format_ranks
from traceml.diagnosis.operators import BY_TIME, CaptureResult, OperatorLine
from traceml.diagnosis.stats import MetricStat, stands_out
from traceml.diagnosis.step_loop import BOUNDARY_TEXT, INPUT_TEXT
from traceml.diagnosis.step_time import RankStepTimes
from traceml.records import NodeInfo, RunMeta
from traceml.report.model import SECTION_TITLES, Report, Section

CARD_ORDER = ("system", "process", "step_time", "throughput", "step_memory")

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
    if report.ending.findings:
        body += [*_ending_lines(report), ""]
    for name in CARD_ORDER:
        body += [*_section_lines(report.section(name), report), ""]
    for capture in report.captures:
        body += [*capture_lines(capture), ""]
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
    where = [SECTION_TITLES[report.primary.section]]
    if primary.ranks:
        where.append(format_ranks(primary.ranks))
    lines = [f"{verdict} ({', '.join(where)})"]
    if primary.next:
        lines.append(f"Next: {primary.next}")
    exit_text = (f"exit unknown ({meta.lost} lost)" if meta.lost
                 else "running" if meta.exit_code is None else f"exit {meta.exit_code}")
    nodes = _count(report.system.scope.num_nodes, "node")
    lines.append(f"Run: {_count(meta.world_size, 'rank')} on {nodes} | "
                 f"{meta.device} | {exit_text} | session {meta.session_id}")
    clocks = clocks_line(meta)
    if clocks:
        lines.append(clocks)
    if meta.partial:
        gone = f"; missing ranks {format_ranks(meta.missing_ranks)}" if meta.missing_ranks else ""
        lines.append(f"PARTIAL: the run ended before every rank finished{gone}.")
    dropped, gaps = meta.transport.get("dropped", 0), meta.transport.get("gaps", 0)
    if dropped or gaps:
        lines.append(f"Telemetry: {dropped} messages dropped, {gaps} sequence gaps; "
                     "some samples are missing.")
    if meta.lost:
        who = "training process" if meta.lost == "process" else "launcher"
        lines.append(f"Telemetry stopped early: the {who} vanished and its collector "
                     "stopped with it; the end time is when the collector saw it go.")
    elif not meta.telemetry_complete:
        lines.append("Telemetry stopped early: the collector died or hung before the run "
                     "ended; the exit status and end time are the launcher's.")
    if meta.rejected:
        lines.append(rejected_line(meta.rejected))
    for name, tally in sorted(meta.exports.items()):
        if tally.get("failed"):
            done = tally["sent"] + tally["failed"]
            lines.append(f"{name.upper()} export: {tally['failed']} of {done} pushes to "
                         f"{tally['endpoint']} failed ({tally.get('error')}); the metrics "
                         "there have gaps.")
    return lines


STACK_FRAMES_SHOWN = 4
"""Frames of each stalled or crashed rank's stack the card shows (innermost last)."""
STACK_LINES_SHOWN = 8
"""Stack lines the card shows (ranks at the same frames share one), culprits first."""


def _ending_lines(report: Report) -> list[str]:
    """How the run ended: its findings, then each stalled or crashed rank's stack."""
    ending = report.ending
    lines = ["Ending", f"- State: {ending.state}"]
    lines += [f"- {f.label}{_severity(f)}: {f.why}" for f in ending.findings]
    # Ranks stopped at the same frames share a line (a job-wide stall at 8192 ranks is
    # a line or two, not 8192); the culprits' lines first.
    ranks_at: dict[tuple[str, str | None, str], list[int]] = {}
    shown: set[tuple[int, str]] = set()
    for i in ending.incidents:
        if (not i.stack or (i.rank, i.what) in shown
                or i.detail.get("type") in STOPPING_EXCEPTIONS):  # Ctrl-C's, not a crash
            continue
        shown.add((i.rank, i.what))
        frames = " > ".join(f.short() for f in i.stack[-STACK_FRAMES_SHOWN:])
        ranks_at.setdefault((i.what, i.stack_source, frames), []).append(i.rank)
    culprits = set(ending.culprits)
    ordered = sorted(ranks_at.items(), key=lambda item: culprits.isdisjoint(item[1]))
    for (what, source, frames), ranks in ordered[:STACK_LINES_SHOWN]:
        lines.append(f"- {format_ranks(sorted(ranks), RANKS_NAMED)} {what} stack ({source}): "
                     f"{frames}")
    left = sum(len(ranks) for _, ranks in ordered[STACK_LINES_SHOWN:])
    if left:
        lines.append(f"- {left} more rank{'s' if left > 1 else ''} stopped at other frames "
                     "(final_summary.json has every stack)")
    return lines


CARD_OPERATORS = 5  # operators a capture shows on the card (the JSON has more)


def capture_lines(c: CaptureResult) -> list[str]:
    """A profiler capture: the steps, where the suspect's time went operator by operator
    against the reference, and the trace files."""
    steps = (f"step {c.start_after}" if c.steps_asked == 1
             else f"steps {c.start_after}-{c.start_after + c.steps_asked - 1}")
    ranks = f"r{c.suspect}" + (f" and r{c.reference}" if c.reference is not None else "")
    asked = "asked with traceml capture" if c.trigger == "manual" else f"for {c.label}"
    lines = [f"Operators (profiler capture {c.capture_id}, {asked}: {steps} on {ranks})"]
    clock = "GPU" if c.device else "host"
    if c.num_steps and c.reference is not None:
        order = f"by r{c.suspect}'s time" if c.trigger in BY_TIME else "by difference"
        lines.append(f"- r{c.suspect} against r{c.reference}, {clock} self time per step "
                     f"(a collective: its whole duration), {order}, the same steps on "
                     "both:" + _capture_total(c))
    elif c.num_steps:
        lines.append(f"- r{c.suspect}, {clock} self time per step:")
    for o in c.operators[:CARD_OPERATORS] if c.num_steps else ():
        lines.append("- " + _operator_text(o, c))
    for t in c.traces:
        lines.append(f"- Trace r{t.rank}: {t.path} ({format_bytes(t.num_bytes)}; "
                     "ui.perfetto.dev or chrome://tracing)")
    lines += [f"- Note: {n}" for n in c.notes]
    return lines


def _capture_total(c: CaptureResult) -> str:
    parts = []
    if c.compute_diff_ms is not None:
        parts.append(f" the compute operators {c.compute_diff_ms:+.1f} ms")
    if c.communication_diff_ms:
        parts.append(f" collectives {c.communication_diff_ms:+.1f} ms")
    text = ",".join(parts)
    if c.phase_diff_ms is not None and c.phase:
        text += f" ({c.phase} as traceml timed these steps: {c.phase_diff_ms:+.1f} ms)"
    return text


def _operator_text(o: OperatorLine, c: CaptureResult) -> str:
    comm = " [collective]" if o.communication else (
        "" if o.part == "compute" else f" [{o.part}]")
    if o.reference_ms is None or o.diff_ms is None:
        return (f"{o.name}{comm}: {o.suspect_ms:.2f} ms, {o.suspect_calls:g} calls"
                + (f"; {o.suspect_shapes}" if o.suspect_shapes else ""))
    text = (f"{o.name}{comm} {o.diff_ms:+.2f} ms ({o.suspect_ms:.2f} vs {o.reference_ms:.2f}), "
            f"{o.suspect_calls:g} vs {o.reference_calls:g} calls")
    if o.suspect_shapes or o.reference_shapes:
        text += f"; r{c.suspect}: {o.suspect_shapes or '-'}"
        if o.reference_shapes != o.suspect_shapes:
            text += f"; r{c.reference}: {o.reference_shapes or '-'}"
    return text


def rejected_line(rejected: Mapping[str, int]) -> str:
    """One line: what the collector refused (and stored rows skipped), by reason."""
    parts = ", ".join(f"{reason} {n}" for reason, n in
                      sorted(rejected.items(), key=lambda item: (-item[1], item[0])))
    return f"Rejected: {sum(rejected.values())} ({parts}); none of it is in this summary."


def _count(num: int, noun: str) -> str:
    return f"{num} {noun}" if num == 1 else f"{num} {noun}s"


def clocks_line(meta: RunMeta, listed: int = 3) -> str:
    """Each node's clock against the collector's node's (a few listed; more: the farthest
    and how many), '' when none was measured (one node)."""
    reference = next((n.node_rank for n in meta.nodes if n.clock == REFERENCE), None)
    measured = [n for n in meta.nodes if n.clock is not None and n.clock != REFERENCE]
    if reference is None or not measured:
        return ""

    def one(n: NodeInfo) -> str:
        c = n.clock
        assert c is not None
        drift = f", drift {c.drift_ppm:+.2f} ppm" if c.drift_ppm is not None else ""
        return f"node {n.node_rank} {c.offset_ms:+.2f} ms +/- {c.uncertainty_ms:.2f}{drift}"
    head = f"Clocks against node {reference}'s"
    if len(measured) <= listed:
        return f"{head}: " + "; ".join(map(one, measured)) + "."
    largest = max(measured, key=lambda n: abs(n.clock.offset_ms) if n.clock else 0.0)
    return f"{head}: {len(measured)} nodes measured; the farthest {one(largest)}."


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
    elif section.name == "throughput":
        lines += throughput_lines(section)
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
    if scope.num_counted_steps:
        warm += f", {_count(scope.num_counted_steps, 'FLOP-counting step')} left out"
    if scope.num_captured_steps:
        warm += f", {_count(scope.num_captured_steps, 'profiled step')} left out"
    rule = f" | steps: {BOUNDARY_TEXT[scope.step_boundary]}" if scope.step_boundary else ""
    return (f"last {scope.num_steps} aligned steps across {_count(len(scope.ranks), 'rank')}"
            f"{warm}{missing}{rule}")


def _most_time(shown: Sequence[tuple[phases.Phase, MetricStat]]) -> str:
    """``- Most time, by part: input r1, communication r0; alike: total, compute``."""
    named, alike = [], []
    for p, stat in shown:
        if stands_out(stat.worst, stat.median):
            named.append(f"{p.name} r{stat.worst_rank}")
        else:
            alike.append(p.name)
    if not named:
        return "- Most time, by part: every part alike across ranks"
    return f"- Most time, by part: {', '.join(named)}{'; alike: ' + ', '.join(alike) if alike else ''}"


def _step_time_stats(section: Section) -> list[str]:
    def spent(part: phases.Phase) -> bool:
        stat = section.stats.get(part.column)
        return stat is not None and stat.worst > 0
    shown = [(p, stat) for p in phases.visible(_STEP_PARTS, spent)
             if (stat := section.stats.get(p.column))]
    stats = " | ".join(f"{p.name} {stat.median:.1f}/{stat.worst:.1f}{_in_flight(p, section)}"
                       for p, stat in shown)
    lines = [f"- Typical step, ms (a rank's mean step without outlier steps; median/worst "
             f"rank) | {stats}"]
    if len(section.scope.ranks) > 1:
        lines.append(_most_time(shown))
    if section.scope.input_source:
        lines.append(f"- Input: {INPUT_TEXT[section.scope.input_source]}")
    if section.arrival is not None:
        lines.append(f"- Arrival at collectives: {arrival_line(section.arrival)}")
    evals, num = section.stats.get("eval_total_ms"), section.stats.get("num_eval")
    if evals is not None and num is not None:
        lines.append(f"- Evaluation: {num.median:.0f} passes, {evals.median / 1e3:.2f} s of wall "
                     "time (median rank), kept out of the steps")
    return lines + _gpu_time(section)


def _gpu_time(section: Section) -> list[str]:
    """CUDA only: the GPU time per step, and how many steps carry it (a sample)."""
    rows = [r for r in section.ranks if isinstance(r, RankStepTimes)]
    counts = sorted(n for r in rows if (n := r.num_gpu_timed_steps) is not None)
    if not counts:
        return []
    timed = str(counts[0]) if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
    of = f"{timed} of {section.scope.num_steps} steps"
    stat = section.stats.get("gpu_ms")
    if stat is None:
        return [f"- GPU time: not measured ({of} carry GPU times)"]
    parts = "+".join(p.name for p in phases.gpu_compute())
    where = f" r{stat.worst_rank}" if len(rows) > 1 else ""
    lines = [f"- GPU time: median/worst {stat.median:.1f}/{stat.worst:.1f}ms{where} "
             f"({parts}), from {of} (those timed)"]
    waited, flight = section.stats.get("gpu_communication_ms"), section.stats.get(
        "gpu_collective_ms")
    if waited is not None:
        also = ("" if flight is None else
                f", in flight {flight.median:.1f}/{flight.worst:.1f}ms (first bucket ready "
                "to the wait's end)")
        lines.append(f"- GPU communication: the GPU waited on DDP's all-reduces median/worst "
                     f"{waited.median:.1f}/{waited.worst:.1f}ms a step{also}, on the timed "
                     "steps")
    return lines


def format_rate(value: float | None, unit: str) -> str:
    """``1,234.5 samples/s``; ``0.0312 TFLOP/s``; ``MFU 31.2%``; "not measured" for None."""
    if value is None:
        return f"{unit} not measured"
    if unit == "MFU":
        return f"MFU {value:.1f}%"
    if unit == "TFLOP/s":
        return f"{value:.3g} TFLOP/s"
    return f"{format_count(value)} {unit}"


def format_count(value: float) -> str:
    """``1,281``, ``640.5``, ``3.125``: thousands with separators, else 4 digits."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


THROUGHPUT_UNITS = (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s"),
                    ("achieved_tflops", "TFLOP/s"), ("mfu_pct", "MFU"))
"""The Throughput numbers every view shows, as (field, unit)."""


def throughput_lines(section: Section) -> list[str]:
    """The job's throughput, the ranks' spread, the peak and the FLOPs' source."""
    job = section.job
    if job is None:
        return []
    lines = ["- Job: " + " | ".join(format_rate(getattr(job, key), unit)
                                    for key, unit in THROUGHPUT_UNITS)]
    if len(section.scope.ranks) > 1:
        per = [f"{unit} {_spread(key, stat)} r{stat.worst_rank}"
               for key, unit in THROUGHPUT_UNITS if (stat := section.stats.get(key))]
        if per:
            lines.append("- Per rank: median/lowest | " + " | ".join(per))
    lines.append(f"- Peak: {job.peak_source}")
    lines.append(f"- FLOPs: {job.flops_source}")
    return lines


def _spread(key: str, stat: MetricStat) -> str:
    if key.endswith("_pct"):
        return f"{stat.median:.1f}%/{stat.worst:.1f}%"
    return f"{format_count(stat.median)}/{format_count(stat.worst)}"


def _in_flight(part: phases.Phase, section: Section) -> str:
    """`` (in flight 8.1ms)`` after communication: collectives' whole time, the
    part backward hid included."""
    stat = section.stats.get("collective_ms")
    return f" (in flight {stat.median:.1f})" if part.waits and stat else ""


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
