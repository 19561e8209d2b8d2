"""GPU time per phase from CUDA events (agent side).

On the training thread, each timed phase records a start and an end event on
the current stream: no synchronisation, a few µs per event.  The sender
thread later asks each end event ``query()`` and, once the GPU has passed it,
reads ``elapsed_time``; a step whose events are not done yet waits for the
next flush.  Like the CPU times, a phase's GPU time excludes the phases nested
in it (the forward and backward a closure runs inside the optimizer step).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from traceml.agent.steps import BACKWARD, FORWARD, OPTIMIZER

TIMED = (FORWARD, BACKWARD, OPTIMIZER)
POOL_MAX = 4096

# One timed phase: (phase, start event, end event, how many phases enclose it)
Span = tuple[int, Any, Any, int]


class CudaPhaseTimer:
    """Records events around phases; resolves them later, off the training path."""

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        self._pool: deque[Any] = deque()
        self._open: list[tuple[int, Any]] = []  # phase, start event
        self._spans: list[Span] = []

    def _event(self) -> Any:
        try:
            return self._pool.pop()
        except IndexError:
            return self.cuda.Event(enable_timing=True)

    def start(self, phase: int) -> None:
        event = self._event()
        event.record()
        self._open.append((phase, event))

    def stop(self) -> None:
        if not self._open:
            return
        phase, start = self._open.pop()
        end = self._event()
        end.record()
        self._spans.append((phase, start, end, len(self._open)))

    def take_step(self) -> list[Span]:
        """The spans of the step that just ended (training thread)."""
        spans, self._spans = self._spans, []
        return spans

    def resolve(self, spans: list[Span]) -> tuple[float, float, float] | None:
        """Exclusive GPU ms of forward, backward, optimizer; None until the GPU is done."""
        if any(not end.query() for _, _, end, _ in spans):
            return None
        totals = {p: 0.0 for p in TIMED}
        nested_ms: dict[int, float] = {}  # depth -> time of spans closed inside it
        for phase, start, end, depth in spans:  # in closing order: children first
            ms = float(start.elapsed_time(end))
            own = max(0.0, ms - nested_ms.pop(depth + 1, 0.0))
            nested_ms[depth] = nested_ms.get(depth, 0.0) + ms
            if depth == 0:
                nested_ms.pop(0)
            totals[phase] += own
        self._recycle(spans)
        return totals[FORWARD], totals[BACKWARD], totals[OPTIMIZER]

    def _recycle(self, spans: list[Span]) -> None:
        for _, start, end, _ in spans:
            if len(self._pool) < POOL_MAX:
                self._pool.append(start)
                self._pool.append(end)
