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

The training thread does not run the tracker: the patches only append
``(code, time)`` tuples to an event log (one clock read, one tuple, one
append per event), and `StepTracker.replay` feeds the log to the tracker off
the training path.  Event codes: 0-3 a phase begins (`INPUT` ... `OPTIMIZER`);
the rest are below.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

INPUT, FORWARD, BACKWARD, OPTIMIZER = 0, 1, 2, 3
PHASE_NAMES = ("input", "forward", "backward", "optimizer")

# The phase-end codes are contiguous (END ... OPTIMIZER_SKIPPED): one comparison.
END = 4  # the innermost phase ends
END_UNCOUNTED = 5  # ... adding its time but not a call (a parameter-free module)
END_EXHAUSTED = 6  # a fetch found its loader empty
OPTIMIZER_END = 7  # the outermost optimizer step ends: the iteration is complete
OPTIMIZER_SKIPPED = 8  # ... a GradScaler step that skipped the update (inf grads)
NOGRAD_FORWARD = 9  # an outermost forward with grad disabled begins
MANUAL_ENTER = 10  # trace_step entered
MANUAL_EXIT = 11
MARK = 12  # (MARK, payload): data of the running step (CUDA peaks and spans)
CLOSE = 13  # process exit


class StepTiming(NamedTuple):
    """One finished training step of this rank (times in seconds).

    A NamedTuple, not a dataclass: the replay builds one per step while it
    holds the GIL, and tuple construction is the cheapest there is.
    """

    step: int
    t_begin: float
    total_s: float
    phase_s: tuple[float, float, float, float]
    counts: tuple[int, int, int, int]
    num_skipped: int
    marks: tuple[Any, ...] = ()  # MARK payloads logged while the step ran

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
        self._marks: list[Any] = []

    @property
    def next_step(self) -> int:
        return self._next_step

    # -- the event log ------------------------------------------------------

    def replay(self, events: deque[tuple[Any, Any]]) -> int:
        """Consume the events logged so far, oldest first (one consumer thread);
        returns how many.

        The phase begin/end cases, nine events in ten, are handled inline.
        """
        pop = events.popleft
        stack = self._stack
        done = 0
        while True:
            try:
                code, t = pop()
            except IndexError:
                break
            done += 1
            if code < END:  # a phase begins
                if code != INPUT and not stack and (
                        not self._open or self._complete or self._pending_n
                        or self._nograd_start is not None or self._manual):
                    self._on_training(t)
                stack.append([code, t, 0.0])
            elif code <= OPTIMIZER_SKIPPED:  # the innermost phase ends
                if not stack:
                    continue
                # Its own time excludes the phases nested in it.
                phase, start, nested = stack.pop()
                elapsed = t - start
                if stack:
                    stack[-1][2] += elapsed
                own = elapsed - nested
                if own < 0.0:
                    own = 0.0
                if phase == INPUT and not stack:
                    if code == END_EXHAUSTED and self._nograd_start is not None:
                        # The end of an evaluation loop's loader begins nothing, so
                        # the work after the evaluation stays out of the next step too.
                        self._end_evaluation()
                    else:
                        self._add_pending(start, own)
                    continue
                if self._open:
                    self._acc[phase] += own
                    self._counts[phase] += code != END_UNCOUNTED
                    if code >= OPTIMIZER_END:
                        # An optimizer (or GradScaler) step finished: the
                        # iteration is complete.
                        self._complete = True
                        self._last_opt_end = t
                        self._num_skipped += code == OPTIMIZER_SKIPPED
            elif code == NOGRAD_FORWARD:
                # An outermost forward with grad disabled: maybe an evaluation pass.
                if not stack and self._nograd_start is None:
                    self._nograd_start = self._boundary(t)
            elif code == MARK:
                self._marks.append(t)
            elif code == MANUAL_ENTER:
                self._manual_enter(t)
            elif code == MANUAL_EXIT:
                if self._open:
                    self._finish(t, keep=True)
            elif code == CLOSE:
                self.close()
        return done

    # -- internals ----------------------------------------------------------

    def _manual_enter(self, now: float) -> None:
        """``trace_step`` switches to manual boundaries."""
        if not self._manual:
            self._manual = True
            if self._open:
                self._finish(self._boundary(now), keep=self._complete)
        if not self._open:
            self._begin_step(self._boundary(now))
        self._nograd_start = None
        self._absorb_pending()

    def resync(self) -> None:
        """The log lost events (it overflowed): drop the open step and every
        open phase, and start again from the next boundary."""
        self._stack.clear()
        self._drop_pending()
        self._nograd_start = None
        if self._open:
            self._finish(self._begin, keep=False)

    def close(self) -> None:
        """Process exit: emit the last step if it completed."""
        if self._open:
            self._finish(self._last_opt_end, keep=self._complete)

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
        self._marks = []

    def _finish(self, end: float, keep: bool) -> None:
        self._open = False
        if not keep:
            return
        timing = StepTiming(self._next_step, self._begin, max(0.0, end - self._begin),
                            tuple(self._acc), tuple(self._counts),  # type: ignore[arg-type]
                            self._num_skipped, tuple(self._marks))
        self._next_step += 1
        self._emit(timing)
