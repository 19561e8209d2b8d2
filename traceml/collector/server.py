"""The collector process: one ZeroMQ PULL socket in, the SQLite store out
(collector side).

Started by node 0's launcher before the workers.  It ignores SIGINT (Ctrl-C
is the launcher's to handle), stores every sample, counts malformed, foreign
and oversized messages and per-sender sequence gaps, and stops when the
launcher says the run ended (after draining what is still in flight) or when
the launcher disappears.  The live page's server (``--mode=dashboard``) is handed in
by the entry point, ``traceml.collector.__main__``: this module does not import
the live views.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
import zmq

from traceml import phases, protocol, stacks
from traceml.collector.steps import RankSteps
from traceml.diagnosis.samples import Incident
from traceml.errors import ProtocolError
from traceml.protocol import Envelope, IncidentReport, RunEnd, RunStart, Sender
from traceml.security import secure_server, session_keys
from traceml.store import JoinError, SenderState, StoreError, StoreWriter

HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

COMMIT_INTERVAL_S = 0.25
POLL_MS = 100
DRAIN_IDLE_S = 0.3
DRAIN_MAX_S = 5.0


@dataclass(frozen=True)
class CollectorConfig:
    session_id: str
    bind_host: str
    port: int  # 0: any free port
    db_path: str
    parent_pid: int
    max_message_bytes: int = protocol.MAX_MESSAGE_BYTES
    # --mode=dashboard: the live page's server runs in this process (see LiveServer).
    dashboard_port: int | None = None
    dashboard_host: str = "127.0.0.1"
    # Several nodes: CURVE when listening beyond loopback, and the join check.
    secure: bool = False
    secret: str | None = None
    join_port: int | None = None
    expected: dict[str, str] | None = None  # nnodes, nproc_per_node as node 0 has them

    def to_json(self) -> str:
        return orjson.dumps(self.__dict__).decode()

    @classmethod
    def from_json(cls, text: str) -> CollectorConfig:
        return cls(**orjson.loads(text))


class LiveServer(Protocol):
    """What the collector needs of the live page's server (``traceml.live.dashboard``)."""

    def start(self, host: str, port: int) -> object:
        """Start serving; returns the address to announce.  OSError: cannot listen."""

    def finish(self) -> None:
        """The run is over and the store closed: serve the final report, then stop."""


class Collector:
    """Receives envelopes and writes them to the store."""

    def __init__(self, config: CollectorConfig, store: StoreWriter) -> None:
        self.config = config
        self.store = store
        self.senders: dict[str, SenderState] = {}
        self.rank_steps: dict[str, RankSteps] = {}  # sender id -> its step tracker
        self.rejected: dict[str, int] = {}
        self.open_stalls: dict[tuple[int, int], int] = {}  # (rank, pid) -> its stall's row
        self.ended = False
        self.num_steps = 0

    def handle(self, data: bytes) -> None:
        try:
            env = protocol.decode(data, self.config.max_message_bytes)
        except ProtocolError as exc:
            self.reject(str(exc).split(":")[0])
            return
        if env.session_id != self.config.session_id:
            self.reject("foreign session")
            return
        try:
            self._dispatch(env)
        except (ProtocolError, ValueError, TypeError, KeyError, ArithmeticError,
                StoreError) as exc:
            self.reject(f"bad {env.kind} payload: {type(exc).__name__}")

    def all_said_bye(self) -> bool:
        """Every sender that spoke has said goodbye: nothing more is in flight."""
        return all(state.said_bye for state in self.senders.values())

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _track(self, env: Envelope) -> SenderState:
        key = env.sender.sender_id
        state = self.senders.get(key)
        now = time.time()
        if state is None:
            state = self.senders[key] = SenderState(env.sender, now, now)
        if env.seq > state.last_seq + 1:
            state.num_gaps += env.seq - state.last_seq - 1
        state.last_seq = max(state.last_seq, env.seq)
        state.last_seen = now
        state.num_messages += 1
        state.num_sent = max(state.num_sent, env.num_sent + 1)
        state.num_dropped = max(state.num_dropped, env.num_dropped)
        return state

    def _dispatch(self, env: Envelope) -> None:
        if env.kind == protocol.KIND_CONTROL:
            self._control(env.payload)
            return
        state = self._track(env)
        if env.kind == protocol.KIND_EVENTS:
            steps = self.rank_steps.get(state.sender.sender_id)
            if steps is None:
                steps = self.rank_steps[state.sender.sender_id] = RankSteps()
            self.num_steps += self.store.add_steps(env.sender, steps.feed(env.payload))
            if steps.flop_counts:
                self.store.add_flop_counts(env.sender, steps.flop_counts)
                steps.flop_counts = []
        elif env.kind == protocol.KIND_PROCESS:
            fields, rows = protocol.iter_rows(env.payload)
            self.store.add_process(env.sender, fields, rows)
        elif env.kind == protocol.KIND_SYSTEM:
            fields, rows = protocol.iter_rows(env.payload)
            self.store.add_system(env.sender, fields, rows)
        elif env.kind == protocol.KIND_INCIDENT:
            self._incident(env.sender, protocol.check_incident(env.payload))
        elif env.kind == protocol.KIND_BYE:
            state.said_bye = True
            self.rank_steps.pop(state.sender.sender_id, None)  # its last events came before
        self.store.save_sender(state)

    def _incident(self, sender: Sender, report: IncidentReport) -> None:
        """A stall or crash, placed at the rank's step and phase: from its step
        tracker (a rank's own stall report comes after all its events) or, for a
        stack taken from outside or an exception's traceback, from the stack."""
        rank = sender.rank if sender.role == "rank" else report.rank
        pid = sender.pid if sender.role == "rank" else report.pid
        if rank is None or pid is None:
            raise ProtocolError("incident without its rank")
        who = sender if sender.role == "rank" else self._rank_sender(rank, pid) or sender
        key = (rank, pid)
        if report.what == protocol.RESUMED:
            row = self.open_stalls.pop(key, None)
            if row is not None:
                self.store.clear_stall(row, report.at)
                return
        elif report.what == protocol.STALL and key in self.open_stalls:
            return  # already reported (by the rank, or from outside)
        steps = self.rank_steps.get(who.sender_id)
        step, codes = steps.tracker.position() if steps is not None else (None, ())
        open_phases = tuple(phases.PHASES[c].name for c in codes if c < len(phases.PHASES))
        phase = open_phases[-1] if open_phases else None
        if report.what == protocol.STALL and who is sender:  # every event came before
            phase = phase or stacks.phase_of(report.stack)
        elif report.stack:  # taken now, while the events may lag: the stack says
            phase = stacks.phase_of(report.stack)
        what = protocol.STALL if report.what == protocol.RESUMED else report.what
        row = self.store.add_incident(Incident(
            what=what, rank=rank, node_rank=who.node_rank, host=who.host, pid=pid,
            began_at=report.began_at, detected_at=time.time(),
            cleared_at=report.at if report.what == protocol.RESUMED else None,
            step=step, phase=phase, open_phases=open_phases, stack=report.stack,
            stack_source=report.stack_source, detail=report.detail))
        if report.what == protocol.STALL:
            self.open_stalls[key] = row

    def _rank_sender(self, rank: int, pid: int) -> Sender | None:
        for state in self.senders.values():
            if state.sender.role == "rank" and state.sender.rank == rank and state.sender.pid == pid:
                return state.sender
        return None

    def _control(self, payload: dict[str, Any]) -> None:
        record = protocol.check_control(payload)
        if isinstance(record, (RunStart, RunEnd)):
            self.store.save_run(record)
        else:
            self.ended = True

    def flush(self) -> None:
        if self.rejected:
            self.store.save_rejected(self.rejected)
        self.store.commit()


def _bind(sock: Any, host: str, port: int) -> int:
    if port == 0:
        return int(sock.bind_to_random_port(f"tcp://{host}"))
    sock.bind(f"tcp://{host}:{port}")
    return port


class Listener:
    """The collector's sockets: data in (PULL, CURVE when secured), the join
    check for other nodes (REP), and a monitor counting failed handshakes."""

    def __init__(self, context: Any, config: CollectorConfig) -> None:
        self.config = config
        self.auth: Any = None
        self.sock = context.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        keys = session_keys(config.secure, config.secret, config.session_id)
        if keys is not None:
            self.auth = secure_server(context, self.sock, keys)
        self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILURES)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.join: Any = None
        try:
            self.port = _bind(self.sock, config.bind_host, config.port)
            if config.join_port is not None:
                self.join = context.socket(zmq.REP)
                self.join.setsockopt(zmq.LINGER, 0)
                self.join.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
                _bind(self.join, config.bind_host, config.join_port)
                self.poller.register(self.join, zmq.POLLIN)
        except zmq.ZMQError:
            self.close()
            raise

    def poll(self, timeout_ms: int, collector: Collector) -> int:
        """Handle what arrived; returns how many data messages were handled."""
        events = dict(self.poller.poll(timeout_ms))
        if self.monitor in events:
            self._count_handshake_failures(collector)
        if self.join is not None and self.join in events:
            self._answer_join(collector)
        if self.sock not in events:
            return 0
        n = 0
        while True:
            try:
                collector.handle(self.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return n
            n += 1

    def _count_handshake_failures(self, collector: Collector) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            collector.reject("failed handshake (no or wrong session key)")

    def _answer_join(self, collector: Collector) -> None:
        try:
            request = orjson.loads(self.join.recv(zmq.NOBLOCK))
            problem = join_problem(request, self.config)
        except zmq.Again:
            return
        except (orjson.JSONDecodeError, TypeError, AttributeError):
            problem = "malformed join request"
        if problem:
            collector.reject("node with mismatching options")
            collector.store.add_join_error(JoinError(time.time(), problem))
        self.join.send(orjson.dumps({"ok": not problem, "error": problem}))

    def close(self) -> None:
        for sock in (self.join, self.monitor, self.sock):
            if sock is not None:
                sock.close(0)
        if self.auth is not None:
            self.auth.stop()


def join_problem(request: dict[str, Any], config: CollectorConfig) -> str:
    """Why a joining node's options differ from node 0's ('' when they match)."""
    theirs = {"session_id": request.get("session_id"), **dict(request.get("options") or {})}
    ours = {"session_id": config.session_id, **(config.expected or {})}
    host = request.get("host", "?")
    for key, value in ours.items():
        if theirs.get(key) != value:
            name = "--" + key.replace("_", "-")
            return (f"node on {host} has {name} {theirs.get(key)!r} but node 0 has {value!r}: "
                    f"use the same {name} on every node")
    return ""


def serve(config: CollectorConfig, dashboard: LiveServer | None = None) -> int:
    """Run until the launcher ends the session; returns the exit status.

    ``dashboard`` is started when the configuration asks for one (``dashboard_port``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    try:
        listener = Listener(context, config)
    except zmq.ZMQError as exc:
        print(orjson.dumps({"error": f"cannot listen on {config.bind_host}:{config.port}: "
                                     f"{exc.strerror}"}).decode(), flush=True)
        context.destroy(0)
        return 2
    store = StoreWriter(config.db_path)
    collector = Collector(config, store)
    ready: dict[str, Any] = {"port": listener.port, "pid": os.getpid()}
    dashboard = _start_dashboard(dashboard, config, ready)
    print(orjson.dumps(ready).decode(), flush=True)
    try:
        _loop(listener, collector, config)
    finally:
        collector.flush()
        store.close()
        if dashboard is not None:
            dashboard.finish()
        listener.close()
        context.term()
    return 0


def _start_dashboard(dashboard: LiveServer | None, config: CollectorConfig,
                     ready: dict[str, Any]) -> LiveServer | None:
    """The live page's server when asked for; its address (or why not) goes in ``ready``."""
    if dashboard is None or config.dashboard_port is None:
        return None
    try:
        ready["dashboard"] = dashboard.start(config.dashboard_host, config.dashboard_port)
    except OSError as exc:
        ready["dashboard_error"] = f"cannot listen on {config.dashboard_host}: {exc.strerror}"
        return None
    return dashboard


def _loop(listener: Listener, collector: Collector, config: CollectorConfig) -> None:
    last_commit = time.monotonic()
    drain_since: float | None = None
    last_data = time.monotonic()
    while True:
        if listener.poll(POLL_MS, collector):
            last_data = time.monotonic()
        now = time.monotonic()
        if now - last_commit >= COMMIT_INTERVAL_S:
            collector.flush()
            last_commit = now
        if drain_since is None and (collector.ended or os.getppid() != config.parent_pid):
            drain_since = now
        if drain_since is not None and (
            now - last_data >= DRAIN_IDLE_S or now - drain_since >= DRAIN_MAX_S
            or (collector.ended and collector.all_said_bye())
        ):
            return
