"""GPU time per phase from CUDA events, on a sample of steps (agent side).

On the training thread, a timed phase records CUDA events on the current
stream: no synchronisation, about 3 µs per event on an H200 host (8 µs inside
a launch-heavy loop, most of it in the driver).  ``Event.record()`` without a
stream builds a new Stream object first, which costs twice that again, so the
timer records on Stream objects it caches.  The sender thread later asks each
end event ``query()`` and, once the GPU has passed it, reads ``elapsed_time``;
a step whose events are not done yet waits for the next flush.  Like the CPU
times, a phase's GPU time excludes the phases nested in it (the forward and
backward a closure runs inside the optimizer step).

Consecutive phases share a boundary: a phase that starts less than
:data:`SHARE_WITHIN_S` after the previous one ended, on the same stream, starts
at that phase's end event instead of recording its own (model forward, loss
forward, backward and optimizer: 5 events instead of 8).  At most one small
op fits in that gap on the training thread (a launch through torch's
dispatcher costs ~5 µs or more of CPU): its GPU time, which before counted in
no phase, counts in the following one.

Only a sample of steps is timed (`StepSampler`, rule in `SamplingRule`): on
the others the patches see no timer and cost what they cost on CPU, and the
allocator is not read.  The sampled steps' allocator peaks are reset after
each read, so each sampled step's peak covers every step since the previous
sampled one.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from traceml import phases

TIMED = tuple(phases.code(p.name) for p in phases.gpu_timed())
"""The wire codes of the phases CUDA events time, in `wire.events.DEVICE_MARK_FIELDS` order."""
ONLY_WHEN_SEEN = frozenset(phases.code(p.name) for p in phases.gpu_timed() if p.collective)
"""Phases whose GPU time is None, not 0, in a timed step without them (communication:
timed only where a CUDA DDP model waits; elsewhere it is not measured)."""
COMM = phases.code("communication")
IN_FLIGHT = -1
"""The span from a CUDA DDP model's first bucket's gradients being ready to the end
of DDP's wait (`CudaPhaseTimer.first_bucket_ready`): the all-reduces in flight, the
part backward hid included; resolved after the TIMED phases, as the last time."""
POOL_MAX = 4096
SHARE_WITHIN_S = 10e-6
"""A phase starting this soon after the previous one ended shares its end event;
the training thread launches at most one small op in so short a gap, and a gap
with real work in it (a functional loss, gradient clipping) keeps its own events."""

# One timed phase: (phase, start event, end event, how many phases enclose it)
Span = tuple[int, Any, Any, int]


class CudaPhaseTimer:
    """Records events around phases; resolves them later, off the training path."""

    def __init__(self, cuda: Any, torch_c: Any = None, share_within_s: float = SHARE_WITHIN_S,
                 clock: Callable[[], float] = perf_counter) -> None:
        """``cuda`` is ``torch.cuda``; ``torch_c`` (``torch._C``) gives the raw
        current-stream lookup, without it events use ``record()``.  With
        ``share_within_s`` 0 every phase records its own two events."""
        self.cuda = cuda
        self.clock = clock
        self._pool: deque[Any] = deque()
        self._open: list[tuple[int, Any]] = []  # phase, start event
        self._spans: list[Span] = []
        self._stream = _current_stream_lookup(cuda, torch_c)
        self.share_within_s = share_within_s
        # The last phase end of this step, for the next start to share: event,
        # stream, clock() when recorded.
        self._last_end: tuple[Any, Any, float] | None = None
        self.spent_s = 0.0  # training-thread time inside start/stop since the last take
        self._ready: Any = None  # the running backward's first-bucket-ready event
        self._ready_by: object = None  # ...whose (the first DDP model's to stamp it)

    def _event(self, stream: Any) -> Any:
        try:
            event = self._pool.pop()
        except IndexError:
            event = self.cuda.Event(enable_timing=True)
        return _record(event, stream)

    def start(self, phase: int) -> None:
        clock = self.clock
        began = clock()
        stream = None if self._stream is None else self._stream()
        last = self._last_end
        if last is not None and last[1] is stream and began - last[2] < self.share_within_s:
            event = last[0]  # consecutive phases: one boundary
        else:
            event = self._event(stream)
        self._open.append((phase, event))
        self.spent_s += clock() - began

    def stop(self) -> None:
        if not self._open:
            return
        clock = self.clock
        began = clock()
        stream = None if self._stream is None else self._stream()
        phase, start = self._open.pop()
        end = self._event(stream)
        self._spans.append((phase, start, end, len(self._open)))
        ready = self._ready
        if phase == COMM and ready is not None:  # DDP's wait ends: in flight since ready
            self._ready = None
            self._spans.append((IN_FLIGHT, ready, end, -1))
        now = clock()
        self._last_end = (end, stream, now)
        self.spent_s += now - began

    def first_bucket_ready(self, model: object = None) -> None:
        """A CUDA DDP model's first bucket's gradients are queued (autograd's thread,
        in a post-accumulate-grad hook of each of its parameters, while the training
        thread waits in backward): its all-reduce can start from here.  Recorded on
        the current stream, again at each of the bucket's parameters (the last one
        counts), for the first ``model`` to stamp in this backward (a backward through
        two DDP models: the earlier launch); DDP's wait ends the in-flight span
        (`stop` of communication)."""
        stream = None if self._stream is None else self._stream()
        if self._ready is None:
            self._ready, self._ready_by = self._event(stream), model
        elif self._ready_by is model:
            _record(self._ready, stream)

    def take_step(self) -> list[Span]:
        """The spans of the step that just ended (training thread); the next
        step's first phase records its own start."""
        spans, self._spans = self._spans, []
        self._last_end = None
        ready, self._ready = self._ready, None
        if ready is not None and len(self._pool) < POOL_MAX:  # no DDP wait closed it
            self._pool.append(ready)
        return spans

    def take_spent_s(self) -> float:
        """Training-thread seconds spent recording events since the last call."""
        spent, self.spent_s = self.spent_s, 0.0
        return spent

    def resolve(self, spans: list[Span]) -> tuple[float | None, ...] | None:
        """Exclusive GPU ms of each TIMED phase (None: a phase of ONLY_WHEN_SEEN that
        the step did not have), then the ms in flight (`IN_FLIGHT`, summed over the
        step's DDP waits; None without one); None until the GPU is done."""
        if any(not end.query() for _, _, end, _ in spans):
            return None
        seen = {phase for phase, _, _, _ in spans}
        totals = {p: 0.0 for p in TIMED}
        in_flight = 0.0
        nested_ms: dict[int, float] = {}  # depth -> time of spans closed inside it
        for phase, start, end, depth in spans:  # in closing order: children first
            ms = float(start.elapsed_time(end))
            if phase == IN_FLIGHT:
                in_flight += ms
                continue
            own = max(0.0, ms - nested_ms.pop(depth + 1, 0.0))
            nested_ms[depth] = nested_ms.get(depth, 0.0) + ms
            if depth == 0:
                nested_ms.pop(0)
            totals[phase] += own
        self._recycle(spans)
        return (*(None if p in ONLY_WHEN_SEEN and p not in seen else totals[p] for p in TIMED),
                in_flight if IN_FLIGHT in seen else None)

    def _recycle(self, spans: list[Span]) -> None:
        seen: set[int] = set()  # a shared boundary is one event in two spans
        for _, start, end, _ in spans:
            for event in (start, end):
                if id(event) not in seen and len(self._pool) < POOL_MAX:
                    seen.add(id(event))
                    self._pool.append(event)


FIRST_TIMED_STEPS = 25
"""Every one of the first steps is timed: the diagnosis' warm-up (at most 5 steps)
and 20 more, so a short run still has GPU times and per-step peaks."""
BUDGET_S = 20e-6
"""Expected training-thread time per step the sampled CUDA work may add, at most..."""
BUDGET_SHARE = 0.01
"""...and at most this share of the step, for steps shorter than 2 ms."""
MAX_EVERY = 64
"""At least one step in this many is timed, whatever it costs."""
NUM_RECENT = 9
"""The running cost and step length are medians of the last this many timed steps,
so one preempted timed step or one long pause (a checkpoint) does not move them."""


@dataclass(frozen=True)
class SamplingRule:
    """Which steps the CUDA path times and reads peaks on.

    The first ``first_steps`` steps are all timed.  After them, steps come in
    blocks of ``every`` consecutive steps and one step at a random place in
    each block is timed (random so that it cannot lock onto a loop's own
    period, such as logging every 10th step).  ``every`` is set again at each
    timed step from the running cost ``c`` of a timed step (the measured time
    its event records and allocator read took on the training thread) and the
    running step length ``T`` (time between step ends), both medians over the
    last `NUM_RECENT` timed steps:
    ``every = ceil(c / min(budget_s, budget_share * T))``, within
    ``[1, max_every]``, so the expected cost per step, ``c / every``, stays
    under ``budget_s`` (and under ``budget_share`` of short steps).
    """

    first_steps: int = FIRST_TIMED_STEPS
    budget_s: float = BUDGET_S
    budget_share: float = BUDGET_SHARE
    max_every: int = MAX_EVERY
    share_within_s: float = SHARE_WITHIN_S  # see `CudaPhaseTimer`

    def every(self, cost_s: float, step_s: float) -> int:
        """Steps per timed step for a timed step costing ``cost_s`` every ``step_s``."""
        budget = min(self.budget_s, self.budget_share * step_s)
        if budget <= 0.0:
            return self.max_every
        return max(1, min(self.max_every, math.ceil(cost_s / budget - 1e-9)))


EVERY_STEP = SamplingRule(first_steps=0, max_every=1, share_within_s=0.0)
"""Traceml's CUDA path before sampling: every step timed with 2 events per phase,
peaks read every step (the "before" of `scripts/bench_overhead.py`)."""


class StepSampler:
    """Counts step ends (training thread) and says which are timed.

    ``left`` is how many step ends from now the next timed one is (1: the next
    one); the caller decrements it at every step end, arms the timer when it
    reaches 1 and calls `timed` when it reaches 0.
    """

    def __init__(self, rule: SamplingRule = SamplingRule(),
                 rng: random.Random | None = None) -> None:
        self.rule = rule
        self.rng = rng or random.Random()
        self.left = 1
        self.gap = 1  # step ends from the last timed one to the next
        self.every = 1
        self.num_timed = 0
        self.last_t: float | None = None  # the last step end, timed or not
        self._costs_s: deque[float] = deque(maxlen=NUM_RECENT)
        self._steps_s: deque[float] = deque(maxlen=NUM_RECENT)
        self._timed_t: float | None = None
        self._to_block_end = 0  # step ends after the last timed one still in its block

    @property
    def cost_s(self) -> float | None:
        """The running cost of a timed step (training-thread seconds)."""
        return statistics.median(self._costs_s) if self._costs_s else None

    @property
    def step_s(self) -> float | None:
        """The running step length (seconds between step ends)."""
        return statistics.median(self._steps_s) if self._steps_s else None

    def num_unread(self) -> int:
        """Step ends since the last timed one (their peaks are not read yet)."""
        return self.gap - self.left

    def timed(self, t: float, cost_s: float) -> int:
        """A timed step ended at ``t``, its CUDA work took ``cost_s``: returns the
        step ends to the next timed one (and sets ``left`` to it)."""
        if self._timed_t is not None:
            self._steps_s.append((t - self._timed_t) / self.gap)
        self._costs_s.append(cost_s)
        self._timed_t = self.last_t = t
        self.num_timed += 1
        rule = self.rule
        if self.num_timed < rule.first_steps or not self._steps_s:
            self.every, offset = 1, 0
        else:
            self.every = rule.every(statistics.median(self._costs_s),
                                    statistics.median(self._steps_s))
            offset = self.rng.randrange(self.every)
        self.gap = self.left = self._to_block_end + 1 + offset
        self._to_block_end = self.every - 1 - offset
        return self.gap


def _record(event: Any, stream: Any) -> Any:
    """``event`` recorded on ``stream`` (None: the current one, by torch's lookup)."""
    if stream is None:
        event.record()
    else:
        event.record(stream)
    return event


def _current_stream_lookup(cuda: Any, torch_c: Any) -> Callable[[], Any] | None:
    """The current CUDA stream as a cached Stream object, from torch's raw
    (stream id, device, type) lookup; None (use ``record()``) when this torch
    lacks the lookup."""
    get_device = getattr(torch_c, "_cuda_getDevice", None)
    get_stream = getattr(torch_c, "_cuda_getCurrentStream", None)
    if get_device is None or get_stream is None:
        return None
    streams: dict[Any, Any] = {}
    make = cuda.Stream

    def current() -> Any:
        key = get_stream(get_device())
        stream = streams.get(key)
        if stream is None:
            if len(streams) > 64:
                streams.clear()
            stream = streams[key] = make(stream_id=key[0], device_index=key[1],
                                         device_type=key[2])
        return stream
    return current


def allocator_bytes(cuda: Any, device: int, which: str) -> tuple[int, int]:
    """(allocated, reserved) bytes of the caching allocator, ``which`` being
    "current" or "peak", from one raw statistics read.  torch's
    ``memory_allocated()``/``max_memory_allocated()`` and friends each flatten
    every statistic in Python first (~110 µs apiece on an H200 host, against
    ~17 µs for this read)."""
    stats = cuda.memory_stats_as_nested_dict(device)

    def get(name: str) -> int:
        return int(stats.get(name, {}).get("all", {}).get(which, 0))

    return get("allocated_bytes"), get("reserved_bytes")
