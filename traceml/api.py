"""The public Python API (runs inside the user's process).

Under ``traceml run`` the agent is armed in every rank and these calls talk to
it; elsewhere they are cheap no-ops that never raise into training.
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import TracebackType
from typing import Any

from traceml import environment
from traceml.environment import AgentEnv
from traceml.errors import WarnOnce

_warnings = WarnOnce()


def _runtime() -> Any:
    module = sys.modules.get("traceml.agent.runtime")
    return None if module is None else module.active()


_session: Any = None


def init(logs_dir: str = "./logs", session_id: str | None = None,
         sample_interval_s: float = 1.0) -> AgentEnv | None:
    """Start tracing, and return the active configuration.

    Under ``traceml run`` this is a no-op that returns the run's configuration.
    Under plain ``python train.py`` (one process) it starts a collector so the
    same final summary is written at exit.  Anywhere else (another launcher's
    multi-process job) it warns once and does nothing.  It never raises.
    """
    global _session
    env = environment.current()
    if env is not None:
        return env
    if _session is not None:
        return _session.env  # type: ignore[no-any-return]
    if environment.distributed_launch(os.environ):
        _warnings.warn("init-foreign-launch",
                       "traceml.init(): this is a multi-process job not started by "
                       "'traceml run'; launch it with 'traceml run' to trace it", stacklevel=2)
        return None
    try:
        from traceml.inprocess import InProcessSession
        from traceml.launcher.args import new_session_id

        session = InProcessSession(logs_dir, session_id or new_session_id(), sample_interval_s)
        session.start()
    except Exception as exc:  # never raise into training
        _warnings.warn("init-failed", f"traceml.init(): tracing not started: {exc}",
                       stacklevel=2)
        return None
    _session = session
    return session.env


def _load_own_steps(session_dir: Any, load_run: Any) -> Any:
    """Load the run once the collector has stored this rank's steps so far
    (they travel in batches), waiting a bounded time."""
    runtime = _runtime()
    if runtime is not None:
        import time

        seq = runtime.flush_events()
        deadline = time.monotonic() + 5.0
        while (seq is not None and _stored_seq(session_dir, runtime.identity.sender_id) < seq
               and time.monotonic() < deadline):
            time.sleep(0.05)
    return load_run(session_dir)


def _stored_seq(session_dir: Any, sender_id: str) -> int:
    """The last message of ``sender_id`` the collector has committed."""
    from traceml.report.session import open_store

    with open_store(session_dir) as reader:
        return max((s.last_seq for s in reader.senders() if s.sender.sender_id == sender_id),
                   default=-1)


def summary() -> dict[str, float | str]:
    """The flat ``{"traceml/...": value}`` summary of the run so far.

    Ready for ``wandb.log`` or ``mlflow.log_metrics``.  Empty (with one
    warning) when there is no run or its telemetry cannot be read here (on a
    node other than node 0, for instance).
    """
    env = environment.current() or (_session.env if _session is not None else None)
    if env is None or env.session_dir is None:
        _warnings.warn("summary-no-run", "traceml.summary(): no traced run in this process",
                       stacklevel=2)
        return {}
    try:
        from pathlib import Path

        from traceml.report import build_report, flatten_summary, report_to_json
        from traceml.report.session import load_run

        run, window = _load_own_steps(Path(env.session_dir), load_run)
        return flatten_summary(report_to_json(build_report(run, window)))
    except Exception as exc:  # never raise into training
        _warnings.warn("summary-unreadable",
                       f"traceml.summary(): telemetry not readable here: {exc}", stacklevel=2)
        return {}


class _StepContext:
    """Exact step boundaries for one training step."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def __enter__(self) -> None:
        self._runtime.step_enter()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._runtime.step_exit()


def trace_step(model: Any = None) -> contextlib.AbstractContextManager[None]:
    """``with traceml.trace_step(model):`` marks one training step exactly.

    Once used, it replaces automatic step detection in this process.
    """
    runtime = _runtime()
    if runtime is None:
        return contextlib.nullcontext()
    return _StepContext(runtime)
