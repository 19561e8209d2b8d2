"""Exact step boundaries for the framework callbacks (runs inside a training rank).

Talks to the agent's runtime the way ``traceml.trace_step`` does: under
``traceml run`` the first boundary switches this process to manual steps;
elsewhere every call is a no-op and one warning says so.  Never raises into
training.
"""

from __future__ import annotations

import sys
from typing import Any

from traceml.errors import WarnOnce

_warnings = WarnOnce()


def _runtime() -> Any:
    # The agent module is only loaded in armed ranks; never import it from here.
    module = sys.modules.get("traceml.agent.runtime")
    return None if module is None else module.active()


def _warn_not_traced(owner: str) -> None:
    """Once per process, whichever callback notices first."""
    _warnings.warn("not-traced", f"{owner}: not running under 'traceml run'; steps are not "
                   "traced", stacklevel=3)


class StepBoundaries:
    """Marks where a step begins and ends; ``begin``/``end`` may repeat harmlessly."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.is_open = False

    def begin(self) -> None:
        runtime = _runtime()
        if runtime is None:
            _warn_not_traced(self.owner)
            return
        runtime.step_enter()
        self.is_open = True

    def end(self) -> None:
        runtime = _runtime()
        if runtime is None:
            _warn_not_traced(self.owner)
            return
        if self.is_open:
            runtime.step_exit()
        self.is_open = False
