"""Start and stop the live view that ``--mode`` asks for (launcher process).

``--mode=cli`` on a terminal: torch elastic writes the workers' output to
files (``RunConfig.worker_log_dir``, decided when the arguments are parsed;
the launcher hands torch the redirection) so it cannot garble the view; the
view shows the last lines and the folder is printed at the start and the end.
Without a terminal: plain output, workers untouched, a status line now and
then.
``--mode=dashboard``: the server runs in the collector; the launcher prints
its address (and that it moved, when the asked port was taken). Both views
run on the collector's node only, where every rank's data arrives.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from traceml.config import RunConfig
from traceml.store import STORE_FILENAME


class LiveView(Protocol):
    def stop(self) -> None:
        """Close the view; the final summary prints after this returns."""


class _NoView:
    def stop(self) -> None:
        """Nothing to close."""


class _CliView:
    def __init__(self, view: LiveView, log_dir: Path) -> None:
        self.view = view
        self.log_dir = log_dir

    def stop(self) -> None:
        self.view.stop()
        _say(f"the workers' output is in {self.log_dir}")


def _say(message: str) -> None:
    print(f"traceml: {message}", file=sys.stderr, flush=True)


def start_live_view(cfg: RunConfig, session_dir: Path, ready: Mapping[str, Any]) -> LiveView:
    """Start the view of ``cfg.mode`` (before the workers start); ``ready`` is what the
    collector reported when it started, empty on a node without the collector."""
    if cfg.mode != "summary" and not ready:
        _say(f"--mode={cfg.mode}: the live view runs on the collector's node (node 0), "
             "where every rank's data arrives; this node's output stays plain")
        return _NoView()
    if cfg.mode == "dashboard":
        announce_dashboard(ready, cfg.dashboard_port)
        return _NoView()
    if cfg.mode != "cli":
        return _NoView()
    from traceml.live.console import PLAIN_INTERVAL_S, PlainStatus, TerminalView
    from traceml.live.worker_output import WorkerOutput

    db_path = session_dir / STORE_FILENAME
    if cfg.worker_log_dir is None:
        _say(f"--mode=cli: stdout is not a terminal, so plain output and a status line every "
             f"{PLAIN_INTERVAL_S:.0f} s instead of the live view")
        plain = PlainStatus(db_path)
        plain.start()
        return plain
    log_dir = Path(cfg.worker_log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    _say(f"the workers' output goes to {log_dir} (the view shows the last lines)")
    view = TerminalView(db_path, WorkerOutput(log_dir, skip=_entries(log_dir)))
    view.start()
    return _CliView(view, log_dir)


def _entries(folder: Path) -> frozenset[str]:
    """What a reused --log-dir already holds (earlier runs' output is not this run's)."""
    return frozenset(p.name for p in folder.iterdir())


def announce_dashboard(ready: Mapping[str, Any], requested_port: int) -> None:
    """Print the dashboard's address, or why there is none."""
    info = ready.get("dashboard")
    if info is None:
        reason = ready.get("dashboard_error", "the collector did not start it")
        _say(f"warning: no dashboard ({reason}); the run goes on without it")
    elif info["port"] != requested_port:
        _say(f"dashboard port {requested_port} is in use; dashboard at {info['url']} instead")
    else:
        _say(f"dashboard at {info['url']} (live while the run goes)")
