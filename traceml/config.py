"""The run configuration: argv parsed once into this object (launcher side).

Nothing after the CLI sees argparse, except torch's own namespace, which is
handed back to torch's launcher untouched.  The parser class and the defaults
here are shared with the offline commands (``traceml report``, ``compare``),
so this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import NoReturn

from traceml.errors import UsageError

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
DEFAULT_AGGREGATOR_PORT = 29765
DEFAULT_WINDOW_ROWS = 10000  # steps per rank the final summary analyses
MODES = ("summary", "cli", "dashboard")


class UsageErrorParser(argparse.ArgumentParser):
    """argparse, but errors become one-line UsageErrors (the CLI prints them
    without a traceback and exits with status 2)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see '{self.prog} --help')")


@dataclass(frozen=True)
class RunConfig:
    """Everything one ``traceml run``/``watch`` needs to know."""

    command: str  # "run" | "watch"
    mode: str
    logs_dir: str
    session_id: str
    session_id_given: bool
    aggregator_host: str | None
    aggregator_port: int | None
    aggregator_bind_host: str | None
    summary_window_rows: int
    sample_interval_s: float
    dashboard_port: int
    html: bool
    no_trace: bool
    # Facts taken from torch's own options (read, never re-declared).
    training_script: str
    training_script_args: tuple[str, ...]
    module: bool
    no_python: bool
    min_nodes: int
    max_nodes: int
    node_rank: int
    argv: tuple[str, ...]
    torch_args: argparse.Namespace

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1
