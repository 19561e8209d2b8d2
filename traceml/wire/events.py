"""A rank's step events (wire: the agent sends them, the collector replays them into
steps, `traceml.collector.steps`).

The rank logs one list of perf_counter times per event code and ships them in
batches (`EventBatch`), with what carries values: device marks, RSS readings, the
collectives' spans, batch sizes and FLOP counts.  Codes below `END`: that phase of
`traceml.phases.PHASES` begins (the code is its position in the table).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from traceml import phases
from traceml.errors import ProtocolError
from traceml.wire.checks import MAX_CLOCK_S, is_number, optional, records, timed_values

INPUT, FORWARD, BACKWARD, OPTIMIZER = (phases.code(n)
                                       for n in ("input", "forward", "backward", "optimizer"))
# The phase-end codes are contiguous (END ... OPTIMIZER_SKIPPED): one comparison.
END = len(phases.PHASES)  # the innermost phase ends
END_UNCOUNTED = END + 1  # ... adding its time but not a call (a parameter-free module)
END_EXHAUSTED = END + 2  # a fetch found its loader empty
OPTIMIZER_END = END + 3  # the outermost optimizer step ends: the iteration is complete
OPTIMIZER_SKIPPED = END + 4  # ... a GradScaler step that skipped the update (inf grads)
NOGRAD_FORWARD = END + 5  # an outermost forward with grad disabled begins
MANUAL_ENTER = END + 6  # trace_step entered
MANUAL_EXIT = END + 7
MARK = END + 8  # device data of the running step (CUDA): the payload is DEVICE_MARK_FIELDS
CLOSE = END + 9  # process exit: the last step ends with its optimizer step
RSS = END + 10  # a reading of the rank's RSS (bytes or None), for the steps finished after it
SPAN = END + 11  # a collective completed: the payload is its (launch, completion) times
BATCH = END + 12  # a batch of another size began to be used: the payload is BATCH_FIELDS
FLOP_COUNT = END + 13  # a FLOP count ended in the running step: FLOP_COUNT_FIELDS
EVAL_FORWARD = END + 14  # an outermost forward with grad disabled of a module that trains begins
COPY = END + 15  # a host-to-device copy on the training thread begins (ends with END)
NUM_EVENT_CODES = END + 16
VALUED = (MARK, RSS, SPAN, BATCH, FLOP_COUNT)
"""Codes whose events carry values: they travel in their own lists, not as times."""

DEVICE_MARK_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes",
                      *(p.gpu_column for p in phases.gpu_timed()), "gpu_collective_ms")
# What a batch holds (`traceml.agent.batch`), logged when it changes: samples
# (its first tensor's leading dimension), tokens (that tensor's elements when it
# holds 2-D integer token ids), the FLOPs per step known for its shape, and
# where it was seen.  None: not measured.
BATCH_FIELDS = ("samples", "tokens", "flops", "source")
BATCH_FROM_FETCH, BATCH_FROM_FORWARD = 0, 1
# One FLOP count (`traceml.agent.flops`): FLOPs of the step (None: abstained,
# see reason), the dtype most of them ran in and its share, the device name torch
# reports and its multiprocessor count, and whether the counter ran in the step.
FLOP_COUNT_FIELDS = ("flops", "dtype", "dtype_share", "device_name", "sm_count", "reason",
                     "ran")
# A rank sends its events early once this many wait: ~2 MB of JSON, well
# under the largest message.
MAX_EVENTS_PER_MESSAGE = 100_000
MAX_EVENTS_ACCEPTED = 2 * MAX_EVENTS_PER_MESSAGE  # a take arrives whole after that count

_TEXT = optional(lambda v: isinstance(v, str))
_NUMBER = optional(is_number)
BATCH_CHECKS = (_NUMBER, _NUMBER, _NUMBER, lambda v: v in (BATCH_FROM_FETCH, BATCH_FROM_FORWARD))
FLOP_COUNT_CHECKS = (_NUMBER, _TEXT, _NUMBER, _TEXT, _NUMBER, _TEXT, lambda v: type(v) is bool)


def _device_mark(values: Any) -> bool:
    return (type(values) is list and len(values) == len(DEVICE_MARK_FIELDS)
            and all(v is None or is_number(v) for v in values))


@dataclass(frozen=True)
class EventBatch:
    """A batch of one rank's step events: ``times[code]`` lists that code's event times;
    ``marks`` are ``(time, DEVICE_MARK_FIELDS)``, ``rss`` ``(time, bytes)`` and
    ``spans`` the collectives' ``(launch, completion)`` times; ``batches`` are
    ``(time, *BATCH_FIELDS)`` and ``flop_counts`` ``(time, *FLOP_COUNT_FIELDS)``.
    ``batch`` counts this rank's event batches (a gap means one was lost);
    ``wall_offset_s`` turns its clock into epoch seconds."""

    KIND: ClassVar[str] = "events"

    batch: int
    wall_offset_s: float
    times: list[list[float]]
    marks: list[Any] = field(default_factory=list)
    rss: list[Any] = field(default_factory=list)
    spans: list[Any] = field(default_factory=list)
    batches: list[Any] = field(default_factory=list)
    flop_counts: list[Any] = field(default_factory=list)

    def payload(self) -> dict[str, Any]:
        return {"batch": self.batch, "wall_offset": self.wall_offset_s, "times": self.times,
                "marks": self.marks, "rss": self.rss, "spans": self.spans,
                "batches": self.batches, "flops": self.flop_counts}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> EventBatch:
        """An events payload, checked; ProtocolError for anything the step tracker
        could not replay, or times no rank's clock reads."""
        values: list[Any] = [payload.get(key, default) for key, default in _PAYLOAD_KEYS]
        _check_shape(*values)
        _check_clock(*values)
        return cls(*values)


_PAYLOAD_KEYS: tuple[tuple[str, Any], ...] = (
    ("batch", None), ("wall_offset", None), ("times", None), ("marks", None), ("rss", None),
    ("spans", []), ("batches", []), ("flops", []))


def _check_shape(batch: Any, offset: Any, times: Any, marks: Any, rss: Any, spans: Any,
                 batches: Any, flop_counts: Any) -> None:
    if type(batch) is not int or batch < 0 or not is_number(offset):
        raise ProtocolError("events payload without batch/wall_offset")
    if (not isinstance(times, list) or len(times) > NUM_EVENT_CODES
            or not all(isinstance(ts, list) and all(map(is_number, ts)) for ts in times)):
        raise ProtocolError("event times are not lists of numbers per code")
    if sum(map(len, times)) > MAX_EVENTS_ACCEPTED or any(
            isinstance(v, list) and len(v) > MAX_EVENTS_ACCEPTED
            for v in (marks, rss, spans, batches, flop_counts)):
        raise ProtocolError("more events than a rank sends in one message")
    if any(times[code] for code in VALUED if code < len(times)):
        raise ProtocolError("marks, RSS readings, spans, batches and FLOP counts travel "
                            "with their values")
    if not timed_values(marks, _device_mark):
        raise ProtocolError("malformed device marks")
    if not timed_values(rss, lambda v: v is None or is_number(v)):
        raise ProtocolError("malformed RSS readings")
    if not timed_values(spans, is_number) or any(s[1] < s[0] for s in spans):
        raise ProtocolError("malformed collective spans")
    if not records(batches, BATCH_CHECKS) or not records(flop_counts, FLOP_COUNT_CHECKS):
        raise ProtocolError("malformed batch sizes or FLOP counts")


def _check_clock(batch: Any, offset: float, times: list[list[float]], marks: list[Any],
                 rss: list[Any], spans: list[Any], *_: Any) -> None:
    if not -MAX_CLOCK_S <= offset <= MAX_CLOCK_S:
        raise ProtocolError("clock offset out of range")
    stamps = [t for ts in times for t in ts]
    stamps += [m[0] for m in marks] + [r[0] for r in rss] + [t for span in spans for t in span]
    if stamps and not -MAX_CLOCK_S <= min(stamps) <= max(stamps) <= MAX_CLOCK_S:
        raise ProtocolError("event times out of range")
