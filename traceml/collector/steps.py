"""Step detection and exclusive phase timing (collector side).

A rank's training thread only logs event times, one list per event code
(`traceml.protocol` has the codes; `traceml.agent.patches` logs them), and
ships them in batches; here `RankSteps` merges each batch back into one
timeline and one `StepTracker` per rank replays it, emitting one `StepTiming`
per training step, so the rank spends nothing on the state machine.  The
tracker is pure, and unit-tested with a fake clock.

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

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from traceml import phases, protocol
from traceml.errors import ProtocolError
from traceml.protocol import (
    CLOSE,
    END,
    END_EXHAUSTED,
    END_UNCOUNTED,
    INPUT,
    MANUAL_ENTER,
    MANUAL_EXIT,
    MARK,
    NOGRAD_FORWARD,
    OPTIMIZER_END,
    OPTIMIZER_SKIPPED,
    RSS,
    SPAN,
)
from traceml.store import StepRecord

# Deeper phase nesting, or more device marks in one step, than any training
# loop makes: the events are not a rank's, and are dropped.
MAX_DEPTH = 256


class StepTiming(NamedTuple):
    """One finished training step of a rank (times in seconds, on its clock)."""

    step: int
    t_begin: float
    total_s: float
    phase_s: tuple[float, ...]  # exclusive time per phase of `traceml.phases.PHASES`
    counts: tuple[int, ...]
    num_skipped: int
    marks: tuple[Any, ...] = ()  # MARK payloads logged while the step ran
    rss_bytes: int | None = None  # the rank's RSS when the step finished
    collective_s: float | None = None  # time any collective was in flight; None: none timed

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
        self._acc = [0.0] * len(phases.PHASES)
        self._counts = [0] * len(phases.PHASES)
        self._num_skipped = 0
        self._last_opt_end = 0.0
        self._next_step = 0
        # Phase stack: [phase, start, time spent in nested phases].
        self._stack: list[list[Any]] = []
        self._pending_start: float | None = None
        self._pending_s = 0.0
        self._pending_n = 0
        # Collectives while the next activity must still say what the time is
        # for (after a fetch, or after a no-grad forward): per phase, and spans.
        self._pending_comm = [0.0] * len(phases.PHASES)
        self._pending_comm_n = [0] * len(phases.PHASES)
        self._pending_spans: list[Any] = []
        self._nograd_start: float | None = None
        self._marks: list[Any] = []
        self._rss: int | None = None
        self._in_flight = InFlight()

    # -- the event log ------------------------------------------------------

    def replay(self, events: Iterable[tuple[int, Any] | list[Any]]) -> None:
        """Feed the events logged since the last replay, oldest first.

        The phase begin/end cases, nine events in ten, are handled inline.
        """
        stack = self._stack
        for code, t in events:
            if code < END:  # a phase begins
                if len(stack) >= MAX_DEPTH:  # begins without ends: not a rank's log
                    self.resync()
                if code in _STARTS_STEP and not stack and (
                        not self._open or self._complete or self._pending_n
                        or self._nograd_start is not None or self._manual):
                    # Training activity; a collective is not: it belongs to the
                    # step it runs in, or to an evaluation pass (metrics).
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
                if phase in _COLLECTIVE and not stack and self._undecided():
                    self._pending_comm[phase] += own
                    self._pending_comm_n[phase] += 1
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
                if len(self._marks) < MAX_DEPTH:
                    self._marks.append(t)
            elif code == MANUAL_ENTER:
                self._manual_enter(t)
            elif code == MANUAL_EXIT:
                if self._open:
                    self._finish(t, keep=True)
            elif code == RSS:
                self._rss = t
            elif code == SPAN:
                if self._undecided():
                    self._pending_spans.append(t)
                elif self._open:  # a collective launched before the step counts from its begin
                    self._in_flight.add(max(t[0], self._begin), t[1])
            elif code == CLOSE:
                self.close()

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

    def _undecided(self) -> bool:
        """Whether the time now belongs to what comes next: fetches wait to learn
        what they were for, or a no-grad forward may be an evaluation pass."""
        return bool(self._pending_n) or self._nograd_start is not None

    def _drop_pending(self) -> None:
        self._pending_start = None
        self._pending_s = 0.0
        self._pending_n = 0
        if self._pending_spans or any(self._pending_comm_n):
            self._pending_comm = [0.0] * len(phases.PHASES)
            self._pending_comm_n = [0] * len(phases.PHASES)
            self._pending_spans = []

    def _absorb_pending(self) -> None:
        if self._pending_n:
            self._acc[INPUT] += self._pending_s
            self._counts[INPUT] += self._pending_n
            self._fetch_mode = True
        for phase, n in enumerate(self._pending_comm_n):
            if n:
                self._acc[phase] += self._pending_comm[phase]
                self._counts[phase] += n
        for launch, done in self._pending_spans:
            self._in_flight.add(max(launch, self._begin), done)
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
        self._acc = [0.0] * len(phases.PHASES)
        self._counts = [0] * len(phases.PHASES)
        self._num_skipped = 0
        self._marks = []
        self._in_flight = InFlight()

    def _finish(self, end: float, keep: bool) -> None:
        self._open = False
        if not keep:
            return
        timing = StepTiming(self._next_step, self._begin, max(0.0, end - self._begin),
                            tuple(self._acc), tuple(self._counts),
                            self._num_skipped, tuple(self._marks), self._rss,
                            self._in_flight.total_s())
        self._next_step += 1
        self._emit(timing)


_STARTS_STEP = frozenset(i for i, p in enumerate(phases.PHASES) if phases.starts_step(p))
_COLLECTIVE = frozenset(i for i, p in enumerate(phases.PHASES) if p.collective)


class InFlight:
    """The union of a step's collective spans, fed in order of completion: the
    time at least one collective was in flight, however many overlapped."""

    def __init__(self) -> None:
        self._blocks: list[list[float]] = []  # disjoint [start, end], by end
        self._folded_s = 0.0  # blocks folded away (too many to keep)
        self._any = False

    def add(self, launch: float, done: float) -> None:
        blocks = self._blocks
        start, end = launch, done
        while blocks and blocks[-1][1] >= launch:  # a late span may end before them
            popped = blocks.pop()
            start, end = min(start, popped[0]), max(end, popped[1])
        blocks.append([start, end])
        self._any = True
        if len(blocks) > MAX_DEPTH:
            first = blocks.pop(0)
            self._folded_s += first[1] - first[0]

    def total_s(self) -> float | None:
        """Seconds in flight; None when no collective was timed."""
        if not self._any:
            return None
        return self._folded_s + sum(end - start for start, end in self._blocks)


# Events stamped alike.  The rank stamps some so on purpose: an RSS reading as
# the first event it goes with, a step's device mark with the manual end it
# belongs before.  Otherwise order needs a clock finer than the gap between two
# events (perf_counter is nanoseconds on Linux and macOS): of a phase's end and
# the next one's begin, the end goes first.
_TIE_ORDER = {code: i for i, code in enumerate((
    RSS, SPAN, END, END_UNCOUNTED, END_EXHAUSTED, OPTIMIZER_END, OPTIMIZER_SKIPPED, MARK, MANUAL_EXIT,
    CLOSE, MANUAL_ENTER, *range(len(phases.PHASES)), NOGRAD_FORWARD))}


def merge_events(times: list[list[float]], marks: list[list[Any]],
                 rss: list[list[Any]], spans: Sequence[Sequence[float]] = ()
                 ) -> list[tuple[int, Any]]:
    """One rank's per-code event times, device marks, RSS readings and
    collective spans (at their completion) as one timeline of ``(code, time or
    value)``."""
    timeline: list[tuple[float, int, int, Any]] = [
        (t, _TIE_ORDER[code], code, t) for code, ts in enumerate(times) for t in ts]
    timeline += [(t, _TIE_ORDER[MARK], MARK, payload) for t, payload in marks]
    timeline += [(t, _TIE_ORDER[RSS], RSS, value) for t, value in rss]
    timeline += [(done, _TIE_ORDER[SPAN], SPAN, (launch, done)) for launch, done in spans]
    timeline.sort(key=lambda e: (e[0], e[1]))
    return [(code, value) for _, _, code, value in timeline]


class RankSteps:
    """One rank's steps in the collector: its event batches in, step records out."""

    def __init__(self) -> None:
        self._records: list[StepRecord] = []
        self.tracker = StepTracker(self._emit)
        self._last_batch = -1
        self._wall_offset_s = 0.0

    def feed(self, payload: dict[str, Any]) -> list[StepRecord]:
        """The steps finished by one events payload; ProtocolError when it is
        malformed (nothing of it is replayed then)."""
        return self.feed_batch(protocol.check_events(payload))

    def feed_batch(self, batch: protocol.EventBatch) -> list[StepRecord]:
        """The steps finished by one checked events payload."""
        if batch.batch != self._last_batch + 1:
            # A batch was lost (dropped at a full queue): what follows starts
            # mid-step.
            self.tracker.resync()
        self._last_batch = batch.batch
        self._wall_offset_s = batch.wall_offset_s
        try:
            self.tracker.replay(merge_events(batch.times, batch.marks, batch.rss, batch.spans))
        except (TypeError, ValueError, ArithmeticError, IndexError) as exc:
            # Well-formed but impossible (no rank logs this): nothing of the
            # batch is kept, and the next one starts afresh.
            self._records.clear()
            self.tracker.resync()
            raise ProtocolError(f"events that cannot be replayed: {exc!r}") from None
        records, self._records = self._records, []
        return records

    def _emit(self, t: StepTiming) -> None:
        alloc, reserved, *gpu = merge_device_marks(t.marks)
        self._records.append(StepRecord(
            step=t.step, t_begin=self._wall_offset_s + t.t_begin, total_ms=t.total_s * 1e3,
            wait_ms=t.wait_s * 1e3, phase_ms=tuple(s * 1e3 for s in t.phase_s),
            counts=t.counts, num_skipped=t.num_skipped, rss_bytes=t.rss_bytes,
            peak_allocated_bytes=alloc, peak_reserved_bytes=reserved, gpu_ms=tuple(gpu),
            collective_ms=None if t.collective_s is None else t.collective_s * 1e3))


def merge_device_marks(marks: tuple[Any, ...]) -> tuple[Any, ...]:
    """A step's device marks (`protocol.DEVICE_MARK_FIELDS` each) as one: the
    highest memory peaks, and the GPU times summed over the marks that have them."""
    if not marks:
        return (None,) * len(protocol.DEVICE_MARK_FIELDS)

    def highest(i: int) -> int | None:
        values = [m[i] for m in marks if m[i] is not None]
        return max(values) if values else None

    def total(i: int) -> float | None:
        values = [m[i] for m in marks if m[i] is not None]
        return float(sum(values)) if values else None

    return (highest(0), highest(1),
            *(total(i) for i in range(2, len(protocol.DEVICE_MARK_FIELDS))))
