"""The public Python API (runs inside the user's process).

Under ``traceml run`` the agent is armed in every rank and these calls talk to
it; elsewhere they are cheap no-ops that never raise into training.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from types import TracebackType
from typing import Any

from traceml import environment
from traceml.environment import AgentEnv

_warned = False


def _runtime() -> Any:
    module = sys.modules.get("traceml.agent.runtime")
    return None if module is None else module.active()


def init() -> AgentEnv | None:
    """Returns the active configuration under ``traceml run``; elsewhere warns once."""
    global _warned
    env = environment.current()
    if env is not None:
        return env
    if not _warned:
        _warned = True
        warnings.warn("traceml.init(): not running under 'traceml run'; nothing is traced",
                      RuntimeWarning, stacklevel=2)
    return None


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
