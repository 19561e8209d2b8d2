"""Shared state of the patches in one training rank (agent side).

Kept apart from the patches so that a rank traced in watch mode, or a script
that never imports torch, does not import torch through the agent.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

# The sender thread drains the log every 0.1 s; should it stall, the oldest
# events go first and the collector's tracker resynchronises at the next step
# boundary.  About 20 MB, 20k steps.
MAX_EVENTS = 250_000


class Probe:
    """What the patches share: the event log, the clock and the guards.

    The patches run on the training thread and only append ``(code, time)``
    events to ``events`` (codes in `traceml.protocol`); the sender thread ships
    them to the collector, whose `StepTracker` turns them into steps.
    """

    def __init__(self, clock: Callable[[], float],
                 on_error: Callable[[BaseException], None]) -> None:
        self.on_error = on_error
        self.events: deque[tuple[Any, ...]] = deque(maxlen=MAX_EVENTS)
        self.log = self.events.append
        self.clock = clock
        self.off = False
        self.mute = 0  # >0 while a forward or backward is being timed
        self.in_backward = False
        self.opt_depth = 0
        self.num_optimizer_calls = 0
        self.thread_id = threading.main_thread().ident
        # CudaPhaseTimer once this rank uses CUDA; None on CPU (one check per phase).
        self.cuda_timer: Any = None
        # Called on the training thread when an iteration's optimizer steps end
        # (CUDA peaks and spans); None on CPU.
        self.on_optimizer_end: Callable[[], None] | None = None

    def guarded(self, call: Callable[..., Any], *args: Any) -> None:
        """Run an agent call off the hot path (a CUDA timer or device mark),
        fail open: an error turns the agent off, never training."""
        try:
            call(*args)
        except Exception as exc:
            self.on_error(exc)

    def skip(self) -> bool:
        """True when a wrapper must pass straight through."""
        return self.off or threading.get_ident() != self.thread_id
