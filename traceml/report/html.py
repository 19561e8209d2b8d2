"""final_summary.html: the report and its plots in one self-contained file (offline analysis).

Runs in the offline-analysis process (end of ``traceml run --html``,
``traceml report --html``). The file embeds the snapshot document whose
``summary`` is exactly final_summary.json, plus the series of the steps the
summary read (each rank's, around its window), and
draws it with the same page, CSS and JS as the live dashboard: no network.
"""

from __future__ import annotations

from pathlib import Path

from traceml.records import RunData
from traceml.report.model import Report
from traceml.report.page.render import render_page
from traceml.report.page.snapshot import build_snapshot, snapshot_to_json

HTML_NAME = "final_summary.html"


def render_html(report: Report, run: RunData) -> str:
    """The page for ``report``, which was built from ``run``."""
    snapshot = build_snapshot(run, report, ended=True)
    return render_page(snapshot_to_json(snapshot, live=False),
                       f"traceml report · {report.meta.session_id}")


def write_html(path: Path, report: Report, run: RunData) -> Path:
    """Write the page atomically to ``path``; returns ``path``."""
    from traceml.report.summary_files import write_atomic

    write_atomic(path, render_html(report, run).encode("utf-8"))
    return path
