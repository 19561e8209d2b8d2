"""One rank's event batches in, its step records out (collector side).

`RankSteps` holds a rank's `traceml.collector.steps.StepTracker`: it merges each
events batch (per-code times, device marks, RSS readings, collective spans,
batch records, FLOP counts) back into one timeline (`merge_events`), replays it,
and turns each `StepTiming` into the store's `StepRow` on the wall clock
(`step_row`).  A lost batch resyncs the tracker; a batch that cannot be replayed is dropped whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from traceml import phases, step_fields
from traceml.collector.step_parts import StepTiming
from traceml.collector.steps import StepTracker
from traceml.errors import ProtocolError
from traceml.records import FlopCount, StepRow
from traceml.wire.events import (
    BATCH,
    CLOSE,
    COPY,
    DEVICE_MARK_FIELDS,
    END,
    END_EXHAUSTED,
    END_UNCOUNTED,
    EVAL_FORWARD,
    FLOP_COUNT,
    MANUAL_ENTER,
    MANUAL_EXIT,
    MARK,
    NOGRAD_FORWARD,
    OPTIMIZER_END,
    OPTIMIZER_SKIPPED,
    RSS,
    SPAN,
    EventBatch,
)
from traceml.wire.identity import Sender

# Events stamped alike.  The rank stamps some so on purpose: an RSS reading as
# the first event it goes with, a step's device mark with the manual end it
# belongs before.  Otherwise order needs a clock finer than the gap between two
# events (perf_counter is nanoseconds on Linux and macOS): of a phase's end and
# the next one's begin, the end goes first.
_TIE_ORDER = {code: i for i, code in enumerate((
    RSS, SPAN, BATCH, END, END_UNCOUNTED, END_EXHAUSTED, OPTIMIZER_END, OPTIMIZER_SKIPPED, MARK,
    FLOP_COUNT, MANUAL_EXIT, CLOSE, MANUAL_ENTER, *range(len(phases.PHASES)), COPY,
    NOGRAD_FORWARD, EVAL_FORWARD))}


def merge_events(times: list[list[float]], marks: list[list[Any]],
                 rss: list[list[Any]], spans: Sequence[Sequence[float]] = (),
                 batches: Sequence[Sequence[Any]] = (),
                 flop_counts: Sequence[Sequence[Any]] = ()) -> list[tuple[int, Any]]:
    """One rank's per-code event times, device marks, RSS readings, collective
    spans (at their completion), batch records and FLOP counts as one timeline
    of ``(code, time or value)``."""
    timeline: list[tuple[float, int, int, Any]] = [
        (t, _TIE_ORDER[code], code, t) for code, ts in enumerate(times) for t in ts]
    timeline += [(t, _TIE_ORDER[MARK], MARK, payload) for t, payload in marks]
    timeline += [(t, _TIE_ORDER[RSS], RSS, value) for t, value in rss]
    timeline += [(done, _TIE_ORDER[SPAN], SPAN, (launch, done)) for launch, done in spans]
    timeline += [(r[0], _TIE_ORDER[BATCH], BATCH, tuple(r[1:])) for r in batches]
    timeline += [(r[0], _TIE_ORDER[FLOP_COUNT], FLOP_COUNT, tuple(r[1:])) for r in flop_counts]
    timeline.sort(key=lambda e: (e[0], e[1]))
    return [(code, value) for _, _, code, value in timeline]


class RankSteps:
    """One rank's steps in the collector: its event batches in, step rows out
    (``identity``: the sender whose rows they are; a test's rank 0 without)."""

    def __init__(self, identity: Sender | None = None) -> None:
        self._records: list[StepRow] = []
        self._identity = {"rank": identity.rank or 0, "restart": identity.restart,
                          "node_rank": identity.node_rank} if identity is not None else {}
        self.tracker = StepTracker(self._emit)
        self._last_batch = -1
        self._wall_offset_s = 0.0
        self.flop_counts: list[FlopCount] = []  # this rank's counts, for the store to take

    def feed(self, payload: dict[str, Any]) -> list[StepRow]:
        """The steps finished by one events payload; ProtocolError when it is
        malformed (nothing of it is replayed then)."""
        return self.feed_batch(EventBatch.from_payload(payload))

    def feed_batch(self, batch: EventBatch) -> list[StepRow]:
        """The steps finished by one checked events payload."""
        if batch.batch != self._last_batch + 1:
            # A batch was lost (dropped at a full queue): what follows starts
            # mid-step.
            self.tracker.resync()
        self._last_batch = batch.batch
        self._wall_offset_s = batch.wall_offset_s
        try:
            self.tracker.replay(merge_events(batch.times, batch.marks, batch.rss, batch.spans,
                                             batch.batches, batch.flop_counts))
        except (TypeError, ValueError, ArithmeticError, IndexError) as exc:
            # Well-formed but impossible (no rank logs this): nothing of the
            # batch is kept, and the next one starts afresh.
            self._records.clear()
            self.tracker.resync()
            raise ProtocolError(f"events that cannot be replayed: {exc!r}") from None
        self.flop_counts += [FlopCount(self._wall_offset_s + r[0], *r[1:]) for r in batch.flop_counts]
        records, self._records = self._records, []
        return records

    def _emit(self, t: StepTiming) -> None:
        self._records.append(step_row(t, self._wall_offset_s, self._identity))


_SPANS_FIELD = step_fields.field("collective_spans_ms")
_PLACE_FIELDS = ("phase_at_s", "phase_end_s", "phase_last_at_s", "phase_last_end_s")
_TIMING_FIELDS = tuple(f for f in StepTiming._fields if f not in (
    "phase_s", "counts", "marks", "collective_spans_s", *_PLACE_FIELDS))
_PHASE_COLUMNS = tuple(p.column for p in phases.PHASES)
_PLACE_COLUMNS = tuple(zip(*(p.place_columns for p in phases.PHASES)))  # per field
_COUNT_COLUMNS = tuple(p.count_column for p in phases.PHASES)


def step_row(t: StepTiming, wall_offset_s: float, identity: dict[str, int]) -> StepRow:
    """The stored row of a tracked step: each of its fields under its column's name
    (``_s`` as ``_ms``), its phases and counts one column each, its device marks
    merged (`merge_device_marks`), its begin on the wall clock."""
    values: dict[str, Any] = dict(identity)
    for name in _TIMING_FIELDS:
        value = getattr(t, name)
        if name.endswith("_s"):
            values[name[:-2] + "_ms"] = None if value is None else value * 1e3
        else:
            values[name] = value
    values["t_begin"] = wall_offset_s + t.t_begin
    values["wait_ms"] = t.wait_s * 1e3
    values.update(zip(_PHASE_COLUMNS, (s * 1e3 for s in t.phase_s)))
    values.update(zip(_COUNT_COLUMNS, t.counts))
    for field, columns in zip(_PLACE_FIELDS, _PLACE_COLUMNS):  # to the µs: a shorter row
        values.update(zip(columns, (None if s is None else round(s * 1e3, 3)
                                    for s in getattr(t, field))))
    values.update(zip(DEVICE_MARK_FIELDS, merge_device_marks(t.marks)))
    if t.collective_spans_s is not None:
        text = spans_text(t.collective_spans_s)
        if step_fields.admits(_SPANS_FIELD, text):  # else no spans, rather than no row
            values["collective_spans_ms"] = text
    return StepRow.of(**values)


def spans_text(spans_s: Sequence[tuple[float, float]]) -> str:
    """Spans in seconds as the ``collective_spans_ms`` column holds them: "begin-end,..." in
    ms, to the µs (`traceml.records.in_flight_spans` reads them back)."""
    def ms(s: float) -> str:
        return f"{s * 1e3:.3f}".rstrip("0").rstrip(".")

    return ",".join(f"{ms(b)}-{ms(e)}" for b, e in spans_s)


def merge_device_marks(marks: tuple[Any, ...]) -> tuple[Any, ...]:
    """A step's device marks (`wire.events.DEVICE_MARK_FIELDS` each) as one: the
    highest memory peaks, and the GPU times summed over its marks when every
    mark has them (a step whose optimizer steps were only partly timed, as the
    agent times a sample of them, has none rather than too little)."""
    if not marks:
        return (None,) * len(DEVICE_MARK_FIELDS)

    def highest(i: int) -> int | None:
        values = [m[i] for m in marks if m[i] is not None]
        return max(values) if values else None

    def total(i: int) -> float | None:
        values = [m[i] for m in marks]
        return None if None in values else float(sum(values))

    return (highest(0), highest(1),
            *(total(i) for i in range(2, len(DEVICE_MARK_FIELDS))))
