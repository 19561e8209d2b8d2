"""Step detection and exclusive phase timing (collector side).

A rank's training thread only logs event times, one list per event code
(`traceml.wire.events` has the codes; `traceml.agent.patches` logs them), and
ships them in batches; `traceml.collector.rank_steps.RankSteps` merges each
batch back into one timeline and one `StepTracker` per rank replays it, emitting
one `StepTiming` per training step, so the rank spends nothing on the state
machine.  The
tracker is pure, and unit-tested with a fake clock.

Boundaries (SPEC R-AG-3):

* A step is *complete* once an optimizer step (or a GradScaler step, skipped or
  not) has finished inside it.  It stays open until the next iteration begins,
  so several optimizers per iteration (GANs) make one step.
* Until a torch.optim step is seen, an outermost backward completes the step
  (a loop that updates parameters itself); the next grad-enabled forward or
  fetch begins the next one.  Such steps are held back (at most
  `HOLD_BACKWARD_STEPS`) in case an optimizer step still comes: gradient
  accumulation before the first one is then one step again.
* The next step begins at the next DataLoader fetch (when the loop uses one)
  or at the next training activity (grad-enabled forward, backward, optimizer
  step) when it does not.  Without a DataLoader, a step completed by its
  optimizer ends there, and the time up to the next step's first training
  activity is that step's input: where its batch was made.  Host-to-device
  copies on the training thread (`COPY`) are input wherever they happen.
  Total time is boundary to boundary.
* Fetches are held as *pending* until the next model activity says what they
  were for: a training activity takes them as input; a forward without grad
  followed by another fetch is an evaluation loop, whose fetches are dropped
  and which closes the finished step where the evaluation began.  So does a
  forward without grad of a module that trains (`EVAL_FORWARD`) between two
  iterations, with or without a DataLoader.  An evaluation lasts until the next
  step begins; its time and count go with that step (``eval_s``, ``num_eval``).
* Phases nest (a closure runs forward and backward inside `optimizer.step`):
  each phase's time excludes the phases inside it.
* `trace_step` switches to manual boundaries: a step ends when the context
  exits and the next one begins at its first fetch or at the next enter.

Samples and tokens (`traceml.agent.batch`): the rank logs a batch record when
the size changes; every fetch the step takes as input (every counted
forward, in a loop without a DataLoader) adds the record in effect.  A FLOP
count ending in a step marks it counted; a step's FLOPs are those of the
latest count, or of the batch record that began it (a shape counted before).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from traceml import phases
from traceml.wire.events import (
    BACKWARD,
    BATCH,
    BATCH_FROM_FORWARD,
    CLOSE,
    COPY,
    END,
    END_EXHAUSTED,
    END_UNCOUNTED,
    EVAL_FORWARD,
    FLOP_COUNT,
    FORWARD,
    INPUT,
    MANUAL_ENTER,
    MANUAL_EXIT,
    MARK,
    NOGRAD_FORWARD,
    OPTIMIZER,
    OPTIMIZER_END,
    OPTIMIZER_SKIPPED,
    RSS,
    SPAN,
)

# Deeper phase nesting, or more device marks in one step, than any training
# loop makes: the events are not a rank's, and are dropped.
MAX_DEPTH = 256

HOLD_BACKWARD_STEPS = 32
"""Steps ended by a backward (no optimizer step seen yet) are held back this long:
an optimizer step after fewer backward passes merges them into one step."""

OPTIMIZER_RULE, BACKWARD_RULE, MANUAL_RULE = phases.STEP_BOUNDARIES
_COPY_PHASE = -1  # a host-to-device copy on the phase stack (input, not a phase of its own)


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
    samples: int | None = None  # in the batches the step consumed; None: not measured
    tokens: int | None = None
    flops: float | None = None  # per step, counted once for the batch shape; None: not known
    flops_counted: bool = False  # the FLOP counter ran in this step (slowed it)
    boundary: str = OPTIMIZER_RULE  # what ended it: one of `traceml.phases.STEP_BOUNDARIES`
    eval_s: float = 0.0  # evaluation wall time that ended where this step began
    num_eval: int = 0  # ...and how many evaluation passes

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
        self._batch: Any = None  # the batch record in effect (`wire.events.BATCH_FIELDS`)
        self._tally = BatchTally()
        self._pending_tally = BatchTally()
        self._flops: float | None = None
        self._next_flops: tuple[float | None] | None = None  # for the next step, once it begins
        self._counted = False
        self._optimizer_seen = False
        self._by_backward = False  # the open step was completed by a backward
        self._held: list[StepTiming] = []  # backward-ended steps, not yet emitted
        self._backward_committed = False
        self._eval_start: float | None = None  # an evaluation pass runs since then
        self._eval_s, self._num_eval = 0.0, 0  # evaluation before the next step begins
        self._step_eval = (0.0, 0)  # ...and before the open one

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
                        or self._nograd_start is not None or self._manual
                        or self._eval_start is not None):
                    # Training activity; a collective is not: it belongs to the
                    # step it runs in, or to an evaluation pass (metrics).
                    self._on_training(t, code)
                stack.append([code, t, 0.0])
            elif code <= OPTIMIZER_SKIPPED:  # the innermost phase ends
                if not stack:
                    continue
                # Its own time excludes the phases nested in it.
                phase, start, nested = stack.pop()
                elapsed = t - start
                if phase == _COPY_PHASE:
                    if not stack:  # in a fetch (pin_memory), the fetch's time has it
                        self._add_copy(elapsed)
                    continue
                if stack:
                    stack[-1][2] += elapsed
                own = elapsed - nested
                if own < 0.0:
                    own = 0.0
                if phase == INPUT and not stack:
                    if code == END_EXHAUSTED and (self._nograd_start is not None
                                                  or self._eval_start is not None):
                        # The end of an evaluation loop's loader begins nothing, so
                        # the work after the evaluation stays out of the next step too.
                        self._end_evaluation()
                    else:
                        self._add_pending(start, own)
                    continue
                if phase in _COLLECTIVE and not stack and self._undecided():
                    if self._eval_start is None:  # else the evaluation's
                        self._pending_comm[phase] += own
                        self._pending_comm_n[phase] += 1
                    continue
                if self._open:
                    self._acc[phase] += own
                    self._counts[phase] += code != END_UNCOUNTED
                    if (phase == FORWARD and code == END and not stack
                            and self._batch is not None
                            and self._batch[3] == BATCH_FROM_FORWARD):
                        self._tally.add(self._batch[0], self._batch[1])
                    if code >= OPTIMIZER_END:
                        # An optimizer (or GradScaler) step finished: the
                        # iteration is complete.
                        self._complete = True
                        self._last_opt_end = t
                        self._num_skipped += code == OPTIMIZER_SKIPPED
                        if not self._optimizer_seen:  # held steps go first, in order
                            self._optimizer_seen = True
                            self._commit_backward()
                    elif (phase == BACKWARD and not stack and not self._optimizer_seen
                          and not self._manual):
                        # No optimizer step seen yet: the backward ends the iteration.
                        self._complete = self._by_backward = True
                        self._last_opt_end = t
            elif code == NOGRAD_FORWARD:
                # An outermost forward with grad disabled: maybe an evaluation pass.
                if stack:
                    pass
                elif self._eval_start is not None:
                    self._drop_pending()  # the fetches it follows were the evaluation's
                elif self._nograd_start is None:
                    self._nograd_start = self._boundary(t)
            elif code == EVAL_FORWARD:
                if not stack:
                    self._on_eval_forward(t)
            elif code == COPY:
                if len(stack) >= MAX_DEPTH:
                    self.resync()
                stack.append([_COPY_PHASE, t, 0.0])
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
                    if self._eval_start is None:
                        self._pending_spans.append(t)
                elif self._open:  # a collective launched before the step counts from its begin
                    self._in_flight.add(max(t[0], self._begin), t[1])
            elif code == BATCH:
                self._batch = t
                if self._open and not self._complete and not self._undecided():
                    self._flops = t[2]  # a batch of the running iteration
                else:  # the next iteration's: its FLOPs start with it
                    self._next_flops = (t[2],)
            elif code == FLOP_COUNT:
                self._flops = t[0]
                self._next_flops = None
                self._counted = self._counted or (bool(t[6]) and self._open)
            elif code == CLOSE:
                self.close()

    def position(self) -> tuple[int, tuple[int, ...]]:
        """Where the rank stands now: the step in progress (0-based) and the phases
        open, outermost first.  After a step's optimizer step the rank is still in
        that step's tail, until it fetches (or starts) the next one."""
        ahead = self._open and self._complete and bool(self._stack or self._pending_n)
        step = self._next_step + len(self._held) + ahead  # held: finished, not yet numbered
        return step, tuple(entry[0] for entry in self._stack)

    # -- internals ----------------------------------------------------------

    def _manual_enter(self, now: float) -> None:
        """``trace_step`` switches to manual boundaries."""
        if not self._manual:
            self._manual = True
            self._commit_backward()
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
        self._nograd_start = self._eval_start = None
        if self._open:
            self._finish(self._begin, keep=False)

    def close(self) -> None:
        """Process exit: emit the last step if it completed, and the held ones."""
        if self._open:
            self._finish(self._last_opt_end, keep=self._complete)
        self._commit_backward()

    def _boundary(self, now: float) -> float:
        return self._pending_start if self._pending_start is not None else now

    def _add_pending(self, start: float, own: float) -> None:
        if self._nograd_start is not None:
            self._end_evaluation()
        if self._pending_start is None:
            self._pending_start = start
        self._pending_s += own
        self._pending_n += 1
        batch = self._batch
        if batch is not None and batch[3] != BATCH_FROM_FORWARD:
            self._pending_tally.add(batch[0], batch[1])

    def _end_evaluation(self) -> None:
        """A fetch after a no-grad forward: that was an evaluation pass."""
        nograd_start = self._nograd_start
        if nograd_start is not None and not self._manual and (
                not self._open or self._complete):
            if self._open:
                self._finish(nograd_start, keep=True)
            self._start_evaluation(nograd_start)
        self._nograd_start = None
        self._drop_pending()

    def _on_eval_forward(self, t: float) -> None:
        """An outermost forward without grad of a module that trains: between two
        iterations, an evaluation pass (or predictions, plots) begins."""
        if self._eval_start is not None:
            self._drop_pending()  # the fetches it follows were the evaluation's
            return
        if self._manual or (self._open and not self._complete):
            # Inside an iteration (a target network): as any no-grad forward.
            if self._nograd_start is None:
                self._nograd_start = self._boundary(t)
            return
        start = self._boundary(t) if self._nograd_start is None else self._nograd_start
        if self._gap_is_input():
            start = self._last_opt_end  # the step ended with its optimizer
        if self._open:
            self._finish(start, keep=True)
        self._nograd_start = None
        self._drop_pending()
        self._start_evaluation(start)

    def _start_evaluation(self, t: float) -> None:
        if self._eval_start is None:
            self._eval_start = t

    def _gap_is_input(self) -> bool:
        """Whether the time from now to the next training activity will be the
        next step's input: a step its optimizer completed, in a loop without a
        DataLoader (a backward-ended step keeps its parameter update)."""
        return (self._open and self._complete and not self._fetch_mode and not self._manual
                and not self._by_backward)

    def _add_copy(self, elapsed: float) -> None:
        """A host-to-device copy outside every phase: input of the step it is in."""
        if self._eval_start is not None:
            return
        if self._undecided():
            self._pending_comm[INPUT] += elapsed
        elif self._open:
            self._acc[INPUT] += elapsed

    def _undecided(self) -> bool:
        """Whether the time now belongs to what comes next: fetches wait to learn
        what they were for, a no-grad forward may be an evaluation pass, or a step
        without a DataLoader has ended with its optimizer."""
        return (bool(self._pending_n) or self._nograd_start is not None
                or self._eval_start is not None or self._gap_is_input())

    def _drop_pending(self) -> None:
        self._pending_start = None
        self._pending_s = 0.0
        self._pending_n = 0
        if self._pending_tally.num:
            self._pending_tally = BatchTally()
        if self._pending_spans or any(self._pending_comm):
            self._pending_comm = [0.0] * len(phases.PHASES)
            self._pending_comm_n = [0] * len(phases.PHASES)
            self._pending_spans = []

    def _absorb_pending(self) -> None:
        if self._pending_n:
            self._acc[INPUT] += self._pending_s
            self._counts[INPUT] += self._pending_n
            self._tally.absorb(self._pending_tally)
            self._fetch_mode = True
        for phase, n in enumerate(self._pending_comm_n):
            if n or self._pending_comm[phase]:  # copies are input time, not a fetch
                self._acc[phase] += self._pending_comm[phase]
                self._counts[phase] += n
        for launch, done in self._pending_spans:
            self._in_flight.add(max(launch, self._begin), done)
        self._drop_pending()

    def _on_training(self, now: float, code: int) -> None:
        if self._by_backward and self._open and self._complete and (
                code == OPTIMIZER or (code != FORWARD and not self._pending_n)):
            # Not a new iteration: its first optimizer step (after the last
            # micro-batch's fetch, Lightning's accumulation), or another backward.
            if code == OPTIMIZER:
                self._adopt_optimizer()
            self._complete = False
        if self._eval_start is not None and not self._manual:
            # The evaluation pass ends where this step begins.
            self._nograd_start = None
            if not self._open:
                self._begin_step(self._boundary(now))
            self._absorb_pending()
            return
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
            elif self._gap_is_input():
                # No DataLoader: the step ended with its optimizer; the time since
                # is where this step's batch was made (less what was timed in it).
                end = self._last_opt_end
                timed = sum(self._pending_comm)
                self._finish(end, keep=True)
                self._begin_step(end)
                self._acc[INPUT] += max(0.0, now - end - timed)
            elif not self._fetch_mode:
                self._finish(now, keep=True)
                self._begin_step(now)
        elif not self._open:
            self._begin_step(self._boundary(now))
        self._absorb_pending()

    def _adopt_optimizer(self) -> None:
        """The first optimizer step: the backward passes before it in this step
        and in the held ones were gradient accumulation, all one step."""
        self._optimizer_seen = True
        self._by_backward = False
        held, self._held = self._held, []
        if not held:
            return
        self._begin = held[0].t_begin
        for step in held:
            for i, (s, n) in enumerate(zip(step.phase_s, step.counts)):
                self._acc[i] += s
                self._counts[i] += n
            self._num_skipped += step.num_skipped
            self._in_flight.add_total(step.collective_s)
        self._marks = [m for step in held for m in step.marks] + self._marks
        tally = BatchTally()  # their batches are this step's too
        for step in held:
            if step.samples is not None or step.tokens is not None:
                tally.add(step.samples, step.tokens)
            self._counted = self._counted or step.flops_counted
        tally.absorb(self._tally)
        self._tally = tally
        eval_s, num_eval = self._step_eval
        self._step_eval = (eval_s + sum(h.eval_s for h in held),
                           num_eval + sum(h.num_eval for h in held))

    def _commit_backward(self) -> None:
        """Emit the held backward-ended steps: no optimizer step came."""
        held, self._held = self._held, []
        for step in held:
            self._emit_next(step)

    def _begin_step(self, t: float) -> None:
        self._open = True
        self._complete = False
        self._by_backward = False
        self._begin = t
        if self._eval_start is not None:
            self._eval_s += max(0.0, t - self._eval_start)
            self._num_eval += 1
            self._eval_start = None
        self._step_eval = (self._eval_s, self._num_eval)
        self._eval_s, self._num_eval = 0.0, 0
        self._acc = [0.0] * len(phases.PHASES)
        self._counts = [0] * len(phases.PHASES)
        self._num_skipped = 0
        self._marks = []
        self._in_flight = InFlight()
        self._tally = BatchTally()
        self._counted = False
        if self._next_flops is not None:
            self._flops, self._next_flops = self._next_flops[0], None

    def _finish(self, end: float, keep: bool) -> None:
        self._open = False
        if not keep:  # the evaluation before it goes with the next step
            self._eval_s += self._step_eval[0]
            self._num_eval += self._step_eval[1]
            return
        boundary = (MANUAL_RULE if self._manual else
                    BACKWARD_RULE if self._by_backward else OPTIMIZER_RULE)
        timing = StepTiming(-1, self._begin, max(0.0, end - self._begin),
                            tuple(self._acc), tuple(self._counts),
                            self._num_skipped, tuple(self._marks), self._rss,
                            self._in_flight.total_s(), *self._tally.result(), self._flops,
                            self._counted, boundary, *self._step_eval)
        if boundary == BACKWARD_RULE and not self._backward_committed:
            self._held.append(timing)
            if len(self._held) >= HOLD_BACKWARD_STEPS:
                self._backward_committed = True
                self._commit_backward()
        else:
            self._emit_next(timing)

    def _emit_next(self, timing: StepTiming) -> None:
        self._emit(timing._replace(step=self._next_step))
        self._next_step += 1


_STARTS_STEP = frozenset(i for i, p in enumerate(phases.PHASES) if phases.starts_step(p))
_COLLECTIVE = frozenset(i for i, p in enumerate(phases.PHASES) if p.collective)


class BatchTally:
    """Samples and tokens of the batches a step consumed; None once one was not measured."""

    __slots__ = ("num", "samples", "tokens")

    def __init__(self) -> None:
        self.num = 0
        self.samples: int | None = 0
        self.tokens: int | None = 0

    def add(self, samples: int | None, tokens: int | None) -> None:
        self.num += 1
        self.samples = None if samples is None or self.samples is None else self.samples + samples
        self.tokens = None if tokens is None or self.tokens is None else self.tokens + tokens

    def absorb(self, other: BatchTally) -> None:
        if other.num:
            self.num += other.num
            self.samples = (None if other.samples is None or self.samples is None
                            else self.samples + other.samples)
            self.tokens = (None if other.tokens is None or self.tokens is None
                           else self.tokens + other.tokens)

    def result(self) -> tuple[int | None, int | None]:
        """(samples, tokens); None for a step no batch was seen in."""
        return (self.samples, self.tokens) if self.num else (None, None)


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

    def add_total(self, total_s: float | None) -> None:
        """Add an earlier step's time in flight (a merged step)."""
        if total_s is not None:
            self._folded_s += total_s
            self._any = True

    def total_s(self) -> float | None:
        """Seconds in flight; None when no collective was timed."""
        if not self._any:
            return None
        return self._folded_s + sum(end - start for start, end in self._blocks)
