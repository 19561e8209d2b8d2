"""A step as the step tracker (`traceml.collector.steps`) emits it (`StepTiming`), the
parts it accumulates while the step runs, and the time that still waits to learn what
it was for (collector side)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from traceml import phases
from traceml.step_fields import MAX_SPANS
from traceml.wire.events import BATCH_FROM_FORWARD, INPUT

OPTIMIZER_RULE, BACKWARD_RULE, MANUAL_RULE = phases.STEP_BOUNDARIES

_NEVER = float("inf")

MAX_DEPTH = 256
"""Deeper phase nesting, or more device marks or disjoint collective spans in one step,
than any training loop makes: the events are not a rank's, and are dropped (or
folded)."""


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
    # The first collective's launch after the step's begin (the rank's arrival at it);
    # None: no collective timed
    collective_at_s: float | None = None
    collective_end_s: float | None = None  # the last collective's completion in the step
    # The disjoint spans collectives were in flight, seconds from the step's begin, when
    # there was a gap between them (`InFlight.gapped`); None: no gap, or not known
    collective_spans_s: tuple[tuple[float, float], ...] | None = None
    # The first collective launched at or after the last backward call began, seconds
    # from the step's begin (the rank's arrival at backward's first collective: DDP's
    # first bucket); None: no backward, or no collective launched in or after it
    gradient_at_s: float | None = None
    # Where each phase ran, in seconds from the step's begin (`Placement`): its first
    # call's begin and end, and its last call's when it ran more than once (None: the
    # phase did not run)
    phase_at_s: tuple[float | None, ...] = ()
    phase_end_s: tuple[float | None, ...] = ()
    phase_last_at_s: tuple[float | None, ...] = ()
    phase_last_end_s: tuple[float | None, ...] = ()

    @property
    def wait_s(self) -> float:
        return max(0.0, self.total_s - sum(self.phase_s))


class OpenStep:
    """What the running step accumulated: per phase its exclusive time and calls,
    skipped GradScaler steps, device marks, collectives in flight, batch sizes, whether
    the FLOP counter ran in it."""

    __slots__ = ("begin", "acc", "counts", "where", "num_skipped", "marks", "in_flight",
                 "tally", "counted")

    def __init__(self, begin: float) -> None:
        self.begin = begin
        self.acc = [0.0] * len(phases.PHASES)
        self.counts = [0] * len(phases.PHASES)
        self.where = Placement()
        self.num_skipped = 0
        self.marks: list[Any] = []
        self.in_flight = InFlight()
        self.tally = BatchTally()
        self.counted = False

    def merge(self, held: Sequence[Any]) -> None:
        """Steps a backward ended (`steps.StepTiming`s, held back) that the first
        optimizer step shows were gradient accumulation: they and this one are one
        step, from the first one's begin."""
        self.begin = held[0].t_begin
        for step in held:
            for i, (s, n) in enumerate(zip(step.phase_s, step.counts)):
                self.acc[i] += s
                self.counts[i] += n
            self.num_skipped += step.num_skipped
            self.where.absorb_offsets(step.t_begin, step.phase_at_s, step.phase_end_s)
            self.where.absorb_offsets(step.t_begin, step.phase_last_at_s, step.phase_last_end_s)
            self.in_flight.add_total(step.collective_s)
            if step.collective_at_s is not None:
                self.in_flight.launched(step.t_begin + step.collective_at_s)
            if step.collective_end_s is not None:
                self.in_flight.completed(step.t_begin + step.collective_end_s)
        self.marks = [m for step in held for m in step.marks] + self.marks
        tally = BatchTally()  # their batches are this step's too
        for step in held:
            if step.samples is not None or step.tokens is not None:
                tally.add(step.samples, step.tokens)
            self.counted = self.counted or step.flops_counted
        tally.absorb(self.tally)
        self.tally = tally


class Placement:
    """Where each phase's calls ran in a step: the first call (the earliest begin; of
    nested calls the outer one) and the last (the latest end), on the rank's clock.  A
    phase that ran once has one call; one that ran twice, both; of more, the calls
    between are not placed."""

    __slots__ = ("first_at", "first_end", "last_at", "last_end")

    def __init__(self) -> None:
        n = len(phases.PHASES)
        self.first_at, self.first_end = [_NEVER] * n, [_NEVER] * n
        self.last_at, self.last_end = [-_NEVER] * n, [-_NEVER] * n

    def place(self, phase: int, start: float, end: float) -> None:
        """A call of ``phase`` ran from ``start`` to ``end``."""
        if start < self.first_at[phase] or (start == self.first_at[phase]
                                            and end > self.first_end[phase]):
            self.first_at[phase], self.first_end[phase] = start, end
        if end > self.last_end[phase] or (end == self.last_end[phase]
                                          and start < self.last_at[phase]):
            self.last_at[phase], self.last_end[phase] = start, end

    def placed_any(self) -> bool:
        return any(at != _NEVER for at in self.first_at)

    def last_begin(self, phase: int) -> float | None:
        """When the last call of ``phase`` began; None when it did not run."""
        return None if self.first_at[phase] == _NEVER else self.last_at[phase]

    def absorb(self, other: Placement) -> None:
        """The calls ``other`` placed (pending time that turned out to be this step's)."""
        for phase, at in enumerate(other.first_at):
            if at != _NEVER:
                self.place(phase, at, other.first_end[phase])
                self.place(phase, other.last_at[phase], other.last_end[phase])

    def absorb_offsets(self, begin: float, at: Sequence[float | None],
                       end: Sequence[float | None]) -> None:
        """Calls given as offsets from ``begin`` (a held step's, merged into this one)."""
        for phase, (a, e) in enumerate(zip(at, end)):
            if a is not None and e is not None:
                self.place(phase, begin + a, begin + e)

    def offsets(self, begin: float, end: float) -> tuple[tuple[float | None, ...], ...]:
        """The first calls' begins and ends and the last calls' (None when it is the
        first), in seconds from ``begin``, within the step (``begin`` to ``end``)."""
        total = max(0.0, end - begin)

        def within(t: float) -> float:
            return min(total, max(0.0, t - begin))

        columns: list[list[float | None]] = [[], [], [], []]
        for phase, at in enumerate(self.first_at):
            if at == _NEVER:
                row: tuple[float | None, ...] = (None, None, None, None)
            else:
                first = (within(at), within(self.first_end[phase]))
                last_at, last_end = self.last_at[phase], self.last_end[phase]
                same = (last_at, last_end) == (at, self.first_end[phase])
                row = first + ((None, None) if same else (within(last_at), within(last_end)))
            for column, value in zip(columns, row):
                column.append(value)
        return tuple(tuple(c) for c in columns)


class Evaluations:
    """Evaluation passes, kept out of the steps: the one running (since ``start``),
    those that ended before the next step begins, and those that ended where the open
    step began (``of_step``: wall seconds and passes, which go with it)."""

    __slots__ = ("start", "waiting_s", "num_waiting", "of_step")

    def __init__(self) -> None:
        self.start: float | None = None
        self.waiting_s, self.num_waiting = 0.0, 0
        self.of_step = (0.0, 0)

    def begin(self, t: float) -> None:
        if self.start is None:
            self.start = t

    def step_begins(self, t: float) -> None:
        """A step begins at ``t``: the running pass ends there, and every pass since the
        last step began goes with the new one."""
        if self.start is not None:
            self.waiting_s += max(0.0, t - self.start)
            self.num_waiting += 1
            self.start = None
        self.of_step = (self.waiting_s, self.num_waiting)
        self.waiting_s, self.num_waiting = 0.0, 0

    def step_dropped(self) -> None:
        """The open step is not kept: its passes go with the next one."""
        self.waiting_s += self.of_step[0]
        self.num_waiting += self.of_step[1]

    def merge(self, held: Sequence[Any]) -> None:
        """Held steps merged into the open one (`OpenStep.merge`): their passes too."""
        self.of_step = (self.of_step[0] + sum(h.eval_s for h in held),
                        self.of_step[1] + sum(h.num_eval for h in held))


class Pending:
    """Time that waits for the next model activity to say what it was for: fetches (a
    training step's input, or an evaluation loop's?) and the collectives and copies
    since, per phase, with the batches the fetches took."""

    __slots__ = ("start", "fetch_s", "num_fetches", "comm_s", "num_comm", "spans", "tally",
                 "where")

    def __init__(self) -> None:
        self.start: float | None = None  # where the first pending fetch began
        self.fetch_s = 0.0
        self.num_fetches = 0
        self.comm_s = [0.0] * len(phases.PHASES)  # per phase (input: copies)
        self.num_comm = [0] * len(phases.PHASES)
        self.spans: list[Any] = []  # collectives' (launch, completion)
        self.tally = BatchTally()
        self.where = Placement()  # where the pending calls ran

    def holds_time(self) -> bool:
        """Whether anything is pending: a collective span, or any call (a fetch, a
        collective, a copy; one of no time too), each of which is placed."""
        return bool(self.spans) or self.where.placed_any()

    def add_fetch(self, start: float, end: float, own_s: float, batch: Any) -> None:
        """A fetch ended (``batch``: the batch record in effect)."""
        if self.start is None:
            self.start = start
        self.where.place(INPUT, start, end)
        self.fetch_s += own_s
        self.num_fetches += 1
        if batch is not None and batch[3] != BATCH_FROM_FORWARD:
            self.tally.add(batch[0], batch[1])

    def absorb_into(self, step: OpenStep) -> bool:
        """The pending time is ``step``'s: its fetches input, its collectives and
        copies their phases; True when fetches were among it."""
        fetched = bool(self.num_fetches)
        if fetched:
            step.acc[INPUT] += self.fetch_s
            step.counts[INPUT] += self.num_fetches
            step.tally.absorb(self.tally)
        for phase, n in enumerate(self.num_comm):
            if n or self.comm_s[phase]:  # copies are input time, not a fetch
                step.acc[phase] += self.comm_s[phase]
                step.counts[phase] += n
        for launch, done in self.spans:
            step.in_flight.add(max(launch, step.begin), done)
        step.where.absorb(self.where)
        return fetched


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
    """The union of a step's collective spans, fed as they complete (mostly in order;
    one logged late lands where it ran): the time at least one collective was in
    flight, however many overlapped, and its disjoint spans."""

    def __init__(self) -> None:
        self._blocks: list[list[float]] = []  # disjoint [start, end], in time order
        self._folded_s = 0.0  # blocks folded away (too many to keep)
        self._launches: list[float] = []  # the latest `MAX_DEPTH` launches, as logged
        self._dropped_launch = -_NEVER  # the latest of the launches dropped from them
        self._any = False
        self.first: float | None = None  # the earliest launch
        self.last: float | None = None  # the latest completion

    def launched(self, launch: float) -> None:
        """A collective launched at ``launch`` (the earliest is kept)."""
        if self.first is None or launch < self.first:
            self.first = launch

    def completed(self, done: float) -> None:
        """A collective completed at ``done`` (the latest is kept)."""
        if self.last is None or done > self.last:
            self.last = done

    def add(self, launch: float, done: float) -> None:
        self.launched(launch)
        self.completed(done)
        launches = self._launches
        launches.append(launch)
        if len(launches) > MAX_DEPTH:
            self._dropped_launch = max(self._dropped_launch, launches.pop(0))
        blocks = self._blocks
        first = len(blocks)  # the first block it touches: the later ones end after it began
        while first and blocks[first - 1][1] >= launch:
            first -= 1
        last = first  # ...up to the first block that begins after it ended
        start, end = launch, done
        while last < len(blocks) and blocks[last][0] <= done:
            start, end = min(start, blocks[last][0]), max(end, blocks[last][1])
            last += 1
        blocks[first:last] = [[start, end]]
        self._any = True
        if len(blocks) > MAX_DEPTH:
            oldest = blocks.pop(0)
            self._folded_s += oldest[1] - oldest[0]

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

    def first_launch_from(self, t: float) -> float | None:
        """The earliest launch at or after ``t`` of the collectives added (not of an
        earlier part's, added as a total); None when none was, or when one of the
        launches no longer kept (more than `MAX_DEPTH` in the step) came at or after it."""
        if self._dropped_launch >= t:
            return None
        return min((launch for launch in self._launches if launch >= t), default=None)

    def gapped(self, begin: float) -> tuple[tuple[float, float], ...] | None:
        """The disjoint spans, seconds after ``begin`` (at or after 0), when there was a
        gap between them and all of them are known: None for one span (the first launch
        to the last completion says it), for more than `step_fields.MAX_SPANS`, and for a
        step merged from parts that had collectives in flight (their spans were added as
        a total)."""
        blocks = self._blocks
        if self._folded_s or not 1 < len(blocks) <= MAX_SPANS:  # a part's, or too many
            return None
        return tuple((max(0.0, start - begin), max(0.0, end - begin)) for start, end in blocks)
