"""Shared state of the patches in one training rank (agent side).

Kept apart from the patches so that a rank traced in watch mode, or a script
that never imports torch, does not import torch through the agent.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from traceml.wire.events import NUM_EVENT_CODES

# One timestamp.  A mark (CUDA) also carries a payload: (time, payload).
Mark = tuple[float, Any]


class Probe:
    """What the patches share: the event log, the clock and the guards.

    The log is one list of times per event code (`traceml.wire.events`): the
    training thread records an event by appending a ``clock()`` float to its
    code's list, the cheapest record Python has (no tuple, and nothing else
    allocated that outlives the call).  The sender thread takes the lists
    every tick (`take`); the collector merges them back into one timeline.
    """

    def __init__(self, clock: Callable[[], float],
                 on_error: Callable[[BaseException], None]) -> None:
        self.on_error = on_error
        self.streams: list[list[float]] = [[] for _ in range(NUM_EVENT_CODES)]
        self.appenders: list[Callable[[float], None]] = [s.append for s in self.streams]
        self.marks: list[Mark] = []
        # Collectives' (launch, completion) times, appended at completion
        # (`traceml.agent.comm`), from whichever thread saw it complete.
        self.spans: list[tuple[float, float]] = []
        self._held_spans: list[tuple[float, float]] = []
        # Batch sizes when they change, and FLOP counts: (time, *fields) records of
        # `wire.events.BATCH_FIELDS` / `FLOP_COUNT_FIELDS` (`traceml.agent.batch`, `flops`).
        self.batches: list[tuple[Any, ...]] = []
        self.flop_counts: list[tuple[Any, ...]] = []
        self._held_records: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]] = ([], [])
        # The batch watches (`traceml.agent.batch.BatchWatch`); None: not watched.
        self.fetch_watch: Any = None
        self.forward_watch: Any = None
        self.compiled = False  # torch.compile was called in this process
        self.taken_to = 0.0  # where the last take ended (its horizon, or a held mark)
        self._held: list[list[float]] = [[] for _ in range(NUM_EVENT_CODES)]
        self._held_marks: list[Mark] = []
        self.clock = clock
        self.off = False
        self.mute = 0  # >0 while a forward or backward is being timed
        self.in_backward = False
        self.in_comm = False  # a collective is being timed (no nested timing)
        self.opt_depth = 0
        self.num_inner_steps = 0  # optimizer steps inside another (a GradScaler step)
        self.thread_id = threading.main_thread().ident
        # The CudaPhaseTimer while a step is timed on CUDA (a sample of steps,
        # `traceml.agent.cuda_timing`); None on CPU and on untimed steps (one check per phase).
        self.cuda_timer: Any = None
        # Called with the tensors of each timed backward as it begins, once the
        # process has a DDP model (`traceml.agent.comm`); None before.
        self.on_backward: Callable[[Any], None] | None = None
        # Called on the training thread when an iteration's optimizer steps end
        # (CUDA peaks and spans); None on CPU.
        self.on_optimizer_end: Callable[[float], None] | None = None  # given the end's time
        # trace_step: its exits end the iterations (an optimizer step inside one does
        # not); ``at_manual_exit`` while its exit calls ``on_optimizer_end``.
        self.manual = False
        self.at_manual_exit = False

    def log(self, code: int, t: float | None = None) -> None:
        """Record one event now (or at ``t``), off the hot paths."""
        self.appenders[code](self.clock() if t is None else t)

    def mark(self, payload: Any, t: float | None = None) -> None:
        """Record device data of the running step, now or at ``t`` (training thread)."""
        self.marks.append((self.clock() if t is None else t, payload))

    def take(self, horizon: float, resolve: Callable[[Any], Any] | None = None
             ) -> tuple[list[list[float]], list[Mark]]:
        """The events logged before ``horizon``, per code, and the marks
        (sender thread, lock-free); `take_spans` takes the collectives' spans.

        Each list is cut with C-level slices only, so an append racing with it
        lands either in this take or the next.  An event stamped before
        ``horizon`` may still be on its way (the training thread read the clock,
        then lost the GIL); every event after it in program order is stamped
        after ``horizon``, so holding back those keeps each take a complete
        prefix of the timeline.  ``resolve`` turns each mark's payload into
        what is sent, or returns None while it cannot yet (a GPU behind): the
        take then ends at that mark, which is tried again next time.
        """
        times = [self._cut(code, stream, horizon) for code, stream in enumerate(self.streams)]
        n = len(self.marks)
        marks = self._held_marks + self.marks[:n]
        del self.marks[:n]
        ready: list[Mark] = []
        self.taken_to = horizon
        for t, payload in marks:
            if t >= horizon:
                break
            if resolve is not None:
                payload = resolve(payload)
                if payload is None:
                    self._hold_back(times, t)
                    self.taken_to = t
                    break
            ready.append((t, payload))
        self._held_marks = marks[len(ready):]
        return times, ready

    def take_spans(self) -> list[tuple[float, float]]:
        """The collective spans completed before the last `take` ended (sender
        thread, right after it).  Spans come from several threads, so they are
        filtered, not bisected."""
        horizon = self.taken_to
        n = len(self.spans)
        spans = self._held_spans + self.spans[:n]
        del self.spans[:n]
        self._held_spans = [s for s in spans if s[1] >= horizon]
        return [s for s in spans if s[1] < horizon]

    def take_records(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """The batch-size and FLOP-count records stamped before the last `take`
        ended (sender thread, right after it), so each goes with its events."""
        horizon = self.taken_to
        out = []
        for i, source in enumerate((self.batches, self.flop_counts)):
            n = len(source)
            records = self._held_records[i] + source[:n]
            del source[:n]
            self._held_records[i][:] = [r for r in records if r[0] >= horizon]
            out.append([r for r in records if r[0] < horizon])
        return out[0], out[1]

    def _cut(self, code: int, stream: list[float], horizon: float) -> list[float]:
        n = len(stream)
        if not n and not self._held[code]:
            return []
        times = self._held[code] + stream[:n]
        del stream[:n]
        cut = bisect_left(times, horizon)
        self._held[code] = times[cut:]
        return times[:cut]

    def _hold_back(self, times: list[list[float]], horizon: float) -> None:
        """Return the taken events from ``horizon`` on to the held ones."""
        for code, ts in enumerate(times):
            cut = bisect_left(ts, horizon)
            if cut < len(ts):
                self._held[code][:0] = ts[cut:]
                del ts[cut:]

    def num_held(self) -> int:
        """Events held back by the last take (sender thread)."""
        return sum(map(len, self._held))

    def guarded(self, call: Callable[..., Any], *args: Any) -> None:
        """Run an agent call off the hot path (a CUDA timer or device mark),
        fail open: an error turns the agent off, never training."""
        try:
            call(*args)
        except Exception as exc:
            self.on_error(exc)

    def skip(self) -> bool:
        """True when a wrapper must pass straight through."""
        return self.off or threading.get_ident() != self.thread_id
