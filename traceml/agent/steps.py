"""Step detection and exclusive phase timing (runs inside a training rank).

The tracker is pure: it is fed events with timestamps by the patches in
`traceml.agent.patches` and emits one `StepTiming` per training step.  It never
touches torch, so it is unit-tested with a fake clock.

Boundaries (SPEC R-AG-3):

* A step is *complete* once an optimizer step (or a GradScaler step, skipped or
  not) has finished inside it.  It stays open until the next iteration begins,
  so several optimizers per iteration (GANs) make one step.
* The next step begins at the next DataLoader fetch (when the loop uses one)
  or at the next training activity (grad-enabled forward, backward, optimizer
  step) when it does not.  Total time is boundary to boundary.
* Fetches are held as *pending* until the next model activity says what they
  were for: a training activity takes them as input; a forward without grad
  followed by another fetch is an evaluation loop, whose fetches are dropped
  and which closes the finished step where the evaluation began.
* Phases nest (a closure runs forward and backward inside `optimizer.step`):
  each phase's time excludes the phases inside it.
* `trace_step` switches to manual boundaries: a step ends when the context
  exits and the next one begins at its first fetch or at the next enter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

INPUT, FORWARD, BACKWARD, OPTIMIZER = 0, 1, 2, 3
PHASE_NAMES = ("input", "forward", "backward", "optimizer")


class StepTiming(NamedTuple):
    """One finished training step of this rank (times in seconds).

    A NamedTuple, not a dataclass: it is built on the training thread once per
    step, and tuple construction is the cheapest there is.
    """

    step: int
    t_begin: float
    total_s: float
    phase_s: tuple[float, float, float, float]
    counts: tuple[int, int, int, int]
    num_skipped: int

    @property
    def wait_s(self) -> float:
        return max(0.0, self.total_s - sum(self.phase_s))


class StepTracker:
    """State machine from phase events to steps."""

    def __init__(self, emit: Callable[[StepTiming], None]) -> None:
        self._emit = emit
        self._open = False
        self._complete = False
        self._manual = False
        self._fetch_mode = False
        self._begin = 0.0
        self._acc = [0.0, 0.0, 0.0, 0.0]
        self._counts = [0, 0, 0, 0]
        self._num_skipped = 0
        self._last_opt_end = 0.0
        self._next_step = 0
        # Phase stack: [phase, start, time spent in nested phases].
        self._stack: list[list[Any]] = []
        self._pending_start: float | None = None
        self._pending_s = 0.0
        self._pending_n = 0
        self._nograd_start: float | None = None

    @property
    def next_step(self) -> int:
        return self._next_step

    def depth(self, phase: int) -> int:
        """How many frames of ``phase`` are open."""
        return sum(1 for frame in self._stack if frame[0] == phase)

    # -- phases -----------------------------------------------------------

    def enter(self, phase: int, now: float) -> None:
        """A phase begins.  Forward/backward/optimizer are training activity."""
        if phase != INPUT and not self._stack:
            # Fast path: inside an open, unfinished step with nothing pending.
            if (not self._open or self._complete or self._pending_n
                    or self._nograd_start is not None or self._manual):
                self._on_training(now)
        self._stack.append([phase, now, 0.0])

    def exit(self, now: float, count: bool = True, exhausted: bool = False) -> None:
        """The innermost phase ends; ``count=False`` adds its time but not a call.

        ``exhausted``: a fetch that found its loader empty (StopIteration).
        """
        if not self._stack:
            return
        stack = self._stack
        phase, start, nested = stack.pop()
        elapsed = now - start
        if stack:
            stack[-1][2] += elapsed
        own = elapsed - nested
        if own < 0.0:
            own = 0.0
        if phase == INPUT and not stack:
            if exhausted and self._nograd_start is not None:
                # The end of an evaluation loop's loader begins nothing, so the
                # work after the evaluation stays out of the next step too.
                self._end_evaluation()
                return
            self._add_pending(start, own)
            return
        if self._open:
            self._acc[phase] += own
            self._counts[phase] += count

    def optimizer_done(self, now: float, skipped: bool = False) -> None:
        """An optimizer (or GradScaler) step finished: the iteration is complete."""
        if not self._open:
            return
        self._complete = True
        self._last_opt_end = now
        if skipped:
            self._num_skipped += 1

    def nograd_forward(self, now: float) -> None:
        """An outermost forward with grad disabled: maybe an evaluation pass."""
        if self._stack or self._nograd_start is not None:
            return
        self._nograd_start = self._pending_start if self._pending_start is not None else now

    # -- manual boundaries (trace_step) -----------------------------------

    def manual_enter(self, now: float) -> None:
        if not self._manual:
            self._manual = True
            if self._open:
                self._finish(self._boundary(now), keep=self._complete)
        if not self._open:
            self._begin_step(self._boundary(now))
        self._nograd_start = None
        self._absorb_pending()

    def manual_exit(self, now: float) -> None:
        if self._open:
            self._finish(now, keep=True)

    # -- end of run ---------------------------------------------------------

    def close(self) -> None:
        """Process exit: emit the last step if it completed."""
        if self._open:
            self._finish(self._last_opt_end, keep=self._complete)

    # -- internals ----------------------------------------------------------

    def _boundary(self, now: float) -> float:
        return self._pending_start if self._pending_start is not None else now

    def _add_pending(self, start: float, own: float) -> None:
        if self._nograd_start is not None:
            self._end_evaluation()
        if self._pending_start is None:
            self._pending_start = start
        self._pending_s += own
        self._pending_n += 1

    def _end_evaluation(self) -> None:
        """A fetch after a no-grad forward: that was an evaluation pass."""
        nograd_start = self._nograd_start
        if nograd_start is not None and self._open and self._complete and not self._manual:
            self._finish(nograd_start, keep=True)
        self._nograd_start = None
        self._drop_pending()

    def _drop_pending(self) -> None:
        self._pending_start = None
        self._pending_s = 0.0
        self._pending_n = 0

    def _absorb_pending(self) -> None:
        if self._pending_n:
            self._acc[INPUT] += self._pending_s
            self._counts[INPUT] += self._pending_n
            self._fetch_mode = True
        self._drop_pending()

    def _on_training(self, now: float) -> None:
        if self._nograd_start is not None:
            # No fetch since the no-grad forward: it belonged to this step
            # (a frozen teacher, a metric), so the iteration began there.
            now = self._nograd_start
            self._nograd_start = None
        if self._manual:
            if self._open:
                self._absorb_pending()
            return
        if self._open and self._complete:
            if self._pending_start is not None:
                boundary = self._pending_start
                self._finish(boundary, keep=True)
                self._begin_step(boundary)
            elif not self._fetch_mode:
                self._finish(now, keep=True)
                self._begin_step(now)
        elif not self._open:
            self._begin_step(self._boundary(now))
        self._absorb_pending()

    def _begin_step(self, t: float) -> None:
        self._open = True
        self._complete = False
        self._begin = t
        self._acc = [0.0, 0.0, 0.0, 0.0]
        self._counts = [0, 0, 0, 0]
        self._num_skipped = 0

    def _finish(self, end: float, keep: bool) -> None:
        self._open = False
        if not keep:
            return
        timing = StepTiming(self._next_step, self._begin, max(0.0, end - self._begin),
                            tuple(self._acc), tuple(self._counts),  # type: ignore[arg-type]
                            self._num_skipped)
        self._next_step += 1
        self._emit(timing)
