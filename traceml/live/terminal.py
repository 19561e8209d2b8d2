"""The ``--mode=cli`` view: a Snapshot as rich renderables, and as one plain line (launcher).

Runs in the launcher process, called by :mod:`traceml.live.console` about once
a second. Pure: the same snapshot and output lines always render the same, so
tests print them into a fixed-width console and compare the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from traceml import phases
from traceml.diagnosis.finding import Finding, format_ranks
from traceml.live.worker_output import OutputLine
from traceml.report.model import SECTION_NAMES, SECTION_TITLES
from traceml.report.page.gauges import Gauge, GaugeRow
from traceml.report.page.snapshot import TABLE_PARTS, RankPhases, Snapshot, WideView
from traceml.report.page.spread import NUM_WORST
from traceml.report.text import THROUGHPUT_UNITS, format_rate

MAX_TABLE_RANKS = 16
"""Ranks shown in the per-rank phase table at most: the slowest by median step time (more
ranks than ``spread.WIDE_RANKS`` get the spread table instead)."""

BAR_CELLS = 8
_SEVERITY_STYLE = {"info": "cyan", "warn": "yellow", "crit": "bold red"}


@dataclass(frozen=True)
class View:
    """The whole view, fitted to the console's height: header, phase table, diagnosis,
    gauges, then as many of the workers' last lines as there is room for."""

    snap: Snapshot
    output: Sequence[OutputLine] = ()
    output_where: str | None = None  # None: no output block (workers write to the terminal)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        snap = self.snap
        top = Group(header(snap), phase_table(snap, console, options), *throughput(snap),
                    diagnosis(snap),
                    gauge_table("System", snap.nodes), gauge_table("Process", snap.processes))
        yield top
        if self.output_where is not None:
            used = len(console.render_lines(top, options, pad=False))
            room = options.size.height - used - _output_title_height(self.output_where, options)
            shown = self.output[-room:] if room > 0 else ()
            yield output_panel(shown, self.output_where, placeholder=room > 0)


def render_view(snap: Snapshot, output: Sequence[OutputLine] = (),
                output_where: str | None = None) -> View:
    """The renderable the live display shows (see :class:`View`)."""
    return View(snap, output, output_where)


def format_duration(seconds: float) -> str:
    """``0:01:05``."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def format_ms(value: float) -> str:
    """Three significant digits or so: ``0.12``, ``12.3``, ``123``."""
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _plural(num: int, noun: str) -> str:
    return f"{num} {noun}" if num == 1 else f"{num} {noun}s"


def header(snap: Snapshot) -> Text:
    meta = snap.report.meta
    state = "ended" if snap.ended else "running"
    if snap.ended and meta.exit_code is not None:
        state += f" (exit {meta.exit_code})"
    text = Text("traceml ", style="bold")
    text.append(f"session {meta.session_id} | {_plural(meta.world_size, 'rank')} on "
                f"{_plural(snap.report.system.scope.num_nodes, 'node')} | {meta.device} | "
                f"{format_duration(snap.elapsed_s)} | {state}")
    return text


def _shown_ranks(rows: Sequence[RankPhases]) -> list[RankPhases]:
    if len(rows) <= MAX_TABLE_RANKS:
        return list(rows)
    slowest = sorted(rows, key=lambda r: -r.median_ms.get("total_ms", 0.0))[:MAX_TABLE_RANKS]
    return sorted(slowest, key=lambda r: r.rank)


def phase_table(snap: Snapshot, console: Console | None = None,
                options: ConsoleOptions | None = None) -> RenderableType:
    """Per rank, median / worst ms of each phase; the rank with the most time in each phase
    named.  Where that is wider than the console (``options``), each rank's median only:
    a narrower table, not one with values cut short.  At many ranks, the spread across
    ranks and the worst ranks instead (:func:`spread_table`)."""
    rows = snap.phases
    if not rows:
        if snap.report.meta.mode == "watch":
            return Text("traceml watch times no steps: System and Process only.", style="dim")
        return Text("Waiting for the first training steps...", style="dim")
    if snap.wide is not None:
        return spread_table(snap, snap.wide)
    table = _rank_table(snap, with_worst=True)
    if console is not None and options is not None and (  # its width when nothing is cut
            console.measure(table, options=options.update_width(10_000)).maximum
            > options.max_width):
        return _rank_table(snap, with_worst=False)
    return table


def _rank_table(snap: Snapshot, with_worst: bool) -> Table:
    rows = snap.phases
    shown = _shown_ranks(rows)
    steps = snap.report.step_time.scope.num_steps
    title = (f"Step time, ms: median / worst of the last {steps} aligned steps" if with_worst
             else f"Step time, ms: median of the last {steps} aligned steps")
    caption = f"{len(shown)} slowest of {len(rows)} ranks shown" if len(shown) < len(rows) else None
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1),
                  collapse_padding=True)
    with_node = snap.report.system.scope.num_nodes > 1
    columns = shown_columns(snap)
    names = ("rank", *(("node",) if with_node else ()), "step",
             *(p.removesuffix("_ms") for p in columns))
    for name in names:
        table.add_column(name, justify="left" if name in ("rank", "node") else "right",
                         no_wrap=True)
    for row in shown:
        node = ("-" if row.node_rank is None else f"n{row.node_rank}",) if with_node else ()
        table.add_row(f"r{row.rank}", *node, "-" if row.last_step is None else str(row.last_step),
                      *(_cell(snap, row, p, with_worst) for p in columns))
    if len(rows) > 1:
        table.add_row("most", *(("",) if with_node else ()), "",
                      *(f"r{snap.worst_ranks[p]}" if p in snap.worst_ranks else "-"
                        for p in columns), style="dim")
    return table


def spread_table(snap: Snapshot, wide: WideView) -> RenderableType:
    """Per phase: median, p90 and worst across ranks of each rank's median, the worst rank;
    then the NUM_WORST worst ranks of each phase, and the rank furthest behind."""
    columns = [p for p in shown_columns(snap) if p in wide.phases]
    title = (f"Step time across {len(snap.phases)} ranks, ms: each rank's median of the last "
             f"{snap.report.step_time.scope.num_steps} aligned steps")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1),
                  collapse_padding=True)
    table.add_column("across ranks", no_wrap=True)
    for name in columns:
        table.add_column(name.removesuffix("_ms"), justify="right", no_wrap=True)
    spreads = [wide.phases[p] for p in columns]
    table.add_row("median", *(format_ms(s.median) for s in spreads))
    table.add_row("p90", *(format_ms(s.p90) for s in spreads))
    table.add_row("worst", *(Text(format_ms(s.worst_value), style="bold red") for s in spreads))
    table.add_row("worst rank", *(f"r{s.worst_rank}" for s in spreads), style="dim")
    worst = Table.grid(padding=(0, 2))
    worst.add_column(style="bold", no_wrap=True)
    worst.add_column()
    for name, s in zip(columns, spreads):
        worst.add_row(name.removesuffix("_ms"),
                      "  ".join(f"r{v.rank} {format_ms(v.value)}" for v in s.worst_ranks))
    heading = Text(f"Worst ranks by phase, ms (their median; the {NUM_WORST} worst)", style="bold")
    parts: list[RenderableType] = [Text(title), table, heading, worst]
    if wide.last_step is not None:
        parts.append(Text(f"Newest step: {newest_steps(wide)}", style="dim"))
    return Group(*parts)


def newest_steps(wide: WideView) -> str:
    """``median 120, lowest 97 (r17)``: how far the ranks have got."""
    last = wide.last_step
    assert last is not None
    return f"median {last.median:.0f}, lowest {last.worst_value:.0f} (r{last.worst_rank})"


def shown_columns(snap: Snapshot) -> tuple[str, ...]:
    """The phase table's columns: a communication column only when some rank
    spent time in it."""
    def spent(phase: phases.Phase) -> bool:
        return any(row.worst_ms.get(phase.column, 0.0) > 0 for row in snap.phases)
    return tuple(p.column for p in phases.visible(TABLE_PARTS, spent))


WAITING_COLUMNS = frozenset(p.column for p in phases.PHASES if p.waits)
"""Phases whose time is mostly waiting for other ranks (the rank that waits for a
straggler has the most of it)."""


def _cell(snap: Snapshot, row: RankPhases, phase: str, with_worst: bool) -> Text:
    if phase not in row.median_ms:
        return Text("-")
    text = format_ms(row.median_ms[phase])
    if with_worst:
        text += f"/{format_ms(row.worst_ms[phase])}"
    if phase in snap.blamed.get(row.rank, {}):  # what the verdict blames
        return Text(text, style="bold red")
    if len(snap.phases) > 1 and snap.worst_ranks.get(phase) == row.rank:
        # The most time: bold for own work, dim where it is mostly waiting for others.
        return Text(text, style="italic dim" if phase in WAITING_COLUMNS else "bold")
    return Text(text)


def throughput_text(snap: Snapshot) -> str | None:
    """``1,280 samples/s | 655,360 tokens/s | 300 TFLOP/s | MFU 15.2%`` for the job; None
    until something of it is measured."""
    job = snap.report.throughput.job
    if job is None:
        return None
    shown = [format_rate(value, unit) for key, unit in THROUGHPUT_UNITS
             if (value := getattr(job, key)) is not None]
    return " | ".join(shown) or None


def throughput(snap: Snapshot) -> tuple[RenderableType, ...]:
    """The job's throughput under the phase table (nothing until it is measured)."""
    text = throughput_text(snap)
    if text is None:
        return ()
    line = Text("Throughput: ", style="bold")
    line.append(text)
    found = snap.report.throughput.diagnosis
    if found.actionable:
        line.append(f"  {found.label}", style=_SEVERITY_STYLE[found.severity])
    return (line,)


def _where(finding: Finding, section: str) -> str:
    where = SECTION_TITLES[section]
    return f"{where}, {format_ranks(finding.ranks)}" if finding.ranks else where


def diagnosis(snap: Snapshot) -> RenderableType:
    """The report's primary finding with its why and next step; every section's diagnosis."""
    primary = snap.report.primary
    finding = primary.finding
    text = Text("Diagnosis: ", style="bold")
    text.append(finding.label, style=_SEVERITY_STYLE[finding.severity])
    text.append(f" [{finding.severity}] ({_where(finding, primary.section)})")
    body = Text(finding.why)
    if finding.actionable and finding.next:
        body.append(f"\nNext: {finding.next}", style="dim")
    for other in snap.report.ending.findings:  # a stall that cleared stays in view
        if other is not finding:
            body.append(f"\n{other.label} [{other.severity}]: ", style=_SEVERITY_STYLE[other.severity])
            body.append(other.why)
    labels = " | ".join(f"{SECTION_TITLES[name]} {snap.report.section(name).diagnosis.label}"
                        for name in SECTION_NAMES if name != "throughput")  # it has its line
    body.append(f"\n{labels}", style="dim")
    return Group(text, Padding(body, (0, 0, 0, 2)))


def bar(gauge: Gauge) -> Text:
    """``CPU ███████░░░ 70%``; a text-only gauge shows its text."""
    text = Text(f"{gauge.label} ")
    if gauge.pct is not None:
        pct = max(0.0, min(100.0, gauge.pct))
        filled = round(pct / 100 * BAR_CELLS)
        style = "red" if pct >= 90 else "yellow" if pct >= 75 else "green"
        text.append("█" * filled, style=style)
        text.append("░" * (BAR_CELLS - filled), style="dim")
        text.append(" ")
    text.append(gauge.text)
    return text


def gauge_table(title: str, rows: Sequence[GaugeRow]) -> RenderableType:
    """One line per node (System) or rank (Process); gauges wrap when the line is full."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for row in rows:
        table.add_row(row.name, Text("  ").join(bar(g) for g in row.gauges))
    if not rows:
        table.add_row("", Text("no samples yet", style="dim"))
    return Group(Text(title, style="bold"), table)


def _output_title(where: str) -> Text:
    title = Text("Worker output", style="bold")
    title.append(f" (last lines by local rank; all of it in {where})", style="dim")
    return title


def _output_title_height(where: str, options: ConsoleOptions) -> int:
    return len(_output_title(where).wrap(Console(), options.max_width))


def output_panel(lines: Sequence[OutputLine], where: str,
                 placeholder: bool = True) -> RenderableType:
    """The workers' last lines, one screen line each, so the view keeps its shape."""
    shown = []
    for line in lines:
        text = Text(f"[{line.local_rank}] ", style="dim", no_wrap=True, overflow="ellipsis")
        text.append(line.text, style="red" if line.is_err else "")
        shown.append(text)
    if not shown and placeholder:
        shown.append(Text("  (nothing yet)", style="dim"))
    return Group(_output_title(where), *shown)


def status_line(snap: Snapshot) -> str:
    """The plain-text view (stdout is not a terminal): one line, no colours."""
    parts = [f"traceml: {format_duration(snap.elapsed_s)}"]
    if snap.wide is not None and snap.wide.last_step is not None:
        parts.append(f"{len(snap.phases)} ranks, step {newest_steps(snap.wide)}")
    elif snap.phases:
        steps = ", ".join(f"r{r.rank} {r.last_step}" for r in snap.phases[:8])
        more = f" +{len(snap.phases) - 8} more" if len(snap.phases) > 8 else ""
        parts.append(f"step {steps}{more}")
    total = snap.report.step_time.stats.get("total_ms")
    if total is not None:
        parts.append(f"step time median {format_ms(total.median)} ms, worst "
                     f"{format_ms(total.worst)} ms (r{total.worst_rank})")
    rates = throughput_text(snap)
    if rates is not None:
        parts.append(rates)
    finding = snap.report.primary.finding
    parts.append(f"{finding.label} [{finding.severity}]")
    return " | ".join(parts)
