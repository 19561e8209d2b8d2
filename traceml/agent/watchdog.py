"""Stalls and crashes of one rank, reported from off the training thread (agent).

Nothing here runs on the training thread while it trains:

* `StallWatch` runs in the sender thread, which takes the training thread's
  events every tick anyway.  When none has come for longer than the stall
  threshold, it takes the training thread's Python stack
  (``sys._current_frames()``) and reports a stall; when phases begin again
  after it, the stall is reported resumed.  It also notices a gap afterwards
  (a C call that held the GIL, so that this thread could not run either): the
  launcher has its stack then (below), and this reports when it ended.
* `Heartbeat` is a small JSON file the sender thread touches every second.
  A C call that holds the GIL stops it; the node's launcher then sends
  `stacks.STACK_SIGNAL`, on which ``faulthandler`` (registered by
  `install_faulthandler`) writes every thread's stack from its C signal handler,
  which needs no GIL.  The same module writes the stack of a fatal signal
  (SIGSEGV, SIGABRT, ...) to the rank's ``.fatal`` file for the launcher.
* `install_excepthook` records an exception that reaches the top of the
  training thread (type, message, traceback, CUDA memory on an out-of-memory
  error), for the sender's last flush at exit.

Threshold: ``--stall-timeout`` seconds, or automatic: 20 times the median
step, at least 30 s; 120 s until 5 steps have completed (first steps compile,
warm caches and allocators).  A stack inside torch.compile's compiler is busy,
not stalled: it is looked at again later.  Detection starts with the first
event: a set-up that hangs before the loop is not reported.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
from collections import deque
from collections.abc import Callable, Sequence
from itertools import chain
from types import TracebackType
from typing import Any

import orjson

from traceml import stacks
from traceml.stacks import StackFiles
from traceml.wire.events import END, MANUAL_EXIT, OPTIMIZER_END, OPTIMIZER_SKIPPED
from traceml.wire.incidents import EXCEPTION, RESUMED, STALL, IncidentReport

AUTO_FLOOR_S = 30.0
AUTO_STEPS = 20
AUTO_WARMUP_S = 120.0
AUTO_MIN_STEPS = 5
HEARTBEAT_S = 1.0
_ITERATION_ENDS = (OPTIMIZER_END, OPTIMIZER_SKIPPED, MANUAL_EXIT)
_COMPILING = ("torch/_dynamo/", "torch/_inductor/")


class StallWatch:
    """Sender thread: whether the training thread makes progress (see the module)."""

    def __init__(self, timeout_s: float | None, thread_id: int | None,
                 wall_offset_s: float,
                 current_frames: Callable[[], dict[int, Any]] = sys._current_frames) -> None:
        self.timeout_s = timeout_s  # None: automatic; 0: off
        self.thread_id = thread_id
        self.wall_offset_s = wall_offset_s
        self.current_frames = current_frames
        self.last: float | None = None  # newest event taken (the rank's clock)
        self.stalled_since: float | None = None  # a stall is open (reported or seen after)
        self.resumed_at: float | None = None  # first event after it
        self._ends: deque[float] = deque(maxlen=33)
        self._look_after = 0.0

    @property
    def enabled(self) -> bool:
        return self.timeout_s != 0

    def threshold_s(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        ends = list(self._ends)
        if len(ends) <= AUTO_MIN_STEPS:
            return AUTO_WARMUP_S
        gaps = sorted(b - a for a, b in zip(ends, ends[1:]))
        return max(AUTO_FLOOR_S, AUTO_STEPS * gaps[len(gaps) // 2])

    def observe(self, times: Sequence[Sequence[float]], now: float,
                final: bool = False) -> list[IncidentReport]:
        """After each take: ``times`` are the events taken, per code; ``now`` the
        rank's clock.  Returns what to report, after those events."""
        if not self.enabled:
            return []
        newest = max((ts[-1] for ts in times if ts), default=None)
        if newest is None:
            return self._look(now) if not final else []
        out: list[IncidentReport] = []
        threshold = self.threshold_s()
        if self.last is not None and self.stalled_since is None and newest - self.last > threshold:
            # This thread could not run either (the GIL was held): find the gap.
            merged = sorted(chain([self.last], *times))
            gap, begin = max((b - a, a) for a, b in zip(merged, merged[1:]))
            if gap > threshold:
                self.stalled_since, self.resumed_at = begin, begin + gap
        if self.stalled_since is not None:
            if self.resumed_at is None:
                self.resumed_at = min(ts[0] for ts in times if ts)
            resumed = self.resumed_at
            began = any(ts and ts[-1] >= resumed for ts in times[:END])
            if began and not final:  # a phase began again: steps go on
                out.append(IncidentReport(
                    RESUMED, self.stalled_since + self.wall_offset_s,
                    self.resumed_at + self.wall_offset_s))
                self.stalled_since = self.resumed_at = None
        for code in _ITERATION_ENDS:
            if code < len(times):
                self._ends.extend(times[code])
        self.last = newest
        return out

    def _look(self, now: float) -> list[IncidentReport]:
        """No event this tick: report a stall once it is longer than the threshold."""
        if self.last is None or self.stalled_since is not None or now < self._look_after:
            return []
        threshold = self.threshold_s()
        if now - self.last <= threshold:
            return []
        frame = self.current_frames().get(self.thread_id) if self.thread_id else None
        stack = stacks.of_frame(frame)
        if any(part in stacks.norm_path(f.file) for f in stack for part in _COMPILING):
            self._look_after = now + threshold / 2  # compiling: busy, not stalled
            return []
        self.stalled_since = self.last
        return [IncidentReport(STALL, self.last + self.wall_offset_s, now + self.wall_offset_s,
                               stack, "python")]


class Heartbeat:
    """A rank's heartbeat file: JSON saying who it is and its stall threshold, its
    modification time touched every `HEARTBEAT_S` by the sender thread."""

    def __init__(self, files: StackFiles, rank: int, pid: int, thread_id: int | None) -> None:
        self.files = files
        self.info: dict[str, Any] = {"rank": rank, "pid": pid, "thread": thread_id,
                                     "threshold_s": None}
        self._next = 0.0
        self._written = False

    def beat(self, now: float, threshold_s: float | None) -> None:
        """Sender thread, every tick; ``threshold_s`` None until the loop has begun.
        The file is rewritten only when the threshold moves by a whole second (the
        automatic one follows the median step), else its time is touched once a second."""
        if threshold_s is not None:
            threshold_s = max(1.0, float(round(threshold_s)))
        if threshold_s != self.info["threshold_s"] or not self._written:
            self._written = True
            self.info["threshold_s"] = threshold_s
            tmp = self.files.heartbeat + ".tmp"
            with open(tmp, "wb") as f:
                f.write(orjson.dumps(self.info))
            os.replace(tmp, self.files.heartbeat)
            self._next = now + HEARTBEAT_S
        elif now >= self._next:
            os.utime(self.files.heartbeat)
            self._next = now + HEARTBEAT_S

    def remove(self) -> None:
        """The sender stopped: a silent heartbeat must not read as a stall."""
        try:
            os.unlink(self.files.heartbeat)
        except OSError:
            pass


class FaultFiles:
    """faulthandler writing this rank's stacks into its files (see the module)."""

    def __init__(self, files: StackFiles, on_signal: bool) -> None:
        os.makedirs(os.path.dirname(files.dump), exist_ok=True)
        self._open: list[Any] = []
        self.registered = self.enabled = False
        if on_signal:
            dump = open(files.dump, "w")  # noqa: SIM115 - faulthandler writes to it until exit
            self._open.append(dump)
            faulthandler.register(stacks.STACK_SIGNAL, file=dump, all_threads=True, chain=False)
            self.registered = True
        if not faulthandler.is_enabled():  # the script's own faulthandler stays as it is
            fatal = open(files.fatal, "w")  # noqa: SIM115
            self._open.append(fatal)
            faulthandler.enable(file=fatal, all_threads=True)
            self.enabled = True

    def remove(self) -> None:
        """In a forked child (a DataLoader worker), which is not the rank."""
        if self.registered:
            faulthandler.unregister(stacks.STACK_SIGNAL)
        if self.enabled:
            faulthandler.disable()
        self.registered = self.enabled = False


_REQUESTED = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)\b")
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def out_of_memory_detail(exc: BaseException, cuda: Any) -> dict[str, int | None]:
    """Device memory when ``exc`` is CUDA's out-of-memory error (else empty):
    allocated, reserved and capacity now, and what the failed allocation asked for."""
    message = str(exc)
    if type(exc).__name__ != "OutOfMemoryError" and "CUDA out of memory" not in message:
        return {}
    detail: dict[str, int | None] = {"allocated_bytes": None, "reserved_bytes": None,
                                     "capacity_bytes": None, "requested_bytes": None}
    asked = _REQUESTED.search(message)
    if asked:
        detail["requested_bytes"] = int(float(asked.group(1)) * _UNITS[asked.group(2)])
    try:
        if cuda is not None and cuda.is_initialized():
            device = cuda.current_device()
            detail["allocated_bytes"] = int(cuda.memory_allocated(device))
            detail["reserved_bytes"] = int(cuda.memory_reserved(device))
            detail["capacity_bytes"] = int(cuda.get_device_properties(device).total_memory)
    except Exception:  # the numbers go, the report stays
        pass
    return detail


def exception_report(kind: type[BaseException], exc: BaseException,
                     tb: TracebackType | None, wall_now: float, cuda: Any) -> IncidentReport:
    """An exception that reached the top of the training thread."""
    name = kind.__qualname__
    module = getattr(kind, "__module__", "builtins")
    detail: dict[str, str | int | float | None] = {
        "type": name if module in ("builtins", "__main__") else f"{module}.{name}",
        "message": str(exc)[:500]}
    detail.update(out_of_memory_detail(exc, cuda))
    return IncidentReport(EXCEPTION, wall_now, wall_now, stacks.of_traceback(tb), "python",
                          detail=detail)


def install_excepthook(record: Callable[[type[BaseException], BaseException,
                                         TracebackType | None], None]) -> None:
    """Call ``record`` for an exception that ends the training thread, then the hook
    that was there (Python's, which prints the traceback, or the script's)."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException,
                   tb: TracebackType | None) -> None:
        try:
            record(kind, exc, tb)
        except Exception:  # never in the way of the traceback
            pass
        previous(kind, exc, tb)

    sys.excepthook = excepthook
