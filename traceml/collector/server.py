"""The collector process: one ZeroMQ PULL socket in, the SQLite store out
(collector side).

Started by node 0's launcher before the workers.  It ignores SIGINT (Ctrl-C
is the launcher's to handle).  Every socket speaks CURVE (`traceml.security`):
a stranger's handshake fails and is counted.  Every message is checked
(`traceml.collector.intake`) before anything of it is stored; one that fails,
a replay, a sender speaking for a rank another sender owns, or a control
message from anyone but the launcher's key is rejected and counted by reason.
Per-sender sequence gaps are counted too.  On several nodes, other nodes'
senders reach it through their node's relay (`traceml.collector.relay`, which
runs this module's `Collector` over an outbox): a relay's batch, accepted from
the relays' key alone, carries its senders' states and their step rows, samples
and incidents, each sender claimed here as if it had spoken.  It stops when the launcher says the
run ended (after draining what is still in flight) or when the launcher
disappears.  The live page's server (``--mode=dashboard``) is handed in
by the entry point, ``traceml.collector.__main__``: this module does not import
the live views.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson
import zmq

from traceml import phases, protocol, stacks
from traceml.collector import intake
from traceml.collector.intake import Accepted, Rejected
from traceml.collector.steps import RankSteps
from traceml.diagnosis.samples import FlopCount, Incident
from traceml.errors import ProtocolError
from traceml.protocol import Envelope, IncidentReport, RelayBatch, RunEnd, RunStart, Sender
from traceml.security import (
    derive_keys,
    launcher_keys,
    relay_keys,
    secure_server,
    start_authenticator,
)
from traceml.store import JoinError, SenderState, StepRecord, StoreError, StoreWriter

HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

COMMIT_INTERVAL_S = 0.25
RELAY_INTERVAL_S = 1.0
POLL_MS = 100
DRAIN_IDLE_S = 0.3
DRAIN_MAX_S = 5.0
# What one sender may queue in the receive buffer: messages x the largest message
# bounds its bytes (64 x 8 MiB); a sender over it waits, then drops and counts.
RECEIVE_HWM = 64
MAX_SENDERS = 1 << 16
MAX_JOIN_ERRORS = 64
JOIN_MAX_BYTES = 4096


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
    # CURVE keys: from ``secret`` (None: from the session id); the launcher's own key
    # from ``launcher_secret`` (None: nobody may send control messages).
    secret: str | None = None
    launcher_secret: str | None = None
    # Several nodes: the join check.
    join_port: int | None = None
    expected: dict[str, str] | None = None  # nnodes, nproc_per_node as node 0 has them
    # A node's relay (`traceml.collector.relay`): node 0's collector, where this
    # process forwards what its node's senders send (None: this is the collector).
    upstream: str | None = None
    node_rank: int = -1  # the relay's node (-1: c10d, not known when it starts)

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


class Store(Protocol):
    """Where the collector puts what it accepted: the SQLite store on node 0
    (`StoreWriter`), or a relay's batch to node 0 (`traceml.collector.relay.Outbox`)."""

    def add_steps(self, sender: Sender, records: Iterable[StepRecord]) -> int: ...
    def add_step_rows(self, rows: Sequence[Sequence[Any]]) -> int: ...
    def add_flop_counts(self, sender: Sender, counts: Iterable[FlopCount]) -> None: ...
    def add_process(self, sender: Sender, fields: Sequence[str],
                    rows: Iterable[Sequence[Any]]) -> None: ...
    def add_system(self, sender: Sender, fields: Sequence[str],
                   rows: Iterable[Sequence[Any]]) -> None: ...
    def add_incident(self, i: Incident) -> int: ...
    def clear_stall(self, row_id: int, cleared_at: float) -> None: ...
    def save_sender(self, s: SenderState) -> None: ...
    def save_senders(self, states: Iterable[SenderState]) -> None: ...
    def save_rejected(self, counts: Mapping[str, int]) -> None: ...
    def save_run(self, record: RunStart | RunEnd) -> None: ...
    def add_join_error(self, error: JoinError) -> None: ...
    def commit(self) -> None: ...
    def close(self) -> None: ...


class Collector:
    """Receives envelopes and writes them to the store."""

    def __init__(self, config: CollectorConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self.senders: dict[str, SenderState] = {}
        self.rank_steps: dict[str, RankSteps] = {}  # sender id -> its step tracker
        self.owners: dict[tuple[Any, ...], tuple[str, int]] = {}  # who speaks for what
        self.rejected: dict[str, int] = {}
        self.open_stalls: dict[tuple[int, int], int] = {}  # (rank, pid) -> its stall's row
        self.ended = False
        self.store_failed = False
        self.num_steps = 0
        self.relayed_by: dict[str, str] = {}  # sender id -> the relay that speaks for it
        self.relayed_rows: dict[tuple[str, int], int] = {}  # (relay, its stall id) -> row
        # relay process (host, pid: its id changes when a c10d relay learns its node) ->
        # the running totals of what it rejected
        self.relayed_rejected: dict[tuple[str, int], dict[str, int]] = {}
        self._prefix = intake.session_prefix(config.session_id)

    def handle(self, data: bytes, from_launcher: bool = False, from_relay: bool = False) -> None:
        """One message; ``from_launcher`` / ``from_relay``: it came with the
        launcher's key / the relays' key."""
        try:
            msg = intake.accept(data, self._prefix, self.config.max_message_bytes)
            self._dispatch(msg, from_launcher, from_relay)
        except Rejected as exc:
            self.reject(exc.reason)
        except (ProtocolError, ValueError, TypeError, KeyError, ArithmeticError):
            self.reject("a payload that cannot be replayed or stored")
        except StoreError:
            self.store_failed = True
            self.reject("not stored: the store failed")

    def all_said_bye(self) -> bool:
        """Every sender that spoke has said goodbye: nothing more is in flight."""
        return all(state.said_bye for state in self.senders.values())

    def reject(self, reason: str, n: int = 1) -> None:
        if n > 0:
            self.rejected[reason] = self.rejected.get(reason, 0) + n

    def _state(self, env: Envelope) -> SenderState:
        """The sender's state; Rejected for a replay, or a sender speaking for
        a rank (or node) that another sender already spoke for."""
        key = env.sender.sender_id
        state = self.senders.get(key)
        if state is not None:
            if env.seq <= state.last_seq:
                raise Rejected("replayed or duplicate message")
            return state
        if len(self.senders) >= MAX_SENDERS:
            raise Rejected("too many senders")
        claim = _claim(env.sender)
        owner = (env.sender.host, env.sender.pid)
        if claim is not None and self.owners.setdefault(claim, owner) != owner:
            raise Rejected("rank or node claimed by another sender")
        now = time.time()
        state = self.senders[key] = SenderState(env.sender, now, now)
        return state

    def _track(self, state: SenderState, env: Envelope) -> None:
        if env.seq > state.last_seq + 1:
            state.num_gaps += env.seq - state.last_seq - 1
        state.last_seq = env.seq
        state.last_seen = time.time()
        state.num_messages += 1
        state.num_sent = max(state.num_sent, env.num_sent + 1)
        state.num_dropped = max(state.num_dropped, env.num_dropped)

    def _dispatch(self, msg: Accepted, from_launcher: bool, from_relay: bool = False) -> None:
        env = msg.envelope
        if env.kind == protocol.KIND_CONTROL:
            if not from_launcher:
                raise Rejected("control message from a sender other than the launcher")
            self._control(msg.payload)
            return
        if env.kind == protocol.KIND_RELAY and not (from_relay and env.sender.role == "relay"):
            raise Rejected("relay batch from a sender other than a relay")
        state = self._state(env)
        if env.kind == protocol.KIND_RELAY:
            self._relayed(env.sender, msg.payload)
        elif env.kind == protocol.KIND_EVENTS:
            self._add_steps(env.sender, msg.payload)
        elif env.kind == protocol.KIND_PROCESS:
            self.store.add_process(env.sender, *msg.payload)
        elif env.kind == protocol.KIND_SYSTEM:
            self.store.add_system(env.sender, *msg.payload)
        elif env.kind == protocol.KIND_INCIDENT:
            self._incident(env.sender, msg.payload)
        elif env.kind == protocol.KIND_BYE:
            state.said_bye = True
            self.rank_steps.pop(state.sender.sender_id, None)  # its last events came before
        self._track(state, env)
        self.store.save_sender(state)

    def _incident(self, sender: Sender, report: IncidentReport) -> None:
        """A stall or crash, placed at the rank's step and phase: from its step
        tracker (a rank's own stall report comes after all its events) or, for a
        stack taken from outside or an exception's traceback, from the stack."""
        rank = sender.rank if sender.role == "rank" else report.rank
        pid = sender.pid if sender.role == "rank" else report.pid
        if rank is None or pid is None or sender.role not in ("rank", "system"):
            raise Rejected("incident without its rank")
        who = sender if sender.role == "rank" else self._rank_sender(rank, pid) or sender
        if who.host != sender.host:  # a node's launcher speaks for its own ranks only
            raise Rejected("incident about a rank of another node")
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

    def _add_steps(self, sender: Sender, batch: protocol.EventBatch) -> None:
        steps = self.rank_steps.get(sender.sender_id)
        if steps is None:
            steps = self.rank_steps[sender.sender_id] = RankSteps()
        records = steps.feed_batch(batch)
        if steps.flop_counts:
            self.store.add_flop_counts(sender, steps.flop_counts)
            steps.flop_counts = []
        plausible = [r for r in records if _plausible(r)]
        self.reject("implausible step times", len(records) - len(plausible))
        stored = self.store.add_steps(sender, plausible)
        self.reject("duplicate step", len(plausible) - stored)
        self.num_steps += stored

    def _relayed(self, relay: Sender, batch: RelayBatch) -> None:
        """A node's relay's batch: its senders' states (each claims its rank as if it
        spoke here), then their steps, samples, FLOP counts and incidents."""
        now = time.time()
        senders = [self._relayed_sender(relay, who, values, now) for who, values in batch.senders]
        self.store.save_senders(self.senders[s.sender_id] for s in senders if s is not None)
        self._relayed_steps(batch.step_columns, senders)
        for i, *count in batch.flop_counts:
            if senders[i] is not None:
                self.store.add_flop_counts(senders[i], [FlopCount(*count)])
        for part, add in ((batch.process, self.store.add_process),
                          (batch.system, self.store.add_system)):
            for i, fields, rows in part:
                if senders[i] is not None:
                    add(senders[i], fields, rows)
        for row_id, node_rank, cleared_at, step, phase, open_phases, r in batch.incidents:
            speaker = self._relayed_rank(relay, r.rank, r.pid)
            if speaker is False:
                self.reject("incident about a rank of another node")
                continue
            if speaker is not None:
                node_rank = speaker.node_rank
            row = self.store.add_incident(Incident(
                what=r.what, rank=r.rank, node_rank=node_rank, host=relay.host, pid=r.pid,
                began_at=r.began_at, detected_at=r.at, cleared_at=cleared_at, step=step,
                phase=phase, open_phases=open_phases, stack=r.stack,
                stack_source=r.stack_source, detail=r.detail))
            if r.what == protocol.STALL and cleared_at is None:
                self.relayed_rows[(relay.sender_id, row_id)] = row
        for row_id, at in batch.clears:
            if (relay.sender_id, row_id) in self.relayed_rows:
                self.store.clear_stall(self.relayed_rows.pop((relay.sender_id, row_id)), at)
        self.relayed_rejected[(relay.host, relay.pid)] = batch.rejected

    def _relayed_rank(self, relay: Sender, rank: int | None,
                      pid: int | None) -> Sender | None | Literal[False]:
        """The sender of the rank a relayed incident is about: False when that rank
        speaks here directly or through another relay (a relay speaks for its own
        node's ranks only); None when the rank never spoke (it crashed first)."""
        known = [s.sender for s in self.senders.values()
                 if s.sender.role == "rank" and s.sender.rank == rank]
        if any(self.relayed_by.get(s.sender_id) != relay.sender_id for s in known):
            return False
        return next((s for s in known if s.pid == pid), None)

    def _relayed_sender(self, relay: Sender, who: Sender, values: list[Any],
                        now: float) -> Sender | None:
        """A relayed sender's state, stored as seen now; None: refused (another node's
        sender, or a rank another sender or relay speaks for)."""
        key = who.sender_id
        if who.host != relay.host or who.role == "relay":
            self.reject("relayed sender of another node")
            return None
        if key in self.senders:
            if self.relayed_by.get(key) != relay.sender_id:
                self.reject("rank or node claimed by another sender")
                return None
        elif len(self.senders) >= MAX_SENDERS:
            self.reject("too many senders")
            return None
        else:
            claim = _claim(who)
            if claim is not None and self.owners.setdefault(claim, (who.host, who.pid)) != (
                    who.host, who.pid):
                self.reject("rank or node claimed by another sender")
                return None
        state = self.senders[key] = SenderState(who, *values)
        state.last_seen = now  # node 0's clock: its silence watch compares with it
        self.relayed_by[key] = relay.sender_id
        return who

    def _relayed_steps(self, columns: list[list[Any]], senders: list[Sender | None]) -> None:
        if not columns:
            return
        index, *values = columns
        prefixes = [None if s is None or s.rank is None else (s.rank, s.restart, s.node_rank)
                    for s in senders]
        rows = [p + v for p, v in zip(map(prefixes.__getitem__, index), zip(*values))
                if p is not None]
        self.reject("relayed step of a refused sender", len(index) - len(rows))
        stored = self.store.add_step_rows(rows)
        self.reject("duplicate step", len(rows) - stored)
        self.num_steps += stored

    def all_rejected(self) -> dict[str, int]:
        """What this collector rejected, and what every relay reported it rejected."""
        total = dict(self.rejected)
        for counts in self.relayed_rejected.values():
            for reason, n in counts.items():
                total[reason] = total.get(reason, 0) + n
        return total

    def _control(self, record: protocol.Control) -> None:
        if isinstance(record, RunStart) and record.session_id != self.config.session_id:
            raise Rejected("run start of another session")
        if isinstance(record, (RunStart, RunEnd)):
            self.store.save_run(record)
        else:
            self.ended = True

    def flush(self) -> None:
        """Commit what was stored; a store that cannot be written (a full disk)
        is remembered, and the run goes on."""
        try:
            rejected = self.all_rejected()
            if rejected:
                self.store.save_rejected(rejected)
            self.store.commit()
        except StoreError:
            self.store_failed = True

    def close(self) -> None:
        try:
            self.store.close()
        except StoreError:
            self.store_failed = True


MAX_STEP_MS = 1e12  # 31 years


def _plausible(record: StepRecord) -> bool:
    """Times a step can take: finite, not negative, under :data:`MAX_STEP_MS`."""
    times = (record.total_ms, record.wait_ms, *record.phase_ms,
             *(t for t in (*record.gpu_ms, record.collective_ms) if t is not None))
    return all(0.0 <= t <= MAX_STEP_MS for t in times) and math.isfinite(record.t_begin)


def _claim(sender: Sender) -> tuple[Any, ...] | None:
    """What a sender speaks for, that no other sender may: its rank in its
    attempt, or its node's system samples (None: nothing exclusive)."""
    if sender.rank is not None:
        return ("rank", sender.rank, sender.restart)
    if sender.role == "system" and sender.node_rank >= 0:
        return ("system", sender.node_rank)
    return None


def _bind(sock: Any, host: str, port: int) -> int:
    if port == 0:
        return int(sock.bind_to_random_port(f"tcp://{host}"))
    sock.bind(f"tcp://{host}:{port}")
    return port


class Listener:
    """The collector's sockets, every one a CURVE server: data in (PULL), the
    join check for other nodes (REP), and a monitor counting failed handshakes."""

    def __init__(self, context: Any, config: CollectorConfig) -> None:
        self.config = config
        keys = derive_keys(config.secret or config.session_id, config.session_id)
        admitted = [keys.client_public]
        self.relay_id = ""  # a relay forwards to node 0 only: its own listener admits none
        if config.upstream is None:
            admitted.append(relay_keys(keys, config.secret, config.session_id).client_public)
            self.relay_id = admitted[-1].decode("ascii")
        self.launcher_id = ""
        if config.launcher_secret is not None:
            launcher_public = launcher_keys(keys, config.launcher_secret).client_public
            admitted.append(launcher_public)
            self.launcher_id = launcher_public.decode("ascii")
        self.auth = start_authenticator(context, *admitted)
        self.sock = context.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        secure_server(self.sock, keys)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILURES)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.join: Any = None
        try:
            self.port = _bind(self.sock, config.bind_host, config.port)
            if config.join_port is not None:
                self.join = context.socket(zmq.REP)
                self.join.setsockopt(zmq.LINGER, 0)
                self.join.setsockopt(zmq.MAXMSGSIZE, JOIN_MAX_BYTES)
                secure_server(self.join, keys)
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
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return n
            user = frame.get("User-Id")
            collector.handle(frame.bytes, bool(self.launcher_id) and user == self.launcher_id,
                             bool(self.relay_id) and user == self.relay_id)
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
        except (orjson.JSONDecodeError, TypeError, AttributeError, ValueError):
            problem = "malformed join request"
        if problem:
            collector.reject("node with mismatching options")
            if collector.rejected["node with mismatching options"] <= MAX_JOIN_ERRORS:
                collector.store.add_join_error(JoinError(time.time(), problem))
        self.join.send(orjson.dumps({"ok": not problem, "error": problem}))

    def close(self) -> None:
        for sock in (self.join, self.monitor, self.sock):
            if sock is not None:
                sock.close(0)
        if self.auth is not None:
            self.auth.stop()


def _shown(value: Any) -> str:
    """A peer's value as printable text, short: it goes on node 0's terminal."""
    text = ascii(value)
    return text if len(text) <= 80 else text[:77] + "..."


def join_problem(request: dict[str, Any], config: CollectorConfig) -> str:
    """Why a joining node's options differ from node 0's ('' when they match).

    The answer never shows node 0's session id, and shows the peer's text escaped."""
    if not isinstance(request, dict):
        raise TypeError("not an object")
    host = _shown(request.get("host", "?"))
    if request.get("session_id") != config.session_id:
        return (f"node on {host} has another --session-id than node 0: "
                "use the same --session-id on every node")
    theirs = dict(request.get("options") or {})
    for key, value in (config.expected or {}).items():
        if theirs.get(key) != value:
            name = "--" + key.replace("_", "-")
            return (f"node on {host} has {name} {_shown(theirs.get(key))} but node 0 has "
                    f"{value!r}: use the same {name} on every node")
    return ""


def open_store_writer(config: CollectorConfig) -> Store:
    return StoreWriter(config.db_path)


def serve(config: CollectorConfig, dashboard: LiveServer | None = None,
          open_store: Callable[[CollectorConfig], Store] = open_store_writer) -> int:
    """Run until the launcher ends the session; returns the exit status (3: the
    store could not be written, so what arrived is not all stored).

    ``dashboard`` is started when the configuration asks for one (``dashboard_port``);
    ``open_store`` opens where accepted messages go (a relay: its batches to node 0)."""
    # Ctrl-C and the job's SIGTERM (``timeout``, ``scancel`` of the process group) are
    # the launcher's to handle: it stops this process once the run is over.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    context = zmq.Context()
    try:
        listener = Listener(context, config)
    except zmq.ZMQError as exc:
        return _not_ready(context, f"cannot listen on {config.bind_host}:{config.port}: "
                                   f"{exc.strerror}")
    try:
        store = open_store(config)
    except StoreError as exc:
        listener.close()
        return _not_ready(context, f"cannot write telemetry to {config.db_path}: {exc}",
                          store_error=True)
    collector = Collector(config, store)
    ready: dict[str, Any] = {"port": listener.port, "pid": os.getpid()}
    dashboard = _start_dashboard(dashboard, config, ready)
    print(orjson.dumps(ready).decode(), flush=True)
    try:
        _loop(listener, collector, config)
    finally:
        collector.flush()
        collector.close()
        if dashboard is not None:
            dashboard.finish()
        listener.close()
        context.term()
    return 3 if collector.store_failed else 0


def _not_ready(context: Any, error: str, store_error: bool = False) -> int:
    """Say why the collector cannot run, on the line the launcher waits for."""
    print(orjson.dumps({"error": error, "store_error": store_error}).decode(), flush=True)
    context.destroy(0)
    return 2


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
    # A relay commits a batch to node 0 once a second; node 0 commits to SQLite more often.
    interval_s = COMMIT_INTERVAL_S if config.upstream is None else RELAY_INTERVAL_S
    last_commit = time.monotonic()
    drain_since: float | None = None
    last_data = time.monotonic()
    while True:
        if listener.poll(POLL_MS, collector):
            last_data = time.monotonic()
        now = time.monotonic()
        if now - last_commit >= interval_s:
            collector.flush()
            last_commit = now
        if drain_since is None and (collector.ended or os.getppid() != config.parent_pid):
            drain_since = now
        if drain_since is not None and (
            now - last_data >= DRAIN_IDLE_S or now - drain_since >= DRAIN_MAX_S
            or (collector.ended and collector.all_said_bye())
        ):
            return
