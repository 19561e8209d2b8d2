"""Shared state of the patches in one training rank (agent side).

Kept apart from the patches so that a rank traced in watch mode, or a script
that never imports torch, does not import torch through the agent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from traceml.agent.steps import StepTracker


class Probe:
    """Shared state of the patches: the tracker, the clock and the guards."""

    def __init__(self, tracker: StepTracker, clock: Callable[[], float],
                 on_error: Callable[[BaseException], None]) -> None:
        self.tracker = tracker
        self.clock = clock
        self.on_error = on_error
        self.off = False
        self.mute = 0  # >0 while a forward or backward is being timed
        self.in_backward = False
        self.opt_depth = 0
        self.num_optimizer_calls = 0
        self.thread_id = threading.main_thread().ident
        # CudaPhaseTimer once this rank uses CUDA; None on CPU (one check per phase).
        self.cuda_timer: Any = None

    def enter(self, phase: int) -> None:
        try:
            self.tracker.enter(phase, self.clock())
        except Exception as exc:  # fail open: never break training
            self.on_error(exc)

    def exit(self) -> None:
        try:
            self.tracker.exit(self.clock())
        except Exception as exc:
            self.on_error(exc)

    def optimizer_done(self, skipped: bool) -> None:
        try:
            self.tracker.optimizer_done(self.clock(), skipped)
        except Exception as exc:
            self.on_error(exc)


    def skip(self) -> bool:
        """True when a wrapper must pass straight through."""
        return self.off or threading.get_ident() != self.thread_id
