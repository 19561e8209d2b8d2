"""The agent of one training rank: tracker + patches + sender (agent side).

Created once torch has been imported in an armed rank.  The training thread
only appends phase events to the probe's log; the sender thread replays them
through the step tracker and sends the finished steps in batches.  Any error
of the agent disables the failing part, warns once on stderr and leaves
training unchanged.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from collections import deque
from typing import Any

from traceml import protocol
from traceml.agent.cuda_timing import CudaPhaseTimer, allocator_bytes
from traceml.agent.probe import Probe
from traceml.agent.process_sampler import ProcessSampler, RssReader
from traceml.agent.steps import CLOSE, MANUAL_ENTER, MANUAL_EXIT, MARK, StepTiming, StepTracker
from traceml.environment import AgentEnv
from traceml.protocol import Sender
from traceml.security import session_keys
from traceml.sender import BatchSender

_ACTIVE: AgentRuntime | None = None
MAX_QUEUED_STEPS = 100_000
RSS_TICK_S = 0.1  # the sender thread stamps finished steps with RSS this often


def active() -> AgentRuntime | None:
    """The runtime of this process, if the agent is armed here."""
    return _ACTIVE


def identity_from(env: AgentEnv, environ: dict[str, str] | os._Environ[str]) -> Sender:
    """Who this rank is, from the variables torch's elastic agent sets."""

    def get_int(name: str) -> int | None:
        value = environ.get(name)
        return int(value) if value not in (None, "") else None

    group_rank = get_int("GROUP_RANK")
    return Sender(
        role="rank",
        host=socket.gethostname(),
        pid=os.getpid(),
        node_rank=group_rank if group_rank is not None else env.node_rank,
        rank=get_int("RANK"),
        local_rank=get_int("LOCAL_RANK"),
        world_size=get_int("WORLD_SIZE"),
        restart=get_int("TORCHELASTIC_RESTART_COUNT") or 0,
    )


class AgentRuntime:
    """Everything the agent runs in one rank."""

    def __init__(self, env: AgentEnv, identity: Sender) -> None:
        self.env = env
        self.identity = identity
        # Finished steps, from the tracker (sender thread) to the outbox.
        self.steps: deque[StepTiming] = deque(maxlen=MAX_QUEUED_STEPS)
        self._final = False  # at exit, steps whose GPU events are not done go without
        self._outbox: list[tuple[Any, ...]] = []  # stamped steps waiting for the next send
        self._next_send = 0.0
        self._send_now = False  # traceml.summary() wants the steps in the store now
        self.num_steps = 0
        self._cuda: Any = None
        self.tracker = StepTracker(self.steps.append)
        self.probe = Probe(time.perf_counter, self._fail)
        self.instrumentation: Any = None
        self._wall_offset = time.time() - time.perf_counter()
        self._rss = RssReader()
        self._warned = False
        self._replay_failed = False  # after a tracker error, the log is no longer replayed
        self.process_sampler = ProcessSampler(env.sample_interval_s)
        self.sender = BatchSender(
            env.endpoint, env.session_id, identity,
            min(RSS_TICK_S, env.flush_interval_s, env.sample_interval_s),
            producers=[self._drain_steps, self.process_sampler.produce],
            final_producers=[self._bye],
            keys=session_keys(env.secure, env.secret, env.session_id),
        )

    def _mark_device_step(self) -> None:
        """Training thread, when an iteration's optimizer steps end (CUDA only):
        log the device memory peaks since the last mark and the phases' CUDA
        events, for the step being timed."""
        cuda = self._cuda
        if not cuda.is_initialized():
            return
        device = cuda.current_device()
        peaks = allocator_bytes(cuda, device, "peak")
        cuda.reset_peak_memory_stats(device)
        timer = self.probe.cuda_timer
        if timer is None:  # CUDA came up during this step: time phases from the next
            self.probe.cuda_timer = CudaPhaseTimer(cuda, sys.modules["torch"]._C)
            self.probe.log((MARK, (peaks, None)))
        else:
            self.probe.log((MARK, (peaks, timer.take_step())))

    def watch_cuda(self) -> bool:
        """Take CUDA memory peaks and phase GPU times when this rank has CUDA."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return False
        self._cuda = torch.cuda
        self.probe.on_optimizer_end = self._mark_device_step
        return True

    def start(self) -> None:
        global _ACTIVE
        self.watch_cuda()
        if self.env.mode == "run":
            from traceml.agent.patches import Instrumentation

            self.instrumentation = Instrumentation(self.probe)
            self.instrumentation.install()
        self.sender.start()
        _ACTIVE = self
        atexit.register(self.shutdown)
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def shutdown(self) -> None:
        """At exit: close the last step, flush, close the socket (bounded)."""
        global _ACTIVE
        if _ACTIVE is not self:
            return
        self.probe.log((CLOSE, 0.0))  # the sender's last flush closes the last step
        self._uninstall()
        self.sender.stop()
        _ACTIVE = None

    def _after_fork_in_child(self) -> None:
        # A forked child (DataLoader worker, ...) is not a rank: go inert.
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
            self.probe.off = True
            self._uninstall()

    def _uninstall(self) -> None:
        if self.instrumentation is not None:
            try:
                self.instrumentation.uninstall()
            except Exception as exc:
                self._warn(f"could not remove instrumentation: {exc!r}")

    def _fail(self, exc: BaseException) -> None:
        """An agent error on the training thread (a CUDA timer call): every
        wrapper passes straight through from now on.  The patches stay until
        exit: the error may be raised inside torch's loop over the optimizer
        hooks, which removing a hook there would break."""
        self.probe.off = True
        self._warn(f"step instrumentation disabled after an internal error: {exc!r}")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"traceml: warning: {message}", file=sys.stderr)

    def _drain_steps(self) -> list[tuple[str, dict[str, Any]]]:
        """Sender thread, every RSS tick: replay the training thread's events,
        stamp the finished steps with host RSS (read here, off the training
        path, at the tick's resolution) and send them as one batch once per
        flush interval."""
        if not self._replay_failed:
            events = self.probe.events
            if len(events) == events.maxlen:
                # The log overflowed since the last replay (the sender thread
                # was starved): what is left starts mid-step.
                self.tracker.resync()
            try:
                self.tracker.replay(events)
            except Exception as exc:
                # Sender thread: turn the wrappers into pass-throughs but leave
                # torch's hook dicts alone (the training thread may be iterating
                # them); shutdown removes the patches.
                self._replay_failed = True
                self.probe.off = True
                self._warn(f"step instrumentation disabled after an internal error: {exc!r}")
        self._stamp_steps()
        now = time.monotonic()
        if not self._outbox or (now < self._next_send and not self._final
                                and not self._send_now):
            return []
        self._send_now = False
        self._next_send = now + self.env.flush_interval_s
        rows, self._outbox = self._outbox, []
        self.num_steps += len(rows)
        return [(protocol.KIND_STEPS, protocol.rows_payload(protocol.STEP_FIELDS, rows))]

    def _stamp_steps(self) -> None:
        rows = self._outbox
        rss = self._rss.read()
        timer = self.probe.cuda_timer
        while self.steps:
            timing = self.steps[0]
            peaks, spans = merge_device_marks(timing.marks) if timing.marks else (None, None)
            gpu = None
            if spans is not None and timer is not None:
                gpu = timer.resolve(spans)
                if gpu is None and not self._final:
                    break  # the GPU is behind: this step (and the rest) wait a flush
            self.steps.popleft()
            rows.append(self._row(timing, rss, peaks, gpu))

    def _row(self, t: StepTiming, rss: int | None, peaks: tuple[int, int] | None,
             gpu: tuple[float, float, float] | None) -> tuple[Any, ...]:
        inp, fwd, bwd, opt = t.phase_s
        alloc, reserved = peaks if peaks is not None else (None, None)
        gpu_fwd, gpu_bwd, gpu_opt = gpu if gpu is not None else (None, None, None)
        return (
            t.step, self._wall_offset + t.t_begin,
            inp * 1e3, fwd * 1e3, bwd * 1e3, opt * 1e3, t.total_s * 1e3, t.wait_s * 1e3,
            t.counts[0], t.counts[1], t.counts[2], t.counts[3], t.num_skipped, rss,
            alloc, reserved, gpu_fwd, gpu_bwd, gpu_opt,
        )

    def _bye(self) -> list[tuple[str, dict[str, Any]]]:
        self._final = True
        return self._drain_steps() + [(protocol.KIND_BYE, {"num_steps": self.num_steps, "t": time.time()})]

    def flush_and_count(self, timeout_s: float = 2.0) -> int:
        """Send the finished steps now (user thread, for ``traceml.summary()``);
        returns how many steps this rank has finished."""
        self._send_now = True
        before = self.sender.flush_soon()
        deadline = time.monotonic() + timeout_s
        while self.sender.num_flushes <= before and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.tracker.next_step

    def step_enter(self) -> None:
        """``trace_step`` entered (main thread)."""
        if not self.probe.skip():
            self.probe.log((MANUAL_ENTER, self.probe.clock()))

    def step_exit(self) -> None:
        probe = self.probe
        if not probe.skip():
            now = probe.clock()
            if probe.on_optimizer_end is not None:  # the device mark belongs to this step
                probe.guarded(probe.on_optimizer_end)
            probe.log((MANUAL_EXIT, now))


def merge_device_marks(marks: tuple[Any, ...]) -> tuple[tuple[int, int] | None, list[Any] | None]:
    """A step's CUDA memory peaks (the highest of its marks) and CUDA event spans."""
    if not marks:
        return None, None
    allocated = max(peaks[0] for peaks, _ in marks)
    reserved = max(peaks[1] for peaks, _ in marks)
    spans = [span for _, step_spans in marks if step_spans for span in step_spans]
    return (allocated, reserved), (spans if any(s is not None for _, s in marks) else None)
