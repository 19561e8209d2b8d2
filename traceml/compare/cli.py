"""``traceml compare A B``: the command line of the comparison (offline analysis).

Runs in the offline-analysis process (the ``traceml`` command, no training).
Parses argv once into :class:`CompareOptions`, reads both summaries, writes
``BASE.json`` and ``BASE.txt``, prints the text and returns the exit status:
1 for REGRESSION with ``--fail-on regression``, 0 otherwise, 2 for bad input
(one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from traceml.compare.build import compare_runs
from traceml.compare.json_codec import comparison_to_json
from traceml.compare.load import load_side
from traceml.compare.model import Comparison
from traceml.compare.text import render_text
from traceml.compare.verdict import STEP_TIME_THRESHOLD_PCT
from traceml.config import UsageErrorParser
from traceml.errors import UsageError

PROG = "traceml compare"

DESCRIPTION = """\
Compare two runs: did the change help, hurt, or make no difference?
A is the baseline, B the new run; deltas are B - A. Each is a final_summary.json
or a session folder (logs/<session>) that holds one.

The verdict (IMPROVEMENT, REGRESSION, NO CHANGE, MIXED, INCONCLUSIVE) is printed
first. A step-time change counts only when it exceeds both --threshold-pct of A's
step time and the runs' own step-to-step spread (interquartile range); peak memory
growth counts as a regression of its own (MIXED when time and memory move in
opposite directions). See docs/compare.md."""

EPILOG = """\
exit status: 0 (also for REGRESSION unless --fail-on regression), 1 for REGRESSION
with --fail-on regression, 2 for bad input.
example (CI gate):
  traceml compare baseline/final_summary.json logs/candidate --fail-on regression"""


@dataclass(frozen=True)
class CompareOptions:
    """``traceml compare`` arguments, parsed once."""

    a: str
    b: str
    output: str | None  # BASE; None: compare_<A>_vs_<B> beside run B (`default_base`)
    fail_on_regression: bool
    threshold_pct: float


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive percentage, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``traceml compare`` parser."""
    parser = UsageErrorParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", metavar="A", help="baseline: final_summary.json or session folder")
    parser.add_argument("b", metavar="B", help="new run: final_summary.json or session folder")
    parser.add_argument("--output", metavar="BASE",
                        help="write BASE.json and BASE.txt (default: compare_<A>_vs_<B> "
                             "beside run B: in the folder that holds B's session folder, "
                             "<A> and <B> the session folder names)")
    parser.add_argument("--fail-on", "--fail_on", choices=["regression"], dest="fail_on",
                        help="exit 1 when the verdict is REGRESSION (for CI gates)")
    parser.add_argument("--threshold-pct", "--threshold_pct", type=_threshold,
                        default=STEP_TIME_THRESHOLD_PCT, metavar="PCT",
                        help="smallest step-time change that counts, in %% of A's step time "
                             "(default: %(default)g)")
    return parser


def parse(argv: Sequence[str]) -> CompareOptions:
    """Parse ``traceml compare`` arguments (UsageError on bad input)."""
    ns = build_parser().parse_args(list(argv))
    return CompareOptions(ns.a, ns.b, ns.output, ns.fail_on == "regression", ns.threshold_pct)


def main(argv: Sequence[str]) -> int:
    """Run ``traceml compare``; returns the exit status."""
    try:
        options = parse(argv)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except UsageError as exc:
        return _usage_error(exc)
    try:
        comparison, text = run(options)
    except UsageError as exc:
        return _usage_error(exc)
    sys.stdout.write(text)
    sys.stdout.flush()
    failed = options.fail_on_regression and comparison.verdict.label == "REGRESSION"
    return 1 if failed else 0


def run(options: CompareOptions) -> tuple[Comparison, str]:
    """Read both sides, compare, write BASE.json and BASE.txt; the comparison and its text."""
    a, b = load_side("A", options.a), load_side("B", options.b)
    comparison = compare_runs(a, b, options.threshold_pct)
    text = render_text(comparison)
    base = options.output or default_base(options.b, a.label, b.label)
    data = json.dumps(comparison_to_json(comparison), indent=2, allow_nan=False) + "\n"
    json_path, text_path = Path(base + ".json"), Path(base + ".txt")
    write_atomic(json_path, data)
    write_atomic(text_path, text)
    print(f"traceml compare: wrote {json_path} and {text_path}", file=sys.stderr)
    return comparison, text


def default_base(b: str, a_label: str, b_label: str) -> str:
    """``compare_<A>_vs_<B>`` beside run B: in the folder holding B's session folder
    (the logs folder), or B's summary file; never the current folder by default."""
    given = Path(os.path.abspath(b))  # '..' resolved, a symlinked session folder kept
    return str(given.parent / f"compare_{a_label}_vs_{b_label}")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, creating parent folders."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"{PROG}: cannot write {path} ({exc.strerror or exc}); pass --output "
                         "BASE in a writable folder") from None


def _usage_error(exc: UsageError) -> int:
    print(str(exc), file=sys.stderr)
    return exc.exit_code
