"""The options every script in scripts/ that measures shares.  Imported as
``bench_options`` (scripts/ is on the path of a script run from there).

``--quick``: a small run, under a minute, that proves the script still works on
this code (the suite runs each one: ``tests/e2e/test_benchmarks.py``); its
figures are not the README's.  Options given beside it still win.

``--time-limit S``: the whole run's bound.  Past it the script stops with exit 1
and says so (a child process that never answers ends the run, never hangs it).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

QUICK_LIMIT_S = 120.0  # --quick's own bound, when --time-limit is not given


def parse(parser: argparse.ArgumentParser, quick: Mapping[str, Any],
          limit_s: float) -> argparse.Namespace:
    """``parser``'s arguments, with ``--quick`` (``quick``: the defaults it sets) and
    ``--time-limit`` (``limit_s`` unless given); the bound starts now."""
    shown = " ".join(f"--{k.replace('_', '-')} {_shown(v)}" for k, v in quick.items())
    parser.add_argument("--quick", action="store_true",
                        help=f"a run of under a minute that checks the script works ({shown})")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help=f"stop with exit 1 after S seconds (default {limit_s:g}; "
                             f"{QUICK_LIMIT_S:g} with --quick)")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args()
    if args.time_limit is None:
        args.time_limit = QUICK_LIMIT_S if args.quick else limit_s
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        parser.error("--time-limit must be a positive number of seconds")
    bound(args.time_limit)
    return args


def bound(limit_s: float) -> None:
    """End the script with exit 1 once ``limit_s`` seconds have passed (SIGALRM: the
    main thread's blocking waits are interrupted), killing every process it started
    first, theirs too (a ``traceml run``'s ranks and collector)."""
    name = Path(sys.argv[0]).name

    def expire(signum: int, frame: FrameType | None) -> None:
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        raise SystemExit(f"{name}: still running after {limit_s:g} s (--time-limit); stopped")

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, math.ceil(limit_s)))


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
