"""GPU time per phase from CUDA events (agent side).

On the training thread, each timed phase records a start and an end event on
the current stream: no synchronisation, about 3 µs per event on an H200 host
(8 µs inside a launch-heavy loop, most of it in the driver).
``Event.record()`` without a stream builds a new Stream object first, which
costs twice that again, so the timer records on Stream objects it caches.
The sender thread later asks each end event ``query()`` and, once the GPU has
passed it, reads ``elapsed_time``; a step whose events are not done yet waits
for the next flush.  Like the CPU times, a phase's GPU time excludes the phases nested
in it (the forward and backward a closure runs inside the optimizer step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from traceml import phases

TIMED = tuple(phases.code(p.name) for p in phases.gpu_timed())
"""The wire codes of the phases CUDA events time, in `protocol.DEVICE_MARK_FIELDS` order."""
POOL_MAX = 4096

# One timed phase: (phase, start event, end event, how many phases enclose it)
Span = tuple[int, Any, Any, int]


class CudaPhaseTimer:
    """Records events around phases; resolves them later, off the training path."""

    def __init__(self, cuda: Any, torch_c: Any = None) -> None:
        """``cuda`` is ``torch.cuda``; ``torch_c`` (``torch._C``) gives the raw
        current-stream lookup, without it events use ``record()``."""
        self.cuda = cuda
        self._pool: deque[Any] = deque()
        self._open: list[tuple[int, Any]] = []  # phase, start event
        self._spans: list[Span] = []
        self._stream = _current_stream_lookup(cuda, torch_c)

    def _event(self) -> Any:
        try:
            event = self._pool.pop()
        except IndexError:
            event = self.cuda.Event(enable_timing=True)
        if self._stream is None:
            event.record()
        else:
            event.record(self._stream())
        return event

    def start(self, phase: int) -> None:
        self._open.append((phase, self._event()))

    def stop(self) -> None:
        if not self._open:
            return
        phase, start = self._open.pop()
        self._spans.append((phase, start, self._event(), len(self._open)))

    def take_step(self) -> list[Span]:
        """The spans of the step that just ended (training thread)."""
        spans, self._spans = self._spans, []
        return spans

    def resolve(self, spans: list[Span]) -> tuple[float, ...] | None:
        """Exclusive GPU ms of each TIMED phase; None until the GPU is done."""
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
        return tuple(totals[p] for p in TIMED)

    def _recycle(self, spans: list[Span]) -> None:
        for _, start, end, _ in spans:
            if len(self._pool) < POOL_MAX:
                self._pool.append(start)
                self._pool.append(end)


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
