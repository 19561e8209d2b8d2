"""A session folder -> RunData -> the final summary files (offline analysis).

Reads ``telemetry.sqlite`` through `traceml.store` (never torch) and writes
``final_summary.json`` and ``final_summary.txt`` atomically (fsynced, with the
store's file mode).  Used at the end of ``traceml run``, by ``traceml report``
and by ``traceml.summary()``.  The launcher builds the summary first and writes
it after, so that it can print it even when the disk is full.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from traceml.config import DEFAULT_WINDOW_ROWS
from traceml.diagnosis.window import PlacingWindow, StepWindow
from traceml.errors import UsageError
from traceml.records import RunData
from traceml.report.build import build_report
from traceml.report.json_codec import report_to_json
from traceml.report.model import Report
from traceml.report.summary_files import save_pair
from traceml.report.text import render_text
from traceml.store import STORE_FILENAME, StoreError, StoreReader, paused_gc
from traceml.wire.records import RunEnd, RunStart

JSON_NAME = "final_summary.json"
TEXT_NAME = "final_summary.txt"


@dataclass(frozen=True)
class SummaryFiles:
    report: Report
    summary: dict[str, Any]
    text: str
    json_path: Path
    text_path: Path
    run: RunData


@contextmanager
def open_store(session_dir: Path) -> Iterator[StoreReader]:
    """The session's store, read-only; UsageError when it is missing or unreadable."""
    path = session_dir / STORE_FILENAME
    if not path.is_file():
        raise UsageError(f"traceml: no {STORE_FILENAME} in {session_dir} "
                         "(give the session folder that 'traceml run' printed)")
    try:
        with StoreReader(path) as reader:
            yield reader
    except StoreError as exc:
        raise UsageError(f"traceml: cannot read {path}: {exc}") from None


def load_run(session_dir: Path, end: RunEnd | None = None, window_rows: int | None = None,
             full: bool = False) -> tuple[RunData, int]:
    """The stored run as a summary over ``window_rows`` (default: the run's own) reads
    it, and that window.  ``end``: the launcher's own record of the end, for a store
    that lacks it (its collector died or hung: then the telemetry stopped early).
    ``full``: every stored row (a summary of the same findings, at the cost of the
    whole run's rows in memory), not only the window's (`StoreReader.window_run`)."""
    run, window, _ = _load(session_dir, end, window_rows, full)
    return run, window


def _load(session_dir: Path, end: RunEnd | None, window_rows: int | None,
          full: bool) -> tuple[RunData, int, StepWindow | None]:
    """`load_run`, and the window the bounded read placed over the run's steps (None
    with ``full``, or when the report must place its own)."""
    with open_store(session_dir) as reader:
        records = reader.records()
        if end is not None and (records.end is None or not end.telemetry_complete):
            records = replace(records, end=end)
        window = window_rows or summary_window(records.start)
        if full:
            return reader.run(records), window, None
        policy = PlacingWindow()
        run = reader.window_run(records, window, policy)
    return run, window, policy.window_for(run, window)


def summary_window(start: RunStart | None) -> int:
    """The summary window (rows per rank) a run asked for; the default when it did not say."""
    return (start.summary_window_rows if start is not None else 0) or DEFAULT_WINDOW_ROWS


def build_summary(session_dir: Path, window_rows: int | None = None,
                  end: RunEnd | None = None, full: bool = False) -> SummaryFiles:
    """The report from the store (see :func:`load_run` for ``end`` and ``full``), not
    written yet."""
    with paused_gc():
        run, window, placed = _load(session_dir, end, window_rows, full)
        report = build_report(run, window, placed)
        return SummaryFiles(report, report_to_json(report), render_text(report),
                            session_dir / JSON_NAME, session_dir / TEXT_NAME, run)


def save_summary(files: SummaryFiles) -> None:
    """Write both summary files as one pair, all or nothing
    (`traceml.report.summary_files`), with the store's file mode; OSError when they
    cannot be written (a full disk)."""
    folder = files.json_path.parent
    mode = stat.S_IMODE(os.stat(folder / STORE_FILENAME).st_mode)
    save_pair(folder, (files.text_path.name, files.json_path.name),
              (files.text.encode(), orjson.dumps(files.summary, option=orjson.OPT_INDENT_2)),
              mode)


def write_summary(session_dir: Path, window_rows: int | None = None,
                  full: bool = False) -> SummaryFiles:
    """Build the report from the store and write both summary files atomically."""
    files = build_summary(session_dir, window_rows, full=full)
    save_summary(files)
    return files
