"""A session folder -> RunData -> the final summary files (offline analysis).

Reads ``telemetry.sqlite`` through `traceml.store` (never torch) and writes
``final_summary.json`` and ``final_summary.txt`` atomically.  Used at the end of
``traceml run``, by ``traceml report`` and by ``traceml.summary()``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from traceml.config import DEFAULT_WINDOW_ROWS
from traceml.diagnosis.samples import RunData
from traceml.errors import UsageError
from traceml.protocol import RunStart
from traceml.report.build import build_report
from traceml.report.json_codec import report_to_json
from traceml.report.model import Report
from traceml.report.text import render_text
from traceml.store import STORE_FILENAME, StoreError, StoreReader

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


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder and rename over the target."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def load_run(session_dir: Path) -> tuple[RunData, int]:
    """The stored run and the summary window it asked for."""
    with open_store(session_dir) as reader:
        records = reader.records()
        run = reader.run(records)
    return run, summary_window(records.start)


def summary_window(start: RunStart | None) -> int:
    """The summary window (rows per rank) a run asked for; the default when it did not say."""
    return (start.summary_window_rows if start is not None else 0) or DEFAULT_WINDOW_ROWS


def write_summary(session_dir: Path, window_rows: int | None = None) -> SummaryFiles:
    """Build the report from the store and write both summary files atomically."""
    run, stored_window = load_run(session_dir)
    report = build_report(run, window_rows or stored_window)
    summary = report_to_json(report)
    text = render_text(report)
    json_path, text_path = session_dir / JSON_NAME, session_dir / TEXT_NAME
    write_atomic(json_path, orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    write_atomic(text_path, text.encode())
    return SummaryFiles(report, summary, text, json_path, text_path, run)
