"""The agent of one training rank: tracker + patches + sender (agent side).

Created once torch has been imported in an armed rank.  The training thread
only appends finished steps to a deque; the sender thread drains it in
batches.  Any error of the agent disables the failing part, warns once on
stderr and leaves training unchanged.
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
from traceml.agent.probe import Probe
from traceml.agent.sender import BatchSender
from traceml.agent.steps import StepTiming, StepTracker
from traceml.environment import AgentEnv
from traceml.protocol import Sender

_ACTIVE: AgentRuntime | None = None
MAX_QUEUED_STEPS = 100_000


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


class RssReader:
    """Host RSS of this process from /proc/self/statm: a few µs, no psutil."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> int | None:
        if self._fd is None:
            return None
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) * self._page
        except (OSError, IndexError, ValueError):
            return None


class AgentRuntime:
    """Everything the agent runs in one rank."""

    def __init__(self, env: AgentEnv, identity: Sender) -> None:
        self.env = env
        self.identity = identity
        self.steps: deque[tuple[Any, ...]] = deque(maxlen=MAX_QUEUED_STEPS)
        self.num_steps = 0
        self.tracker = StepTracker(self._on_step)
        self.probe = Probe(self.tracker, time.perf_counter, self._fail)
        self.instrumentation: Any = None
        self._wall_offset = time.time() - time.perf_counter()
        self._rss = RssReader()
        self._warned = False
        self.sender = BatchSender(
            env.endpoint, env.session_id, identity, env.flush_interval_s,
            producers=[self._drain_steps], final_producers=[self._bye],
        )

    def start(self) -> None:
        global _ACTIVE
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
        try:
            self.tracker.close()
        except Exception as exc:
            self._fail(exc)
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
        self.probe.off = True
        self._warn(f"step instrumentation disabled after an internal error: {exc!r}")
        self._uninstall()

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"traceml: warning: {message}", file=sys.stderr)

    def _on_step(self, t: StepTiming) -> None:
        self.num_steps += 1
        inp, fwd, bwd, opt = t.phase_s
        self.steps.append((
            t.step, self._wall_offset + t.t_begin,
            inp * 1e3, fwd * 1e3, bwd * 1e3, opt * 1e3, t.total_s * 1e3, t.wait_s * 1e3,
            t.counts[0], t.counts[1], t.counts[2], t.counts[3], t.num_skipped,
            self._rss.read(), None, None,
        ))

    def _drain_steps(self) -> list[tuple[str, dict[str, Any]]]:
        rows: list[tuple[Any, ...]] = []
        while self.steps:
            rows.append(self.steps.popleft())
        if not rows:
            return []
        return [(protocol.KIND_STEPS, protocol.rows_payload(protocol.STEP_FIELDS, rows))]

    def _bye(self) -> list[tuple[str, dict[str, Any]]]:
        return [(protocol.KIND_BYE, {"num_steps": self.num_steps, "t": time.time()})]

    def step_enter(self) -> None:
        """``trace_step`` entered (main thread)."""
        if not self.probe.skip():
            try:
                self.tracker.manual_enter(time.perf_counter())
            except Exception as exc:
                self._fail(exc)

    def step_exit(self) -> None:
        if not self.probe.skip():
            try:
                self.tracker.manual_exit(time.perf_counter())
            except Exception as exc:
                self._fail(exc)
