"""``traceml report SESSION_DIR``: rebuild the summary from the stored
telemetry, without rerunning training (offline analysis)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from traceml.config import MAX_WINDOW_ROWS, UsageErrorParser
from traceml.errors import UsageError


def _positive_int(text: str) -> int:
    value = int(text)
    if not 0 < value <= MAX_WINDOW_ROWS:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_WINDOW_ROWS}, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = UsageErrorParser(prog="traceml report", description=(
        "Recompute final_summary.json and final_summary.txt of a session folder from its "
        "telemetry.sqlite, and print the text."))
    parser.add_argument("session_dir", help="The session folder (logs/<session>).")
    parser.add_argument("--summary-window-rows", "--summary_window_rows", type=_positive_int,
                        default=None, help="Steps per rank to analyse (default: the run's).")
    parser.add_argument("--html", metavar="OUT", default=None,
                        help="Also write the HTML report to OUT.")
    return parser


def _html_target(out: Path) -> Path:
    """OUT as given; a folder gets final_summary.html inside it."""
    from traceml.report.html import HTML_NAME

    target = out / HTML_NAME if out.is_dir() else out
    if not target.parent.is_dir():
        raise UsageError(f"traceml report: --html: no such folder: {target.parent} "
                         "(create it, or give another path)")
    return target


def main(argv: Sequence[str]) -> int:
    from traceml.report.session import build_summary, save_summary

    args = build_parser().parse_args(list(argv))
    session_dir = Path(args.session_dir)
    if not session_dir.is_dir():
        raise UsageError(f"traceml report: not a folder: {session_dir} "
                         "(give the session folder that 'traceml run' printed)")
    html_target = _html_target(Path(args.html)) if args.html is not None else None
    files = build_summary(session_dir, args.summary_window_rows)
    sys.stdout.write(files.text)  # printed first: a folder that takes no file loses nothing
    sys.stdout.flush()
    unwritten: OSError | None = None
    try:
        save_summary(files)
        print(f"traceml: summary written to {files.json_path} and {files.text_path.name}",
              file=sys.stderr)
    except OSError as exc:  # a read-only or full disk, a folder not the user's
        unwritten = exc
    if html_target is not None:  # the same report with its plots, one self-contained file
        from traceml.report.html import write_html
        try:
            path = write_html(html_target, files.report, files.run)
            print(f"traceml: HTML report written to {path}", file=sys.stderr)
        except OSError as exc:
            html_error = f"cannot write {html_target} ({exc.strerror or exc})"
            if unwritten is None:
                raise UsageError(f"traceml report: {html_error}") from None
            raise UsageError(
                f"traceml report: the summary is printed above, but {session_dir} takes no "
                f"file ({unwritten.strerror or unwritten}), and {html_error}") from None
    if unwritten is not None:
        raise UsageError(
            f"traceml report: the summary is printed above, but {session_dir} takes no file "
            f"({unwritten.strerror or unwritten}): free some space or make the folder "
            "writable, or copy the session folder elsewhere and run 'traceml report' there")
    return 0
