"""A bounded ``torch.profiler`` capture of a few steps, asked for by node 0 (agent side).

Node 0 asks a suspect rank and a reference rank to profile the same steps
(`traceml.wire.captures.CaptureAsk`): those after each rank has ended ``start_after``
iterations (optimizer steps, skipped ones, ``trace_step`` exits).  The ask arrives on the
sender thread, which chains a hook onto the iteration's end (``probe.on_optimizer_end``)
only while an ask is open: no other step runs anything.

The hook counts the iterations that end after it was installed; the sender thread,
which counts every iteration it takes from the log, fixes how many had ended before the
hook's first call (the boundary with that exact time), so both know the count of each
boundary.  From boundary ``start_after`` on, the work of each boundary is done at the
next batch (a DataLoader fetch's end, or the training forward's start: the batch watches
of `traceml.agent.batch`, forced to call), not at the boundary itself: an optimizer
step's end runs inside its own profiler range, and a session stopped or started inside
an open range corrupts kineto's state (a segfault in a later stop, seen in 3 of 10
communication-heavy runs before).  The first starts a profiler session (CPU activities,
CUDA ones where this process uses CUDA, input shapes recorded, no stacks); each later
one stops the session, adds that step's operators up and appends its events to the
trace, then starts the next.  One session per step lets the byte cap stop the capture
between steps: once the trace reaches ``max_bytes`` (uncompressed JSON), no further
step is profiled and the report says so.

The work between sessions (the operator table, the trace's gzip) runs on the training
thread, between two profiled steps, so no profiled step shares the interpreter with it;
it lengthens the captured steps and the one after them, which the report marks
(``began_at`` to ``ended_at``) and the summary leaves out of its window.  Any error ends
the capture with its reason in the report, never the training.
"""

from __future__ import annotations

import gc
import gzip
import os
import tempfile
import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from traceml.agent.probe import Probe
from traceml.wire.captures import (
    MAX_OPERATORS,
    CaptureAsk,
    CaptureReport,
    OperatorRow,
    is_communication,
)
from traceml.wire.events import MANUAL_EXIT, OPTIMIZER_END, OPTIMIZER_SKIPPED

CAPTURES_DIR = "captures"
GZIP_LEVEL = 1  # the trace is written on the training thread: fast beats small
MAX_OPEN_ASKS = 4  # asks waiting for their step; later ones are answered "busy"
MAX_SESSION_S = 60.0  # a profiled step longer than this is dropped, not read
MAX_MISSED = 3  # iterations without a batch while work is due: the capture gives up
TAKEN_KEPT = 4096  # the latest iteration ends kept to find the hook's first among


@dataclass
class _Capture:
    """One ask, from its arrival to its report."""

    ask: CaptureAsk
    calls: int = 0  # iterations ended since the hook was installed (training thread)
    first_t: float | None = None  # the hook's first call
    base: int | None = None  # iterations ended before that call (set by the sender thread)
    session: Any = None  # the running profiler session
    num_steps: int = 0
    began: float | None = None  # probe clock
    ended: float | None = None
    ops: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)  # (name,
    # shapes, part) -> calls, host self µs, device self µs
    trace: Any = None  # _TraceFile
    cut: str | None = None
    error: str | None = None
    has_device: bool = False  # CUDA activities were profiled
    due: bool = False  # an iteration ended: the next batch ends or starts a profiled step
    missed: int = 0  # iterations that ended while the work was due (no batch between)
    session_began: float = 0.0  # probe clock
    disk_bytes: int = 0  # the trace's size on disk, once written
    done: bool = False


class _TraceFile:
    """One rank's Chrome trace of one capture, gzip, the events of each step appended
    until the byte cap: the events as one JSON array, brackets and commas counted, hold
    at most ``max_bytes``."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.size = 2  # the events' array so far, "[" and "]" included
        self.header: dict[str, Any] | None = None
        self._part = path + ".part"  # renamed once whole: a reader never sees half a trace
        self._file: Any = gzip.open(self._part, "wb", compresslevel=GZIP_LEVEL)
        self._file.write(b'{"traceEvents":[')

    def add(self, trace: dict[str, Any]) -> bool:
        """Append one session's events; False when the cap stopped it (the rest dropped)."""
        if self.header is None:
            self.header = {k: v for k, v in trace.items() if k != "traceEvents"}
        for event in trace.get("traceEvents", ()):
            data = orjson.dumps(event) if self.size == 2 else b"," + orjson.dumps(event)
            if self.size + len(data) > self.max_bytes:
                return False
            self._file.write(data)
            self.size += len(data)
        return True

    def close(self, meta: dict[str, Any]) -> int:
        """End the JSON object (the first session's header, traceml's own keys); the
        file's size on disk."""
        tail = orjson.dumps({**(self.header or {}), "traceml": meta})
        self._file.write(b"]," + tail[1:])
        self._file.close()
        os.replace(self._part, self.path)
        return os.path.getsize(self.path)


class ProfilerCapture:
    """The asks of one rank and their captures."""

    def __init__(self, probe: Probe, rank: int, session_dir: str | None,
                 wall_offset: float, warn: Callable[[str, BaseException], None],
                 seen: tuple[int, int] = (0, 0)) -> None:
        """``seen``: the optimizer steps (skipped ones too) and the ``trace_step`` exits
        the sender thread has taken from the log so far."""
        self.probe = probe
        self.rank = rank
        self.session_dir = session_dir
        self.wall_offset = wall_offset
        self.warn = warn
        self.uses_cuda = False  # set by the runtime once a CUDA step was timed
        self._open: list[_Capture] = []  # asks not yet reported (the first one runs)
        self._reports: list[CaptureReport] = []
        self._lock = threading.Lock()  # the open list: sender thread and training thread
        self._chained: Callable[..., None] | None = None
        self._installed = False
        self._watched: list[Any] = []  # the batch watches whose after_batch is ours
        # The iteration ends the sender thread took from the log: how many, and the
        # latest ones' times (the first hook call's count is found among them)
        self._seen = {"optimizer": seen[0], "manual": seen[1]}
        self._taken: deque[float] = deque(maxlen=TAKEN_KEPT)
        self._mode = "optimizer"  # what ends an iteration: "optimizer" or "manual"
        # `abort`'s reason and what to run once the training thread closed the session
        self._aborted: tuple[str, Callable[[], None] | None] | None = None
        self._done_ids: deque[str] = deque(maxlen=64)  # asks answered: a repeat is ignored

    # -- sender thread ---------------------------------------------------------------

    def on_control(self, payload: Any) -> None:
        """A control message from node 0: an ask for this rank is queued; others ignored."""
        if not isinstance(payload, dict) or payload.get("op") != "capture":
            return
        ask = CaptureAsk.from_payload(payload)
        if self.rank not in ask.ranks:
            return
        with self._lock:
            if (ask.capture_id in self._done_ids
                    or any(c.ask.capture_id == ask.capture_id for c in self._open)):
                return  # the same ask again (node 0 repeats it a few times)
            if len(self._open) >= MAX_OPEN_ASKS:
                self._reports.append(CaptureReport(ask.capture_id, ask.steps, 0,
                                                   error="busy with earlier captures"))
                return
            self._open.append(_Capture(ask))
        self._install()

    def observe(self, times: list[list[float]]) -> None:
        """Every tick, after the log was taken: fix the count of the hook's first
        boundary once that boundary has been taken.  The iterations are counted as the
        collector numbers steps: ``trace_step`` exits in a loop that uses it (an
        optimizer step inside one ends no step), else the optimizer's steps."""
        self._seen["optimizer"] += len(times[OPTIMIZER_END]) + len(times[OPTIMIZER_SKIPPED])
        self._seen["manual"] += len(times[MANUAL_EXIT])
        mode = "manual" if self.probe.manual else "optimizer"
        codes = (MANUAL_EXIT,) if mode == "manual" else (OPTIMIZER_END, OPTIMIZER_SKIPPED)
        ends = sorted(t for code in codes for t in times[code])
        if mode != self._mode:  # trace_step appeared: its exits are counted from here
            self._mode = mode
            self._taken.clear()
        self._taken.extend(ends)
        opened = self._open
        running = opened[0] if opened else None
        if running is not None and running.base is None and running.first_t is not None:
            at = bisect_left(self._taken, running.first_t)
            if at < len(self._taken) and self._taken[at] == running.first_t:
                before = self._seen[mode] - len(self._taken)
                running.base = before + at
        if self._installed and not self._in_chain():
            # A hook installed beside it at the same moment (a FLOP count starting on
            # the training thread) dropped it: put it back.
            self._installed = False
            self._install()

    def _in_chain(self) -> bool:
        hook = self.probe.on_optimizer_end
        for _ in range(8):
            if hook is None:
                return False
            if hook == self._boundary:
                return True
            hook = getattr(getattr(hook, "__self__", None), "_chained", None)
        return False

    def take_reports(self) -> list[CaptureReport]:
        """Finished captures, to send (the hook is removed once none is open)."""
        with self._lock:
            finished = [c for c in self._open if c.done]
            self._open = [c for c in self._open if not c.done]
            self._done_ids.extend(c.ask.capture_id for c in finished)
            reports, self._reports = self._reports + [self._report(c) for c in finished], []
            idle = not self._open
        if idle and self._installed:
            self._uninstall()
        return reports

    def _install(self) -> None:
        if self._installed:
            return
        self._chained = self.probe.on_optimizer_end
        self.probe.on_optimizer_end = self._boundary
        self._installed = True

    def _uninstall(self) -> None:
        for watch in self._watched:
            watch.after_batch = None
        self._watched = []
        # Another hook chained onto this one since (a FLOP count running) keeps it: it
        # restores this one when it ends, so it passes through until the next ask.
        if self.probe.on_optimizer_end == self._boundary:
            self.probe.on_optimizer_end = self._chained
            self._installed = False

    def _report(self, c: _Capture) -> CaptureReport:
        n = max(1, c.num_steps)
        rows = sorted(c.ops.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:MAX_OPERATORS]
        operators = tuple(
            OperatorRow(name, shapes, calls / n, self_us / n / 1e3,
                        device_us / n / 1e3 if c.has_device else None, part)
            for (name, shapes, part), (calls, self_us, device_us) in rows)
        path = c.trace.path if c.trace is not None else None
        wall = self.wall_offset
        return CaptureReport(
            c.ask.capture_id, c.ask.steps, c.num_steps,
            None if c.began is None else c.began + wall,
            None if c.ended is None else c.ended + wall,
            path, c.disk_bytes, c.cut, c.error, operators)

    # -- training thread ---------------------------------------------------------------

    def abort(self, reason: str, then: Callable[[], None] | None = None) -> bool:
        """End every capture (any thread): the training thread ends those not done at
        its next iteration end or batch (closing a profiler session still open: only
        it can), and ``then`` runs after it; True when one is not done (``then``
        waits), False when ``then`` ran now."""
        self._aborted = (reason, then)
        if any(not c.done for c in self._open):
            return True  # the training thread ends them: it may be between two sessions
        self._aborted = (reason, None)
        if then is not None:
            then()
        return False

    def _abandon(self) -> None:
        """Training thread: close what is open after `abort`."""
        reason, then = self._aborted or ("", None)
        self._aborted = (reason, None)
        for c in self._open:
            if not c.done:
                self._close_session(c)
                self._finish(c, error=reason)
        if then is not None:
            then()

    def _boundary(self, t: float) -> None:
        """An iteration ended (training thread): the chained hook (its errors are the
        step instrumentation's), then the capture (its errors end the capture alone)."""
        c = None
        try:
            c = self._counted(t)
        except Exception as exc:
            self._failed(exc)
        chained = self._chained
        if chained is not None:
            chained(t)
        if c is not None:
            try:
                self._ended(c)
            except Exception as exc:
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.warn("capture", exc)
        self._aborted = (f"the capture failed: {exc!r}", None)
        self._abandon()

    def _counted(self, t: float) -> _Capture | None:
        """The capture this iteration end counts for (None: none, or not an end the
        collector numbers a step by); its first end's time noted."""
        if self._aborted is not None:
            self._abandon()
            return None
        opened = self._open
        c = opened[0] if opened else None
        if c is None or c.done or (self.probe.manual and not self.probe.at_manual_exit):
            return None
        if c.first_t is None:
            c.first_t = t  # before the chained hook runs: the sender may take t meanwhile
        return c

    def _ended(self, c: _Capture) -> None:
        c.calls += 1
        if c.base is None:
            return
        count = c.base + c.calls
        ask = c.ask
        if count < ask.start_after:
            return
        if c.session is None and c.num_steps == 0 and count > ask.start_after and not c.due:
            self._finish(c, error=f"the asked step ({ask.start_after}) had passed when the "
                                  "ask arrived")
            return
        if c.due:  # no batch came since the last iteration ended
            c.missed += 1
            if c.missed >= MAX_MISSED:
                self._close_session(c)
                self._finish(c, error="no batch between iterations (no DataLoader fetch or "
                                      "training forward seen): the profiler starts and stops "
                                      "only there")
            return
        # Not here: this runs inside the optimizer step's own profiler range, and a
        # session stopped or started inside an open range corrupts kineto's state (a
        # segfault in a later stop).  At the next batch, outside every range.
        c.due = True
        c.missed = 0
        self._defer()

    def _defer(self) -> None:
        """Have the next batch (a DataLoader fetch's end, or the training forward's
        start) run the due work."""
        for watch in (self.probe.fetch_watch, self.probe.forward_watch):
            if watch is None:
                continue
            if watch not in self._watched:
                self._watched.append(watch)
                watch.after_batch = self._batch_due
            watch.force()

    def _batch_due(self) -> None:
        """A batch (training thread, outside every profiler range); a failure ends the
        capture, never the batch watch that called."""
        try:
            if self._aborted is not None:
                self._abandon()
                return
            opened = self._open
            c = opened[0] if opened else None
            if c is not None and c.due and not c.done:
                self._act(c)
        except Exception as exc:
            self._failed(exc)

    def _act(self, c: _Capture) -> None:
        """The due work (training thread, outside every profiler range): end the
        profiled step, start the next one or finish."""
        c.due = False
        try:
            if c.session is not None:
                self._end_step(c)
            if c.num_steps >= c.ask.steps or c.cut is not None:
                self._finish(c)
                return
            self._start_step(c)
        except Exception as exc:
            self._close_session(c)
            self._finish(c, error=f"the profiler failed: {exc!r}")
            self.warn("capture", exc)

    def _start_step(self, c: _Capture) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.uses_cuda:
            activities.append(ProfilerActivity.CUDA)
        if c.began is None:
            c.began = self.probe.clock()
            c.has_device = self.uses_cuda
            c.trace = _TraceFile(self._trace_path(c.ask.capture_id), c.ask.max_bytes)
        session = profile(activities=activities, record_shapes=True, with_stack=False)
        session.start()
        c.session = session
        c.session_began = self.probe.clock()

    def _end_step(self, c: _Capture) -> None:
        session, c.session = c.session, None
        session.stop()
        lasted = self.probe.clock() - c.session_began
        if lasted > MAX_SESSION_S:  # an evaluation between steps, or a stall: its events
            # would take minutes and gigabytes to read (the training thread's time)
            _release(session)
            c.cut = (f"a profiled step lasted {lasted:.0f} s (over {MAX_SESSION_S:.0f} s): "
                     "its events were dropped unread, and the capture ended")
            return
        c.num_steps += 1
        for e in session.events():
            if _on_device(e):
                continue  # a kernel: its time is its operator's device self time
            key = (e.name, _shapes(e.input_shapes), _part(e))
            row = c.ops.setdefault(key, [0.0, 0.0, 0.0])
            row[0] += 1
            # A collective runs on its backend's threads (gloo:all_reduce has no self
            # time): its whole duration is what it cost, in flight; one inside another
            # (record_param_comms in c10d::allreduce_) is counted in its parent's.
            if not is_communication(e.name):
                row[1] += e.self_cpu_time_total
            elif not _in_collective(e):
                row[1] += e.cpu_time_total
            row[2] += _device_self(e)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            name = tmp.name
        try:
            session.export_chrome_trace(name)
            with open(name, "rb") as f:
                trace = orjson.loads(f.read())
        finally:
            os.unlink(name)
        _release(session)
        if not c.trace.add(trace):
            c.cut = (f"the trace reached its cap of {_mib(c.ask.max_bytes)} after "
                     f"{c.num_steps} of {c.ask.steps} steps: the rest of step "
                     f"{c.num_steps} and later steps are not in it")
        elif c.trace.size >= c.ask.max_bytes and c.num_steps < c.ask.steps:
            c.cut = (f"the trace reached its cap of {_mib(c.ask.max_bytes)} after "
                     f"{c.num_steps} of {c.ask.steps} steps")

    def _close_session(self, c: _Capture) -> None:
        session, c.session = c.session, None
        if session is not None:
            try:
                session.stop()
            except Exception:
                pass

    def _finish(self, c: _Capture, error: str | None = None) -> None:
        if c.done:
            return
        c.error = error
        if c.trace is not None:
            try:
                c.disk_bytes = c.trace.close({
                    "capture_id": c.ask.capture_id, "rank": self.rank,
                    "steps": c.num_steps, "steps_asked": c.ask.steps, "cut": c.cut})
            except OSError as exc:
                c.error = c.error or f"the trace could not be written: {exc!r}"
        c.ended = self.probe.clock()
        c.done = True

    def stop(self) -> None:
        """At exit (training thread or atexit): a capture still running ends with
        what it has."""
        opened = self._open
        c = opened[0] if opened else None
        if c is None or c.done:
            return
        if c.session is not None:
            try:
                self._end_step(c)
            except Exception as exc:
                self._close_session(c)
                c.error = f"the profiler failed: {exc!r}"
        if 0 < c.num_steps < c.ask.steps and c.error is None:
            c.cut = c.cut or f"the run ended after {c.num_steps} of {c.ask.steps} steps"
        self._finish(c, c.error if c.num_steps or c.error else
                     "the run ended before the asked step")

    def _trace_path(self, capture_id: str) -> str:
        folder = os.path.join(self.session_dir or tempfile.gettempdir(), CAPTURES_DIR)
        os.makedirs(folder, exist_ok=True)
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in capture_id)
        return os.path.join(folder, f"{safe}-r{self.rank}.pt.trace.json.gz")


def _release(session: Any) -> None:
    """Free a stopped session's results now: its events reference each other, so without
    this only the cyclic GC frees them, maybe at the interpreter's exit, after torch's
    own state is gone (a segfault in the final collection)."""
    profiler = getattr(session, "profiler", None)
    session.profiler = None
    if profiler is not None:
        for name in ("kineto_results", "_function_events", "_old_function_events"):
            if hasattr(profiler, name):
                setattr(profiler, name, None)
    gc.collect()


def _shapes(shapes: Any) -> str:
    """torch's input shapes as text: tensors' shapes, scalars' [] dropped at the end."""
    if not shapes:
        return ""
    items = [s for s in shapes if s != []]
    return ", ".join(str(list(s)) for s in items)


PART_RANGES = (("enumerate(DataLoader)", "input"), ("Optimizer.", "optimizer"))
"""torch's own profiler ranges around a DataLoader fetch and an optimizer's step and
zero_grad: an operator inside one is that part's; every other one is the step's compute."""


def _part(event: Any) -> str:
    """The part of the step an operator ran in: its ranges' (innermost first)."""
    e = event
    while e is not None:
        name = e.name
        for prefix, part in PART_RANGES:
            if name.startswith(prefix):
                return part
        e = e.cpu_parent
    return "compute"


def _in_collective(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if is_communication(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def _on_device(event: Any) -> bool:
    kind = getattr(event, "device_type", None)
    return kind is not None and "CPU" not in str(kind)


def _device_self(event: Any) -> float:
    value = getattr(event, "self_device_time_total", None)
    if value is None:
        value = getattr(event, "self_cuda_time_total", 0.0)
    return float(value or 0.0)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"
