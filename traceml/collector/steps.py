"""Step detection and exclusive phase timing (collector side).

A rank's training thread only logs event times, one list per event code
(`traceml.wire.events` has the codes; `traceml.agent.patches` logs them), and
ships them in batches; `traceml.collector.rank_steps.RankSteps` merges each
batch back into one timeline and one `StepTracker` per rank replays it, emitting
one `StepTiming` per training step, so the rank spends nothing on the state
machine.  The tracker is pure, and unit-tested with a fake clock.

The boundary rules (SPEC R-AG-3: optimizer, backward and manual steps, pending
fetches, evaluation passes, input without a DataLoader, nesting) are written out in
docs/step-detection.md.  `StepTracker.replay` handles a phase's begin and end inline
(nine events in ten) and every other code through a table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from traceml import phases
from traceml.collector.step_parts import (
    BACKWARD_RULE,
    MANUAL_RULE,
    MAX_DEPTH,
    OPTIMIZER_RULE,
    Evaluations,
    OpenStep,
    Pending,
    StepTiming,
)
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

HOLD_BACKWARD_STEPS = 32
"""Steps ended by a backward (no optimizer step seen yet) are held back this long:
an optimizer step after fewer backward passes merges them into one step."""

_COPY_PHASE = -1  # a host-to-device copy on the phase stack (input, not a phase of its own)
_BACKWARD = phases.code("backward")


class StepTracker:
    """State machine from phase events to steps."""

    def __init__(self, emit: Callable[[StepTiming], None]) -> None:
        self._emit = emit
        self._open = False  # a step runs (its parts: _step)
        self._complete = False  # ...and its iteration completed (an optimizer step ran)
        self._manual = False  # trace_step's boundaries
        self._fetch_mode = False  # the loop fetches from a DataLoader
        self._step = OpenStep(0.0)
        self._last_opt_end = 0.0
        self._next_step = 0
        self._stack: list[list[Any]] = []  # open phases: [phase, start, time nested in it]
        self._pending = Pending()
        self._nograd_start: float | None = None  # an outermost no-grad forward began
        self._rss: int | None = None
        self._batch: Any = None  # the batch record in effect (`wire.events.BATCH_FIELDS`)
        self._flops: float | None = None
        self._next_flops: tuple[float | None] | None = None  # for the next step, once it begins
        self._optimizer_seen = False
        self._by_backward = False  # the open step was completed by a backward
        self._held: list[StepTiming] = []  # backward-ended steps, not yet emitted
        self._backward_committed = False
        self._evals = Evaluations()
        # The codes that are not a phase's begin or end, by code.
        self._rare: dict[int, Callable[[Any], None]] = {
            NOGRAD_FORWARD: self._on_nograd_forward, EVAL_FORWARD: self._on_eval_forward,
            COPY: self._on_copy, MARK: self._on_mark, MANUAL_ENTER: self._manual_enter,
            MANUAL_EXIT: self._on_manual_exit, RSS: self._on_rss, SPAN: self._on_span,
            BATCH: self._on_batch, FLOP_COUNT: self._on_flop_count, CLOSE: self._on_close}

    # -- the event log ------------------------------------------------------

    def replay(self, events: Iterable[tuple[int, Any] | list[Any]]) -> None:
        """Feed the events logged since the last replay, oldest first (KeyError for a
        code no rank logs).

        A phase's begin and end, nine events in ten, are handled inline; the other
        codes through :attr:`_rare`."""
        stack, rare = self._stack, self._rare
        for code, t in events:
            if code < END:  # a phase begins
                if len(stack) >= MAX_DEPTH:  # begins without ends: not a rank's log
                    self.resync()
                if code in _STARTS_STEP and not stack and self._may_begin():
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
                        self._add_copy(start, t)
                    continue
                if stack:
                    stack[-1][2] += elapsed
                own = elapsed - nested
                if own < 0.0:
                    own = 0.0
                if not stack and phase in _DECIDED_LATER and self._end_outer(phase, code,
                                                                             start, t, own):
                    continue
                if self._open:
                    step = self._step
                    step.acc[phase] += own
                    step.counts[phase] += code != END_UNCOUNTED
                    step.where.place(phase, start, t)
                    if code >= OPTIMIZER_END or (not stack and phase in _ENDS_MATTER):
                        self._completed(phase, code, t)
            else:
                rare[code](t)

    def position(self) -> tuple[int, tuple[int, ...]]:
        """Where the rank stands now: the step in progress (0-based) and the phases
        open, outermost first.  After a step's optimizer step the rank is still in
        that step's tail, until it fetches (or starts) the next one."""
        ahead = self._open and self._complete and bool(self._stack
                                                       or self._pending.num_fetches)
        step = self._next_step + len(self._held) + ahead  # held: finished, not yet numbered
        return step, tuple(entry[0] for entry in self._stack)

    def resync(self) -> None:
        """The log lost events (it overflowed): drop the open step and every
        open phase, and start again from the next boundary."""
        self._stack.clear()
        self._drop_pending()
        self._nograd_start = self._evals.start = None
        if self._open:
            self._finish(self._step.begin, keep=False)

    def close(self) -> None:
        """Process exit: emit the last step if it completed, and the held ones."""
        if self._open:
            self._finish(self._last_opt_end, keep=self._complete)
        self._commit_backward()

    # -- a phase's end ------------------------------------------------------

    def _may_begin(self) -> bool:
        """Whether training activity now may begin a step (or decides pending time)."""
        return (not self._open or self._complete or bool(self._pending.num_fetches)
                or self._nograd_start is not None or self._manual
                or self._evals.start is not None)

    def _end_outer(self, phase: int, code: int, start: float, end: float, own: float) -> bool:
        """An outermost fetch, or an outermost collective while the time waits to learn
        what it was for; True: handled (the step has none of it yet)."""
        if phase == INPUT:
            if code == END_EXHAUSTED and (self._nograd_start is not None
                                          or self._evals.start is not None):
                # The end of an evaluation loop's loader begins nothing, so the
                # work after the evaluation stays out of the next step too.
                self._end_evaluation()
            else:
                self._add_pending(start, end, own)
            return True
        if not self._undecided():
            return False
        if self._evals.start is None:  # else the evaluation's
            self._pending.comm_s[phase] += own
            self._pending.num_comm[phase] += 1
            self._pending.where.place(phase, start, end)
        return True

    def _completed(self, phase: int, code: int, t: float) -> None:
        """An outermost forward (its batch, in a loop without a DataLoader), an
        optimizer step or a backward ended in the open step."""
        if phase == FORWARD and code == END:
            batch = self._batch
            if batch is not None and batch[3] == BATCH_FROM_FORWARD:
                self._step.tally.add(batch[0], batch[1])
        elif code >= OPTIMIZER_END:
            # An optimizer (or GradScaler) step finished: the iteration is complete.
            self._complete = True
            self._last_opt_end = t
            self._step.num_skipped += code == OPTIMIZER_SKIPPED
            if not self._optimizer_seen:  # held steps go first, in order
                self._optimizer_seen = True
                self._commit_backward()
        elif phase == BACKWARD and not self._optimizer_seen and not self._manual:
            # No optimizer step seen yet: the backward ends the iteration.
            self._complete = self._by_backward = True
            self._last_opt_end = t

    # -- the codes that carry no phase ----------------------------------------

    def _on_nograd_forward(self, t: float) -> None:
        """An outermost forward with grad disabled: maybe an evaluation pass."""
        if self._stack:
            return
        if self._evals.start is not None:
            self._drop_pending()  # the fetches it follows were the evaluation's
        elif self._nograd_start is None:
            self._nograd_start = self._boundary(t)

    def _on_copy(self, t: float) -> None:
        if len(self._stack) >= MAX_DEPTH:
            self.resync()
        self._stack.append([_COPY_PHASE, t, 0.0])

    def _on_mark(self, payload: Any) -> None:
        if len(self._step.marks) < MAX_DEPTH:
            self._step.marks.append(payload)

    def _on_manual_exit(self, t: float) -> None:
        if self._open:
            self._finish(t, keep=True)

    def _on_rss(self, value: int | None) -> None:
        self._rss = value

    def _on_span(self, span: tuple[float, float]) -> None:
        if self._undecided():
            if self._evals.start is None:
                self._pending.spans.append(span)
        elif self._open:  # a collective launched before the step counts from its begin
            self._step.in_flight.add(max(span[0], self._step.begin), span[1])

    def _on_batch(self, record: Any) -> None:
        self._batch = record
        if self._open and not self._complete and not self._undecided():
            self._flops = record[2]  # a batch of the running iteration
        else:  # the next iteration's: its FLOPs start with it
            self._next_flops = (record[2],)

    def _on_flop_count(self, count: Any) -> None:
        self._flops = count[0]
        self._next_flops = None
        self._step.counted = self._step.counted or (bool(count[6]) and self._open)

    def _on_close(self, _: float) -> None:
        self.close()

    # -- boundaries ---------------------------------------------------------

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

    def _boundary(self, now: float) -> float:
        start = self._pending.start
        return start if start is not None else now

    def _add_pending(self, start: float, end: float, own: float) -> None:
        if self._nograd_start is not None:
            self._end_evaluation()
        self._pending.add_fetch(start, end, own, self._batch)

    def _end_evaluation(self) -> None:
        """A fetch after a no-grad forward: that was an evaluation pass."""
        nograd_start = self._nograd_start
        if nograd_start is not None and not self._manual and (
                not self._open or self._complete):
            if self._open:
                self._finish(nograd_start, keep=True)
            self._evals.begin(nograd_start)
        self._nograd_start = None
        self._drop_pending()

    def _on_eval_forward(self, t: float) -> None:
        """An outermost forward without grad of a module that trains: between two
        iterations, an evaluation pass (or predictions, plots) begins."""
        if self._evals.start is not None:
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
        self._evals.begin(start)

    def _gap_is_input(self) -> bool:
        """Whether the time from now to the next training activity will be the
        next step's input: a step its optimizer completed, in a loop without a
        DataLoader (a backward-ended step keeps its parameter update)."""
        return (self._open and self._complete and not self._fetch_mode and not self._manual
                and not self._by_backward)

    def _add_copy(self, start: float, end: float) -> None:
        """A host-to-device copy outside every phase: input of the step it is in."""
        if self._evals.start is not None:
            return
        if self._undecided():
            self._pending.comm_s[INPUT] += end - start
            self._pending.where.place(INPUT, start, end)
        elif self._open:
            self._step.acc[INPUT] += end - start
            self._step.where.place(INPUT, start, end)

    def _undecided(self) -> bool:
        """Whether the time now belongs to what comes next: fetches wait to learn
        what they were for, a no-grad forward may be an evaluation pass, or a step
        without a DataLoader has ended with its optimizer."""
        return (bool(self._pending.num_fetches) or self._nograd_start is not None
                or self._evals.start is not None or self._gap_is_input())

    def _drop_pending(self) -> None:
        pending = self._pending
        if pending.holds_time():
            self._pending = Pending()

    def _absorb_pending(self) -> None:
        if self._pending.absorb_into(self._step):
            self._fetch_mode = True
        self._drop_pending()

    def _on_training(self, now: float, code: int) -> None:
        if self._by_backward and self._open and self._complete and (
                code == OPTIMIZER or (code != FORWARD and not self._pending.num_fetches)):
            # Not a new iteration: its first optimizer step (after the last
            # micro-batch's fetch, Lightning's accumulation), or another backward.
            if code == OPTIMIZER:
                self._adopt_optimizer()
            self._complete = False
        if self._evals.start is not None and not self._manual:
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
            if self._pending.start is not None:
                boundary = self._pending.start
                self._finish(boundary, keep=True)
                self._begin_step(boundary)
            elif self._gap_is_input():
                # No DataLoader: the step ended with its optimizer; the time since
                # is where this step's batch was made (less what was timed in it).
                end = self._last_opt_end
                timed = sum(self._pending.comm_s)
                self._finish(end, keep=True)
                self._begin_step(end)
                self._step.acc[INPUT] += max(0.0, now - end - timed)
                if now > end:  # the batch was made between the two
                    self._step.where.place(INPUT, end, now)
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
        self._step.merge(held)
        self._evals.merge(held)

    def _commit_backward(self) -> None:
        """Emit the held backward-ended steps: no optimizer step came."""
        held, self._held = self._held, []
        for step in held:
            self._emit_next(step)

    def _begin_step(self, t: float) -> None:
        self._open = True
        self._complete = False
        self._by_backward = False
        self._evals.step_begins(t)
        self._step = OpenStep(t)
        if self._next_flops is not None:
            self._flops, self._next_flops = self._next_flops[0], None

    def _finish(self, end: float, keep: bool) -> None:
        self._open = False
        if not keep:
            self._evals.step_dropped()
            return
        boundary = (MANUAL_RULE if self._manual else
                    BACKWARD_RULE if self._by_backward else OPTIMIZER_RULE)
        step = self._step
        at_s, end_s, last_at_s, last_end_s = step.where.offsets(step.begin, end)
        backward = step.where.last_begin(_BACKWARD)
        gradient = None if backward is None else step.in_flight.first_launch_from(backward)
        timing = StepTiming(-1, step.begin, max(0.0, end - step.begin), tuple(step.acc),
                            tuple(step.counts), step.num_skipped, tuple(step.marks), self._rss,
                            step.in_flight.total_s(), *step.tally.result(), self._flops,
                            step.counted, boundary, *self._evals.of_step,
                            collective_at_s=(None if step.in_flight.first is None
                                             else max(0.0, step.in_flight.first - step.begin)),
                            collective_end_s=(None if step.in_flight.last is None
                                              else max(0.0, step.in_flight.last - step.begin)),
                            collective_spans_s=step.in_flight.gapped(step.begin),
                            gradient_at_s=(None if gradient is None
                                           else max(0.0, gradient - step.begin)),
                            phase_at_s=at_s, phase_end_s=end_s, phase_last_at_s=last_at_s,
                            phase_last_end_s=last_end_s)
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
_DECIDED_LATER = frozenset({INPUT, *_COLLECTIVE})  # outermost: may wait to learn their step
_ENDS_MATTER = frozenset({FORWARD, BACKWARD})  # outermost: may take a batch, end a step
