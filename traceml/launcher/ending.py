"""What the launcher writes and prints when the run is over (launcher side).

The final summary is written in every ending (normal exit, a failing or
killed rank, Ctrl-C); the card is printed on stdout, the per-rank phase table,
the per-rank throughput (when measured) and the session folder on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tabulate import tabulate

from traceml import phases
from traceml.diagnosis.samples import StepRow
from traceml.diagnosis.throughput import RankThroughput
from traceml.errors import UsageError
from traceml.protocol import RunEnd
from traceml.report.model import Report
from traceml.report.text import THROUGHPUT_UNITS, format_count
from traceml.store import STORE_FILENAME

PARTS = (*phases.stacked(), phases.TOTAL)


def phase_table(steps: tuple[StepRow, ...]) -> str:
    """Per-rank mean phase times."""
    by_rank: dict[int, list[StepRow]] = {}
    for row in steps:
        by_rank.setdefault(row.rank, []).append(row)
    table = []
    shown = phases.visible(PARTS, lambda p: any(r.ms(p.name) > 0 for r in steps))
    for rank in sorted(by_rank):
        rows = by_rank[rank]
        means = [sum(r.ms(p.name) for r in rows) / len(rows) for p in shown]
        table.append([f"r{rank}", len(rows), *(f"{m:.2f}" for m in means)])
    if not table:
        return "traceml: no training steps were captured."
    headers = ["rank", "steps", *(f"{p.name} ms" for p in shown)]
    rendered: str = tabulate(table, headers=headers, disable_numparse=True)
    return "traceml: mean time per step\n" + rendered


def throughput_table(report: Report) -> str | None:
    """Per-rank samples/s, tokens/s, achieved TFLOP/s and MFU over the summary's window;
    None when none of it was measured."""
    rows = [row for row in report.throughput.ranks if isinstance(row, RankThroughput)]
    shown = [(key, unit) for key, unit in THROUGHPUT_UNITS
             if any(getattr(row, key) is not None for row in rows)]
    if not shown:
        return None
    table = [[f"r{row.rank}", *(_rate_cell(getattr(row, key), unit) for key, unit in shown)]
             for row in rows]
    headers = ["rank", *("MFU %" if unit == "MFU" else unit for _, unit in shown)]
    rendered: str = tabulate(table, headers=headers, disable_numparse=True)
    return "traceml: throughput per rank (summary window)\n" + rendered


def _rate_cell(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "MFU":
        return f"{value:.1f}"
    return f"{value:.3g}" if unit == "TFLOP/s" else format_count(value)


def finish(session_dir: Path, collector_alive: bool, html: bool = False,
           end: RunEnd | None = None) -> None:
    """Print the summary and write its files.  ``end``: the launcher's record of
    the end, for a store that lacks it.  A full disk costs the files, not the card."""
    from traceml.report.session import build_summary, save_summary

    if not collector_alive:
        print("traceml: warning: the collector stopped during the run; "
              "steps after that were not recorded", file=sys.stderr)
    if not (session_dir / STORE_FILENAME).exists():
        print(f"traceml: no telemetry was stored in {session_dir}", file=sys.stderr)
        return
    try:
        files = build_summary(session_dir, end=end)
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return
    sys.stdout.write(files.text)
    sys.stdout.flush()
    print(phase_table(files.run.steps), file=sys.stderr)
    rates = throughput_table(files.report)
    if rates is not None:
        print(rates, file=sys.stderr)
    try:
        save_summary(files)
    except OSError as exc:
        print(f"traceml: cannot write the summary to {session_dir}: {exc.strerror}; it is "
              "printed above (free space there, then run 'traceml report' on the folder)",
              file=sys.stderr)
        return
    print(f"traceml: summary written to {files.json_path} and {files.text_path.name}",
          file=sys.stderr)
    if html:  # --html: the same report with its plots, one self-contained file
        from traceml.report.html import HTML_NAME, write_html

        path = write_html(session_dir / HTML_NAME, files.report, files.run)
        print(f"traceml: HTML report written to {path}", file=sys.stderr)
