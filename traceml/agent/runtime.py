"""The agent of one training rank: patches + event log + sender (agent side).

Created once torch has been imported in an armed rank.  The training thread
only appends phase events to the probe's log; the sender thread drains the log
every tick, stamps it with the rank's RSS, resolves CUDA marks to numbers, and
ships the events in batches to the collector, whose step tracker turns them
into steps (`traceml.collector.steps`).  Any error of the agent disables the
failing part, warns once per cause on stderr and leaves training unchanged.
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import socket
import time
from typing import Any

from traceml import clocks
from traceml.agent import watchdog
from traceml.agent.device_steps import DeviceSteps
from traceml.agent.outbox import EventOutbox
from traceml.agent.probe import Probe
from traceml.agent.process_sampler import ProcessSampler, RssReader
from traceml.agent.watchdog import FaultFiles, Heartbeat, StallWatch
from traceml.environment import AgentEnv, TorchRank, clock_skew_for_tests_s
from traceml.errors import WarnOnce
from traceml.security import client_keys_from, session_keys
from traceml.sender import BatchSender
from traceml.stacks import StackFiles
from traceml.wire.envelope import Message
from traceml.wire.events import (
    BATCH_FROM_FETCH,
    BATCH_FROM_FORWARD,
    CLOSE,
    MANUAL_ENTER,
    MANUAL_EXIT,
    MAX_EVENTS_PER_MESSAGE,
    OPTIMIZER_END,
    OPTIMIZER_SKIPPED,
    EventBatch,
)
from traceml.wire.identity import Sender
from traceml.wire.incidents import IncidentReport
from traceml.wire.records import Bye

_ACTIVE: AgentRuntime | None = None
RSS_TICK_S = 0.1  # the sender thread drains the log, stamped with RSS, this often
FLOPS_AFTER_STEPS = 5  # optimizer steps (warm-up) before the first FLOP count


def active() -> AgentRuntime | None:
    """The runtime of this process, if the agent is armed here."""
    return _ACTIVE


def identity_from(env: AgentEnv, rank: TorchRank) -> Sender:
    """Who this rank is: torch's rank variables, the launcher's node rank when
    torch does not name the node."""
    return Sender(
        role="rank",
        host=socket.gethostname(),
        pid=os.getpid(),
        node_rank=rank.group_rank if rank.group_rank is not None else env.node_rank,
        rank=rank.rank,
        local_rank=rank.local_rank,
        world_size=rank.world_size,
        restart=rank.restart_count,
    )


def ask_token(path: str, timeout_s: float = 2.0) -> str | None:
    """This process's rank token from the launcher's key service (None: refused)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(path)
        conn.sendall(b"token\n")
        answer = conn.recv(256).strip().decode("ascii", "replace")
    return None if answer in ("", "refused") else answer


class AgentRuntime:
    """Everything the agent runs in one rank."""

    def __init__(self, env: AgentEnv, identity: Sender, thread_id: int | None = None) -> None:
        """``thread_id``: the training thread, when it is not the main thread (Ray
        Train's workers run the training function in a thread of their own)."""
        self.env = env
        self.identity = identity
        self._final = False  # at exit: the last flush
        self.outbox = EventOutbox()  # events taken from the log, waiting for the next send
        self._num_steps_seen = 0  # optimizer steps (or manual steps) taken from the log
        self._num_manual_exits = 0  # ...trace_step exits among them
        self.flops: Any = None  # FlopCounting, in run mode
        self._next_send = 0.0
        self._send_now = False  # traceml.summary() wants the steps in the store now
        self.probe = Probe(time.perf_counter, self._fail)
        if thread_id is not None:
            self.probe.thread_id = thread_id
        self.flops_after_steps = FLOPS_AFTER_STEPS
        self.instrumentation: Any = None
        # Step times in unix seconds (shifted by the test-only skew: traceml.clocks).
        self._wall_offset = clocks.wall_offset_s(clock_skew_for_tests_s())
        self._rss = RssReader()
        self._warnings = WarnOnce()  # one warning per failing part
        self.device = DeviceSteps(self.probe, self._warnings)  # CUDA: GPU times, peaks
        self.process_sampler = ProcessSampler(env.sample_interval_s)
        self.stall = StallWatch(env.stall_timeout_s, self.probe.thread_id, self._wall_offset)
        self._incidents: list[IncidentReport] = []  # sent with the last flush
        self._heartbeat: Heartbeat | None = None
        self._faults: FaultFiles | None = None
        self.sender = BatchSender(
            env.endpoint, env.session_id, identity,
            min(RSS_TICK_S, env.flush_interval_s, env.sample_interval_s),
            producers=[self._drain_events, self.process_sampler.produce],
            final_producers=[self._bye],
            keys=(client_keys_from(env.client_keys) if env.client_keys
                  else session_keys(None, env.session_id)),
            on_exit=self._sender_exited,
            token_of=lambda who: self.token if who == identity else None,
            prepare=self._take_token,
            control=(None if env.control_endpoint is None or env.mode != "run"
                     or identity.rank is None
                     else (env.control_endpoint, self._on_control)),
        )
        self.capture: Any = None  # ProfilerCapture, once node 0 asks for one
        self.token = env.rank_token  # proves this rank's identity to the collector

    def _on_control(self, payload: Any) -> None:
        """Sender thread: a message of node 0's control channel (a capture ask)."""
        if self.capture is None:
            if self.probe.off or self.identity.rank is None:
                return
            from traceml.agent.capture import ProfilerCapture

            self.capture = ProfilerCapture(
                self.probe, self.identity.rank, self.env.session_dir, self._wall_offset,
                self._part_failed,
                seen=(self._num_steps_seen - self._num_manual_exits, self._num_manual_exits))
        cuda = self.device.cuda  # this process uses CUDA (a GPU host's CPU job does not)
        self.capture.uses_cuda = cuda is not None and bool(cuda.is_initialized())
        self.capture.on_control(payload)

    def _take_token(self) -> None:
        """Sender thread, before its first message: this rank's token, from the
        launcher's key service (`traceml.launcher.rank_keys`)."""
        if self.token is not None or self.env.key_socket is None:
            return
        try:
            self.token = ask_token(self.env.key_socket)
        except OSError as exc:
            self.token = None
            reason = repr(exc)
        else:
            reason = "the launcher's key service refused this process"
        if self.token is None:
            self._warnings.to_stderr("token", f"traceml: no token for rank {self.identity.rank} "
                                     f"({reason}): the collector refuses its telemetry")

    def start(self) -> None:
        global _ACTIVE
        self.device.watch()
        if self.env.mode == "run":
            from traceml.agent.patches import Instrumentation

            self.instrumentation = Instrumentation(self.probe)
            self.watch_batches()
            self.instrumentation.install()
            self._watch_health()
        self.sender.start()
        _ACTIVE = self
        atexit.register(self.shutdown)
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def watch_batches(self) -> None:
        """Samples, tokens and FLOPs per step (`traceml.agent.batch`, `flops`)."""
        from traceml.agent.batch import BatchWatch
        from traceml.agent.flops import FlopCounting

        probe = self.probe
        self.flops = FlopCounting(probe, self.env.count_flops, self._part_failed)
        self.flops.force_batches = self._force_batches
        probe.fetch_watch = BatchWatch(probe, BATCH_FROM_FETCH, self.flops.on_shape,
                                       self._watch_failed)
        probe.forward_watch = BatchWatch(probe, BATCH_FROM_FORWARD,
                                         self.flops.on_shape, self._watch_failed)

    def _force_batches(self) -> None:
        for watch in (self.probe.fetch_watch, self.probe.forward_watch):
            if watch is not None:
                watch.force()

    def _watch_failed(self, watch: Any, exc: BaseException) -> None:
        """A batch could not be read: samples go unmeasured, the rest stays."""
        probe = self.probe
        probe.fetch_watch = None if probe.fetch_watch is watch else probe.fetch_watch
        probe.forward_watch = None if probe.forward_watch is watch else probe.forward_watch
        probe.batches.append((probe.clock(), None, None, None, watch.source))
        self._part_failed("batch", exc)

    def _part_failed(self, part: str, exc: BaseException) -> None:
        self._warnings.to_stderr(part, f"traceml: {part} measurement disabled after an "
                                 f"internal error: {exc!r}")

    def _arm_flops(self, times: list[list[float]]) -> None:
        """Sender thread: count the iterations taken; once warm-up's optimizer steps are
        done, the next batch is counted."""
        self._num_steps_seen += sum(len(times[c]) for c in (
            OPTIMIZER_END, OPTIMIZER_SKIPPED, MANUAL_EXIT))
        self._num_manual_exits += len(times[MANUAL_EXIT])
        if self.flops is None:
            return
        if self._num_steps_seen >= self.flops_after_steps:
            self.flops.arm()
            if self.flops.waiting():
                self._force_batches()

    def shutdown(self) -> None:
        """At exit: close the last step, flush, close the socket (bounded)."""
        global _ACTIVE
        if _ACTIVE is not self:
            return
        if self.device.cuda is not None and not self.probe.off:
            self.probe.guarded(self.device.flush_peaks)
        if self.flops is not None:
            try:
                self.flops.stop(reason="the run ended during the counted step")
            except Exception as exc:
                self._part_failed("flops", exc)
        if self.capture is not None:
            try:
                self.capture.stop()
            except Exception as exc:
                self._part_failed("capture", exc)
        self.probe.log(CLOSE)  # the sender's last flush closes the last step
        self.process_sampler.sample_at_next_call()  # and takes the exit sample
        self._uninstall()
        self.sender.stop()
        _ACTIVE = None

    def _watch_health(self) -> None:
        """Stall and crash reports (`traceml.agent.watchdog`); without a session
        folder (a rank's ``traceml.init()``) no launcher takes stacks."""
        watchdog.install_excepthook(self._on_exception)
        if self.env.session_dir is None or self.identity.rank is None:
            return
        files = StackFiles.of(self.env.session_dir, self.identity.rank, self.identity.pid)
        try:
            self._faults = FaultFiles(files, on_signal=self.stall.enabled)
            if self.stall.enabled:
                self._heartbeat = Heartbeat(files, self.identity.rank, self.identity.pid,
                                            self.probe.thread_id)
        except (OSError, ValueError, RuntimeError) as exc:
            self._warnings.to_stderr("stacks", f"stacks of stalls and crashes not taken: {exc!r}")

    def _on_exception(self, kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        """An exception ends the training thread: reported with the last flush."""
        if _ACTIVE is self:
            self._incidents.append(watchdog.exception_report(
                kind, exc, tb, time.time(), self.device.cuda))

    def report_exception(self, exc: BaseException) -> None:
        """An exception that ends the training where no excepthook sees it (a
        framework catches it on its training thread): reported as a crash."""
        self._on_exception(type(exc), exc, exc.__traceback__)

    def _after_fork_in_child(self) -> None:
        # A forked child (DataLoader worker, ...) is not a rank: go inert.
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
            self.probe.off = True
            self._uninstall()
            if self._faults is not None:
                self._faults.remove()

    def _uninstall(self) -> None:
        if self.instrumentation is not None:
            try:
                self.instrumentation.uninstall()
            except Exception as exc:
                self._warnings.to_stderr("uninstall", f"could not remove instrumentation: {exc!r}")

    def _sender_exited(self) -> None:
        """Nothing drains the log any more: stop logging, so it cannot grow (once a
        profiler session still open is closed: only the training thread can, at its
        next iteration or batch)."""
        if self._heartbeat is not None:
            self._heartbeat.remove()
        if self.capture is not None and self.capture.abort(
                "traceml's sender stopped", then=self._stop_logging):
            return
        self._stop_logging()

    def _stop_logging(self) -> None:
        self.probe.off = True

    def _fail(self, exc: BaseException) -> None:
        """An agent error on the training thread (a CUDA timer call): every
        wrapper passes straight through from now on.  The patches stay until
        exit: the error may be raised inside torch's loop over the optimizer
        hooks, which removing a hook there would break."""
        self.probe.off = True
        if self.capture is not None:  # this thread runs its profiler: close it now
            try:
                self.capture.stop()
            except Exception as capture_exc:
                self._part_failed("capture", capture_exc)
        self._warnings.to_stderr(
            "instrumentation", f"step instrumentation disabled after an internal error: {exc!r}")

    def _drain_events(self) -> list[Message]:
        """Sender thread, every tick: take what the training thread logged,
        with a host RSS reading (off the training path), and send it as one
        batch once per flush interval."""
        probe, outbox = self.probe, self.outbox
        horizon = math.inf if self._final else probe.clock()
        resolve = None
        if probe.on_optimizer_end is not None:  # device marks: sent once the GPU is done
            # A GPU that stays behind (hung, or far behind) must not hold the
            # log without bound: past one message's worth, marks go without
            # GPU times.
            give_up = probe.num_held() > MAX_EVENTS_PER_MESSAGE
            resolve = functools.partial(self.device.resolve, give_up=give_up)
        times, marks = probe.take(horizon, resolve)
        spans = probe.take_spans()
        incidents = self._watch_progress(times)
        batches, flop_counts = probe.take_records()
        outbox.add_records(spans, batches, flop_counts)
        self._arm_flops(times)
        reports: list[Message] = []
        if self.capture is not None:
            try:
                self.capture.observe(times)
                reports += self.capture.take_reports()
            except Exception as exc:  # captures go; the steps keep flowing
                self._part_failed("capture", exc)
                self.capture.abort(f"the capture failed: {exc!r}")
                self.capture = None
        if any(times) or marks or batches or flop_counts:
            # Read after these events, so it goes with the steps they finish:
            # stamped as the first of them.
            # (A tick may take batch records alone: a batch forced to the slow path.)
            first = min([ts[0] for ts in times if ts] + [m[0] for m in marks[:1]]
                        + [r[0] for r in batches[:1]] + [r[0] for r in flop_counts[:1]])
            outbox.add(times, marks, (first, self._rss.read()))
        now = time.monotonic()
        if not outbox.has_events() or (now < self._next_send and not self._final
                                       and not self._send_now and not incidents
                                       and not reports
                                       and outbox.num_queued < MAX_EVENTS_PER_MESSAGE):
            return [*incidents, *reports]
        self._send_now = False
        self._next_send = now + self.env.flush_interval_s
        # A capture's report goes after the events of its steps: the collector finds them
        return [outbox.take(self._wall_offset), *incidents, *reports]

    def _watch_progress(self, times: list[list[float]]) -> list[IncidentReport]:
        """Sender thread: stall reports, and the heartbeat the launcher watches."""
        stall = self.stall
        now = self.probe.clock()
        reports = stall.observe(times, now, self._final)
        if self._heartbeat is not None:
            try:
                self._heartbeat.beat(now, None if stall.last is None else stall.threshold_s())
            except OSError as exc:
                self._heartbeat = None
                self._warnings.to_stderr("heartbeat", f"heartbeat file not written: {exc!r}")
        return reports

    def _bye(self) -> list[Message]:
        self._final = self.device.final = True
        return [*self._drain_events(), *self._incidents,
                Bye(time.time(), self.outbox.num_batches)]

    def flush_events(self, timeout_s: float = 2.0) -> int | None:
        """Send the logged events now (user thread, for ``traceml.summary()``);
        returns the sequence number of this rank's last events message, which
        the store's sender row reaches once the collector has its steps."""
        self._send_now = True
        before = self.sender.flush_soon()
        deadline = time.monotonic() + timeout_s
        while self.sender.num_flushes <= before and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.sender.last_seq.get(EventBatch.KIND)

    def step_enter(self) -> None:
        """``trace_step`` entered (main thread)."""
        if not self.probe.skip():
            self.probe.manual = True
            self.probe.log(MANUAL_ENTER)

    def step_exit(self) -> None:
        probe = self.probe
        if not probe.skip():
            now = probe.clock()
            if probe.on_optimizer_end is not None:  # the device mark belongs to this step
                probe.at_manual_exit = True
                probe.guarded(probe.on_optimizer_end, now)
                probe.at_manual_exit = False
            probe.log(MANUAL_EXIT, now)
