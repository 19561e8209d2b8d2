"""The ``traceml`` command line (launcher side): dispatch to subcommands."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from traceml.errors import UsageError

USAGE = """usage: traceml <command> [options]

commands:
  run      launch a training script like torchrun and trace every rank
  watch    launch like run, with system and process telemetry only (nothing injected)
  report   recompute a session's final summary from its stored telemetry
  compare  compare two runs: IMPROVEMENT, REGRESSION, NO CHANGE, MIXED or INCONCLUSIVE
  capture  ask a live run to profile a rank (and the median rank) with torch.profiler
  export   write a session's steps as a timeline for ui.perfetto.dev (--perfetto FILE)

Run 'traceml <command> --help' for a command's options."""


def _run(argv: Sequence[str]) -> int:
    from traceml.launcher import args, launch

    return launch.run(args.parse("run", argv))


def _watch(argv: Sequence[str]) -> int:
    from traceml.launcher import args, launch

    return launch.run(args.parse("watch", argv))


def _report(argv: Sequence[str]) -> int:
    from traceml.report import cli

    return cli.main(argv)


def _compare(argv: Sequence[str]) -> int:
    from traceml.compare import cli

    return cli.main(argv)


def _capture(argv: Sequence[str]) -> int:
    from traceml.launcher import capture

    return capture.main(argv)


def _export(argv: Sequence[str]) -> int:
    from traceml.report import export

    return export.main(argv)


COMMANDS = {"run": _run, "watch": _watch, "report": _report, "compare": _compare,
            "capture": _capture, "export": _export}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from traceml.version import __version__

        print(f"traceml {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            raise UsageError(f"traceml: unknown command {argv[0]!r} "
                             f"(choose from {', '.join(COMMANDS)}; see 'traceml --help')")
        return command(argv[1:])
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return exc.exit_code


def entry() -> None:
    sys.exit(main())
