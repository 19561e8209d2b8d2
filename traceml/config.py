"""The run configuration: argv parsed once into this object (launcher side).

Nothing after the CLI sees argparse: traceml reads torch's options from the
typed `TorchOptions`, and torch's own namespace is only copied, by
`traceml.launcher.args.torch_namespace`, for each launch.  The parser class and the defaults
here are shared with the offline commands (``traceml report``, ``compare``),
so this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import NoReturn

from traceml.errors import UsageError

# Letters, digits, '_', '.' and '-', but not '.' or '..' alone (not a folder of its own).
SESSION_ID_RE = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,128}$")
DEFAULT_AGGREGATOR_PORT = 29765
DEFAULT_WINDOW_ROWS = 10000  # steps per rank the final summary analyses
MAX_WINDOW_ROWS = 10**9  # --summary-window-rows at most (more steps than any run has)
DEFAULT_CAPTURE_STEPS = 4
"""Steps a capture profiles unless asked otherwise: with 2, one step's stray
milliseconds (the first profiled step's, a preemption) set the operators' excess
25 % off the phase's in the same steps; with 4, 20 runs came to 0.93-1.14 of it
(`scripts/bench_capture_accuracy.py`, README "Profiler captures")."""
DEFAULT_CAPTURE_MAX_MB = 50.0
"""Each capture trace's cap unless asked otherwise: its events, as one JSON array,
hold at most this many MB (10**6 bytes), uncompressed."""
MODES = ("summary", "cli", "dashboard")


class UsageErrorParser(argparse.ArgumentParser):
    """argparse, but errors become one-line UsageErrors (the CLI prints them
    without a traceback and exits with status 2)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see '{self.prog} --help')")


@dataclass(frozen=True)
class TorchOptions:
    """The torchrun options traceml reads after parsing, as torch parsed them."""

    nnodes: str  # "N" or "MIN:MAX"
    nproc_per_node: str  # a number, or torch's "gpu", "cpu", "auto"
    rdzv_backend: str
    rdzv_endpoint: str
    standalone: bool
    master_addr: str
    master_port: int | None  # None: torch's default


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
    stall_timeout_s: float | None  # None: automatic; 0: off
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
    torch: TorchOptions
    # --mode=cli on a terminal: torch writes the workers' output to files here
    # (not to the terminal, where the view is) on the node that shows the view.
    worker_log_dir: str | None
    argv: tuple[str, ...]
    torch_args: argparse.Namespace  # torch's, for torch: see launcher.args.torch_namespace
    count_flops: bool = True  # --no-flops turns it off
    peak_tflops: float = 0.0  # --peak-tflops; 0: the peak table's
    # traceml's or torchrun's options given after the script (they went to the script)
    late_options: tuple[str, ...] = ()
    # options filled from a scheduler's environment (SLURM), before the user's own
    filled_options: tuple[str, ...] = ()
    # a line on a SLURM job this launcher filled nothing for (outside srun, heterogeneous)
    scheduler_hint: str = ""
    # --metrics-port: Prometheus's /metrics on node 0's collector (None: off)
    metrics_port: int | None = None
    metrics_bind_host: str = "127.0.0.1"
    # --otlp-endpoint: the same metrics pushed over OTLP/HTTP from node 0 (None: off)
    otlp_endpoint: str | None = None
    otlp_interval_s: float = 10.0
    # --capture: a profiler capture when a live finding names a rank ("auto") or never
    capture: str = "auto"
    capture_steps: int = DEFAULT_CAPTURE_STEPS  # --capture-steps
    capture_max_mb: float = DEFAULT_CAPTURE_MAX_MB  # --capture-max-mb: each trace's cap

    @property
    def capture_max_bytes(self) -> int:
        return int(self.capture_max_mb * 10**6)

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1
