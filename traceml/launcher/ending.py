"""What the launcher writes and prints when the run is over (launcher side).

The final summary is written in every ending (normal exit, a failing or
killed rank, Ctrl-C); the card is printed on stdout, the per-rank phase table
(the whole run's means, summed in SQL; the slowest ranks of a wide job),
the per-rank throughput (when measured) and the session folder on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tabulate import tabulate

from traceml import phases
from traceml.diagnosis.throughput import RankThroughput
from traceml.errors import UsageError
from traceml.records import RunData, rank_totals
from traceml.report.model import Report
from traceml.report.text import THROUGHPUT_UNITS, format_count
from traceml.store import STORE_FILENAME
from traceml.wire.records import RunEnd

PARTS = (*phases.stacked(), phases.TOTAL)


MAX_TABLE_RANKS = 16
"""Ranks the phase table lists; a wider job shows its slowest ranks by mean step time."""


def phase_table(run: RunData) -> str:
    """Per-rank mean phase times over the whole run (at most :data:`MAX_TABLE_RANKS`
    ranks: the slowest, in rank order)."""
    totals = rank_totals(run)
    shown = phases.visible(PARTS, lambda p: any(t.sum_ms.get(p.name, 0.0) > 0
                                                for t in totals.values()))
    ranks = sorted(totals)
    title = "traceml: mean time per step"
    if len(ranks) > MAX_TABLE_RANKS:
        slowest = sorted(ranks, key=lambda r: (-totals[r].mean_ms("total"), r))
        ranks = sorted(slowest[:MAX_TABLE_RANKS])
        title += f" ({MAX_TABLE_RANKS} slowest of {len(totals)} ranks)"
    table = [[f"r{rank}", totals[rank].num_rows,
              *(f"{totals[rank].mean_ms(p.name):.2f}" for p in shown)] for rank in ranks]
    if not table:
        return "traceml: no training steps were captured."
    headers = ["rank", "steps", *(f"{p.name} ms" for p in shown)]
    rendered: str = tabulate(table, headers=headers, disable_numparse=True)
    return f"{title}\n{rendered}"


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
    print(phase_table(files.run), file=sys.stderr)
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
