"""``traceml export SESSION_DIR --perfetto FILE``: a session's steps as a timeline that
ui.perfetto.dev and chrome://tracing open (`traceml.report.timeline`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from traceml.config import UsageErrorParser
from traceml.errors import UsageError
from traceml.report.timeline import MAX_RANK_STEPS, choose_steps, trace, write_trace


def _step_range(text: str) -> tuple[int | None, int | None]:
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = (int(first) if first.strip() else None, int(last) if last.strip() else None)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"give A:B (steps A to B, inclusive; A: or :B leave a side open), got {text!r}"
        ) from None
    if any(b is not None and b < 0 for b in bounds) or (
            None not in bounds and bounds[0] > bounds[1]):  # type: ignore[operator]
        raise argparse.ArgumentTypeError(f"steps are 0 or more, A before B; got {text!r}")
    return bounds


def _rank_list(text: str) -> frozenset[int]:
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            low, sep, high = part.partition("-")
            first, last = int(low), int(high) if sep else int(low)
            if first < 0 or last < first:
                raise ValueError
            ranks.update(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"give ranks as 0,3,8-15 (0 or more, low-high ranges); got {text!r}") from None
    return frozenset(ranks)


def build_parser() -> argparse.ArgumentParser:
    parser = UsageErrorParser(prog="traceml export", description=(
        "Write a session's steps as a timeline: every rank's steps with their phases, its "
        "collectives in flight, stalls, crashes, outlier steps and profiler captures, memory "
        "and CPU, one process per node, on the collector node's clock (Chrome trace-event "
        "JSON: open it in ui.perfetto.dev or chrome://tracing)."))
    parser.add_argument("session_dir", help="The session folder (logs/<session>).")
    parser.add_argument("--perfetto", metavar="FILE", required=True,
                        help="Write the trace to FILE (gzip when FILE ends in .gz).")
    parser.add_argument("--steps", metavar="A:B", type=_step_range, default=None,
                        help="Steps A to B, inclusive, as the summary numbers them (default: "
                        "the summary's window, the last steps every chosen rank reached).")
    parser.add_argument("--ranks", metavar="LIST", type=_rank_list, default=None,
                        help="Only these ranks, as 0,3,8-15 (default: every rank).")
    parser.epilog = (f"At most {MAX_RANK_STEPS:,} steps summed over the ranks are written "
                     "(about 10 MB before gzip); beyond that the latest steps of the range.")
    return parser


def main(argv: Sequence[str]) -> int:
    from traceml.report.session import open_store, summary_window

    args = build_parser().parse_args(list(argv))
    session_dir, out = Path(args.session_dir), Path(args.perfetto)
    if not session_dir.is_dir():
        raise UsageError(f"traceml export: not a folder: {session_dir} "
                         "(give the session folder that 'traceml run' printed)")
    if out.is_dir() or not out.parent.is_dir():
        raise UsageError(f"traceml export: --perfetto: {out} is a folder, or its folder does "
                         "not exist (give a file path in an existing folder, e.g. trace.json.gz)")
    with open_store(session_dir) as reader:
        records = reader.records()
        last_steps = {r: s for r, s in reader.last_steps().items()
                      if args.ranks is None or r in args.ranks}
        asked = None
        if args.steps is not None:
            low, high = args.steps
            asked = (0 if low is None else low, high)
        chosen = choose_steps(last_steps, summary_window(records.start), asked, None)
        run = None if chosen is None else reader.steps_run(records, chosen.first, chosen.last,
                                                           args.ranks)
    if chosen is None or run is None or not run.steps:
        held = (f"its ranks' steps run to {max(last_steps.values())}" if last_steps
                else "it holds no steps" + (" of those ranks" if args.ranks else ""))
        raise UsageError(f"traceml export: nothing to draw in {session_dir}: {held} "
                         "(choose --steps and --ranks within them)")
    document = trace(run, chosen, to_the_end=chosen.last >= max(last_steps.values()))
    try:
        size = write_trace(document, out)
    except OSError as exc:
        raise UsageError(f"traceml export: cannot write {out} ({exc.strerror or exc})") from None
    num_ranks = len({r.rank for r in run.steps})
    note = (f"; cut to the latest {chosen.num_steps} steps ({MAX_RANK_STEPS:,} steps at most "
            "over the ranks)" if chosen.capped else "")
    print(f"traceml: steps {chosen.first}-{chosen.last} of {num_ranks} rank(s) written to "
          f"{out} ({size / 1024:.1f} KiB){note}; open it in ui.perfetto.dev or "
          "chrome://tracing", file=sys.stderr)
    unaligned = document["otherData"]["not_aligned_nodes"]
    if unaligned:
        print("traceml: warning: the clocks of node(s) "
              f"{', '.join(map(str, unaligned))} were not measured: their times are their "
              "own clock's, and may be off from the others by what NTP leaves",
              file=sys.stderr)
    return 0
