"""``traceml run``/``watch`` argument parsing (launcher side).

torchrun's options come from torch's own parser (``get_args_parser``), so every
option of the installed torch works with its names, spellings, defaults and
``PET_*`` fallbacks; traceml adds its own options to that parser.  The result
is one `RunConfig`, with the torch options traceml reads in `TorchOptions`
and whether the workers' output goes to files decided here, once.  Torch's
namespace itself is never changed: each launch gets a copy.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from torch.distributed import run as torchrun

from traceml.config import (
    DEFAULT_AGGREGATOR_PORT,
    DEFAULT_CAPTURE_MAX_MB,
    DEFAULT_CAPTURE_STEPS,
    DEFAULT_WINDOW_ROWS,
    MAX_WINDOW_ROWS,
    MODES,
    SESSION_ID_RE,
    RunConfig,
    TorchOptions,
    UsageErrorParser,
)
from traceml.environment import parse_stall_timeout
from traceml.errors import UsageError
from traceml.launcher import slurm
from traceml.wire.captures import MAX_CAPTURE_BYTES, MAX_CAPTURE_STEPS
from traceml.wire.identity import MAX_NODES, MAX_WORLD_SIZE

# dest names of the options traceml adds; everything else belongs to torch.
OWN_DESTS = (
    "mode", "logs_dir", "session_id", "aggregator_host", "aggregator_port",
    "aggregator_bind_host", "summary_window_rows", "sample_interval", "dashboard_port",
    "html", "no_trace", "stall_timeout", "no_flops", "peak_tflops", "metrics_port",
    "metrics_bind_host", "otlp_endpoint", "otlp_interval", "capture", "capture_steps",
    "capture_max_mb",
)
WORKER_LOG_DIR = "workers"  # in the session folder, without torch's --log-dir


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < 1e6:  # inf and nan fail too
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def capture_steps(text: str) -> int:
    """``--capture-steps`` (and ``traceml capture --steps``): 1 to MAX_CAPTURE_STEPS."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_CAPTURE_STEPS:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_CAPTURE_STEPS}, got {text}")
    return value


def number_in(low: float, high: float, what: str) -> Callable[[str], float]:
    """An option's parser: a number from ``low`` to ``high`` (``what`` it counts)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value <= high:  # nan fails too
            raise argparse.ArgumentTypeError(f"must be {what} from {low:g} to {high:g}, "
                                             f"got {text}")
        return value
    return parse


_megabytes = number_in(0.1, MAX_CAPTURE_BYTES / 1e6, "a number of MB")


def _positive_int(text: str) -> int:
    value = int(text)
    if not 0 < value <= MAX_WINDOW_ROWS:  # past 64 bits SQLite takes no such number
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_WINDOW_ROWS}, got {text}")
    return value


def _stall_timeout(text: str) -> float | None:
    try:
        return parse_stall_timeout(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return value


def add_traceml_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("traceml options")
    group.add_argument("--mode", choices=MODES, default="summary",
                       help="What to show while training runs (default: summary, silent).")
    group.add_argument("--logs-dir", "--logs_dir", dest="logs_dir", default="./logs",
                       help="Where session folders are written (default: ./logs).")
    group.add_argument("--session-id", "--session_id", dest="session_id", default=None,
                       help="Session id, [A-Za-z0-9_.-] (default: generated; required "
                            "with --nnodes > 1).")
    group.add_argument("--aggregator-host", "--aggregator_host", dest="aggregator_host",
                       default=None, help="Host of the collector that workers connect to.")
    group.add_argument("--aggregator-port", "--aggregator_port", dest="aggregator_port",
                       type=_port, default=None,
                       help=f"Collector port (default {DEFAULT_AGGREGATOR_PORT}; a free port "
                            "on a single node).")
    group.add_argument("--aggregator-bind-host", "--aggregator_bind_host",
                       dest="aggregator_bind_host", default=None,
                       help="Address the collector binds (default 127.0.0.1 for one node, "
                            "0.0.0.0 for several).")
    group.add_argument("--summary-window-rows", "--summary_window_rows",
                       dest="summary_window_rows", type=_positive_int, default=DEFAULT_WINDOW_ROWS,
                       help="Steps per rank the final summary analyses "
                            f"(default {DEFAULT_WINDOW_ROWS}).")
    group.add_argument("--sample-interval", "--sample_interval", dest="sample_interval",
                       type=_positive_float, default=1.0,
                       help="Seconds between telemetry samples (default 1.0).")
    group.add_argument("--stall-timeout", "--stall_timeout", dest="stall_timeout",
                       type=_stall_timeout, default=None, metavar="SEC",
                       help="Seconds without progress before a rank is reported stalled, with "
                            "its stack (default auto: 20 x the median step, at least 30 s; "
                            "0 turns it off).")
    group.add_argument("--dashboard-port", "--dashboard_port", dest="dashboard_port",
                       type=_port, default=8765, help="Port of --mode=dashboard (default 8765).")
    group.add_argument("--metrics-port", "--metrics_port", dest="metrics_port", type=_port,
                       default=None,
                       help="Serve Prometheus metrics of the live run (steps, phases, "
                            "throughput, the findings) at :PORT/metrics on node 0 "
                            "(default: off; docs/metrics.md).")
    group.add_argument("--metrics-bind-host", "--metrics_bind_host", dest="metrics_bind_host",
                       default="127.0.0.1",
                       help="Address the metrics endpoint binds (default 127.0.0.1; 0.0.0.0 "
                            "for a Prometheus on another host: anyone who reaches the port "
                            "reads the metrics).")
    group.add_argument("--otlp-endpoint", "--otlp_endpoint", dest="otlp_endpoint", default=None,
                       metavar="URL",
                       help="Push the same metrics over OTLP/HTTP to URL (e.g. "
                            "http://otel-collector:4318/v1/metrics) from node 0; needs "
                            "traceml-run[otel] (default: off).")
    group.add_argument("--otlp-interval", "--otlp_interval", dest="otlp_interval",
                       type=_positive_float, default=10.0, metavar="SEC",
                       help="Seconds between OTLP pushes (default 10).")
    group.add_argument("--capture", dest="capture", choices=("auto", "off"), default="auto",
                       help="auto (default): when a live finding names a rank (a straggler, "
                            "COMMUNICATION-BOUND, outlier steps) for a few live windows, "
                            "torch.profiler records the same steps on that rank and on the "
                            "median rank, once per finding kind; off: never on its own "
                            "(traceml capture still asks).")
    group.add_argument("--capture-steps", "--capture_steps", dest="capture_steps",
                       type=capture_steps, default=DEFAULT_CAPTURE_STEPS, metavar="K",
                       help=f"Steps each capture profiles (default {DEFAULT_CAPTURE_STEPS}, "
                            f"at most {MAX_CAPTURE_STEPS}).")
    group.add_argument("--capture-max-mb", "--capture_max_mb", dest="capture_max_mb",
                       type=_megabytes, default=DEFAULT_CAPTURE_MAX_MB, metavar="MB",
                       help="Each capture's trace stops at this many MB of JSON, and says so "
                            f"(default {DEFAULT_CAPTURE_MAX_MB:g}).")
    group.add_argument("--html", action="store_true",
                       help="Also write final_summary.html.")
    group.add_argument("--no-trace", "--no_trace", dest="no_trace", action="store_true",
                       help="Launch the same way with no instrumentation (overhead baseline).")
    group.add_argument("--no-flops", "--no_flops", dest="no_flops", action="store_true",
                       help="Count no FLOPs (no MFU); samples and tokens per second stay.")
    group.add_argument("--peak-tflops", "--peak_tflops", dest="peak_tflops",
                       type=_positive_float, default=None,
                       help="Peak TFLOP/s of one device for MFU, instead of traceml's "
                            "table of accelerators.")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = torchrun.get_args_parser()
    parser.__class__ = UsageErrorParser  # torch's parser, with one-line errors
    parser.prog = prog
    parser.description = (
        "Launch a PyTorch training script exactly as torchrun would, and diagnose it. "
        "Accepts every torchrun option."
    )
    add_traceml_options(parser)
    return parser


def new_session_id() -> str:
    now = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{now}-{secrets.token_hex(3)}"


def late_options(parser: argparse.ArgumentParser, script_args: Sequence[str]) -> tuple[str, ...]:
    """The script's arguments that are options of ``parser`` (traceml's or torchrun's):
    given after the script, they went to the script, as torchrun would pass them."""
    known = set(parser._option_string_actions)  # every spelling of every option
    return tuple(dict.fromkeys(a.split("=", 1)[0] for a in script_args
                               if a.startswith("--") and a.split("=", 1)[0] in known))


def parse(command: str, argv: Sequence[str],
          environ: Mapping[str, str] | None = None) -> RunConfig:
    """Parse ``traceml run|watch`` arguments into a RunConfig (UsageError on bad input).
    Inside a SLURM step the options SLURM's environment gives come first (`slurm`):
    the user's own, after them, win."""
    parser = build_parser(f"traceml {command}")
    environ = os.environ if environ is None else environ
    step = slurm.step_from_env(environ)
    filled = step.launch_options() if step is not None else []
    argv = [*filled, *argv]
    ns = parser.parse_args(argv)
    try:
        min_nodes, max_nodes = torchrun.parse_min_max_nnodes(ns.nnodes)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"traceml {command}: bad --nnodes {ns.nnodes!r}: {exc}") from None
    if not 1 <= min_nodes <= max_nodes <= MAX_NODES:
        raise UsageError(f"traceml {command}: bad --nnodes {ns.nnodes!r}: give N or MIN:MAX "
                         f"with 1 <= MIN <= MAX <= {MAX_NODES}")
    check_torch_values(command, ns)
    if ns.otlp_endpoint is not None:
        from traceml.live.otlp import check_endpoint

        problem = check_endpoint(ns.otlp_endpoint)
        if problem:
            raise UsageError(f"traceml {command}: {problem}")
    check_session_id(command, ns, max_nodes)
    session_id = ns.session_id or new_session_id()
    torch_ns = argparse.Namespace(
        **{k: v for k, v in vars(ns).items() if k not in OWN_DESTS}
    )
    return RunConfig(
        command=command,
        mode=ns.mode,
        logs_dir=ns.logs_dir,
        session_id=session_id,
        session_id_given=ns.session_id is not None,
        aggregator_host=ns.aggregator_host,
        aggregator_port=ns.aggregator_port,
        aggregator_bind_host=ns.aggregator_bind_host,
        summary_window_rows=ns.summary_window_rows,
        sample_interval_s=ns.sample_interval,
        stall_timeout_s=ns.stall_timeout,
        dashboard_port=ns.dashboard_port,
        metrics_port=ns.metrics_port,
        metrics_bind_host=ns.metrics_bind_host,
        otlp_endpoint=ns.otlp_endpoint,
        otlp_interval_s=ns.otlp_interval,
        capture=ns.capture,
        capture_steps=ns.capture_steps,
        capture_max_mb=ns.capture_max_mb,
        html=ns.html,
        no_trace=ns.no_trace,
        training_script=ns.training_script,
        training_script_args=tuple(ns.training_script_args),
        module=bool(ns.module),
        no_python=bool(ns.no_python),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=int(ns.node_rank),
        torch=torch_options(ns),
        worker_log_dir=worker_log_dir(ns, session_id),
        argv=tuple(argv),
        torch_args=torch_ns,
        count_flops=not ns.no_flops,
        peak_tflops=ns.peak_tflops or 0.0,
        late_options=late_options(parser, ns.training_script_args),
        filled_options=tuple(filled),
        # what SLURM would have filled, when nothing was and the run is one node's
        scheduler_hint=(slurm.hint(environ) or "") if step is None and max_nodes == 1 else "",
    )


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # what torchrun's --nproc-per-node accepts besides N


def check_torch_values(command: str, ns: argparse.Namespace) -> None:
    """Values torchrun would fail on with a traceback, as one line each."""
    nproc = str(ns.nproc_per_node)
    try:
        num_local = int(torchrun.determine_local_world_size(nproc))
    except (ValueError, RuntimeError) as exc:  # "gpu" without CUDA: torch says why
        reason = f" ({exc})" if nproc in NPROC_WORDS else ""
        num_local = 0
    else:
        reason = ""
    if not 0 < num_local <= MAX_WORLD_SIZE:
        raise UsageError(f"traceml {command}: bad --nproc-per-node {nproc!r}{reason}: give a "
                         f"number of processes from 1 to {MAX_WORLD_SIZE}, or one of "
                         f"{', '.join(NPROC_WORDS)}")
    if ns.master_port is not None and not 0 < int(ns.master_port) < 65536:
        raise UsageError(f"traceml {command}: bad --master-port {ns.master_port}: give a TCP "
                         "port from 1 to 65535")
    if ns.no_python and shutil.which(ns.training_script) is None:
        raise UsageError(f"traceml {command}: --no-python command not found or not "
                         f"executable: {ns.training_script!r}")


def check_session_id(command: str, ns: argparse.Namespace, max_nodes: int) -> None:
    """A usable ``--session-id``, and one given whenever several nodes must agree on it."""
    if ns.session_id is not None and not SESSION_ID_RE.match(ns.session_id):
        raise UsageError(
            f"traceml {command}: invalid --session-id {ns.session_id!r}: use letters, digits, "
            "'_', '.' and '-' only (not '.' or '..' alone)"
        )
    if max_nodes > 1 and ns.session_id is None:
        raise UsageError(
            f"traceml {command}: --session-id is required with --nnodes {ns.nnodes}: "
            "pass the same id on every node"
        )


def torch_options(ns: argparse.Namespace) -> TorchOptions:
    """The torchrun options traceml reads, read once, here."""
    return TorchOptions(
        nnodes=str(ns.nnodes), nproc_per_node=str(ns.nproc_per_node),
        rdzv_backend=str(ns.rdzv_backend), rdzv_endpoint=str(ns.rdzv_endpoint or ""),
        standalone=bool(ns.standalone), master_addr=str(ns.master_addr),
        master_port=None if ns.master_port is None else int(ns.master_port),
    )


def worker_log_dir(ns: argparse.Namespace, session_id: str) -> str | None:
    """Where the workers' output goes under ``--mode=cli`` on a terminal (torch's
    ``--log-dir``, else the session's folder), so it cannot garble the view;
    None when it stays on the terminal."""
    if ns.mode != "cli" or not sys.stdout.isatty():
        return None
    return str(ns.log_dir or Path(ns.logs_dir) / session_id / WORKER_LOG_DIR)


def torch_namespace(cfg: RunConfig, redirect_output: bool) -> argparse.Namespace:
    """A fresh copy of torch's namespace for one launch (torch's ``run`` writes
    into the one it gets).  ``redirect_output``: this node shows the cli view,
    so torch writes every worker's stdout and stderr to ``cfg.worker_log_dir``
    only (``--redirects 3 --tee 0``)."""
    values = dict(vars(cfg.torch_args))
    if redirect_output and cfg.worker_log_dir is not None:
        values.update(log_dir=cfg.worker_log_dir, redirects="3", tee="0")
    return argparse.Namespace(**values)
