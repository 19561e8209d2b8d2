"""The collector process: one ZeroMQ PULL socket in, the SQLite store out
(collector side).

Started by node 0's launcher before the workers.  It ignores SIGINT (Ctrl-C
is the launcher's to handle).  Every socket speaks CURVE (`traceml.security`):
a stranger's handshake fails and is counted.  Every message is checked
(`traceml.collector.intake`) before anything of it is stored, then handled by
`traceml.collector.dispatch.Collector` (claims, replays, sequence gaps, relay
batches).  On several nodes, other nodes' senders reach it through their node's
relay (`traceml.collector.relay`, which runs this module's `serve` over an
outbox), whose batches it takes from the relays' key alone.  It stops when the
launcher says the run ended (after draining what is still in flight) or when the
launcher disappears.  The live page's server (``--mode=dashboard``) and the
metrics endpoint (``--metrics-port``) are handed in by the entry point,
``traceml.collector.__main__``: this module does not import the live views.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import orjson
import zmq

from traceml import clocks
from traceml.clocks import Exchange
from traceml.collector.config import CollectorConfig
from traceml.collector.dispatch import Collector, Store
from traceml.environment import clock_skew_for_tests_s
from traceml.records import Capture
from traceml.security import (
    capture_keys,
    derive_keys,
    launcher_keys,
    relay_keys,
    secure_server,
    start_authenticator,
)
from traceml.store import JoinError, StoreError, StoreWriter
from traceml.wire.captures import CaptureAsk

HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

COMMIT_INTERVAL_S = 0.25
POLL_MS = 100
DRAIN_IDLE_S = 0.3
DRAIN_MAX_S = 5.0
DRAIN_BEHIND_MAX_S = 12.0  # ...and while messages still wait in the socket (under the
# launcher's 15 s STOP_TIMEOUT_S: the collector commits and exits before it is killed)
BEHIND_COMMIT_S = 1.0  # node 0's commit interval while messages wait in its socket
# What one connection may queue in the receive buffer: messages x the largest frame read
# bounds its bytes (16 x 16 MiB: 256 MiB); a sender over it waits, then drops and counts.
# ZeroMQ bounds neither the connections a key holder opens nor their sum.
RECEIVE_HWM = 16
OVERSIZE_SEEN = 2  # frames up to this many times the message limit are read (and counted
# as oversized); a larger one ZeroMQ refuses, closing that sender's connection
MAX_JOIN_ERRORS = 64
CONTROL_HWM = 64
ASK_REPEATS = (0.0, 1.0, 2.0, 4.0)  # an ask is published again this long after the first
# (a rank that connected late still reads it; the rank takes each id once)
JOIN_MAX_BYTES = 4096
MAX_CLOCK_ROWS = 10_000  # a launcher's stored exchanges (about 150 a day: see traceml.clocks)
MAX_CLOCK_LAUNCHERS = 8192  # launchers whose exchanges are stored (a node each)
MAX_PID = 2**31


class LiveServer(Protocol):
    """What the collector needs of the live page's server (``traceml.live.dashboard``)."""

    def start(self, host: str, port: int) -> object:
        """Start serving; returns the address to announce.  OSError: cannot listen."""

    def finish(self) -> None:
        """The run is over and the store closed: serve the final report, then stop."""


class Captures(Protocol):
    """What the collector needs of the profiler captures (``traceml.live.captures``): the
    asks to publish, and ``traceml capture``'s requests handed in."""

    def start(self, is_local: Callable[[int], bool]) -> None:
        """Start watching the live findings; ``is_local``: whether a rank reads this
        collector's control channel (a rank of another node, behind its relay, does not)."""

    def request(self, payload: Any) -> None:
        """A request of ``traceml capture`` (ValueError: not one)."""

    def take(self) -> list[tuple[CaptureAsk, list[Capture]]]:
        """The asks due now, each with its rows for the store."""

    def finish(self) -> None:
        """The run is over."""


class Exporter(Protocol):
    """What the collector needs of a metrics push (``traceml.live.otlp``)."""

    def start(self) -> object:
        """Start pushing; returns what to report as ready."""

    def finish(self) -> Mapping[str, Any]:
        """The run is over and the store committed: the last push; how the pushes went."""


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
        # Node 0's clock, which every node is set against (`traceml.clocks`).
        self.clock = clocks.wall_clock(clock_skew_for_tests_s())
        self.clock_rows: dict[tuple[str, int], int] = {}  # exchanges stored, by launcher
        keys = derive_keys(config.secret or config.session_id, config.session_id)
        admitted = [keys.client_public]
        self.relay_id = ""  # a relay forwards to node 0 only: its own listener admits none
        if config.upstream is None:
            admitted.append(relay_keys(keys, config.secret, config.session_id).client_public)
            self.relay_id = admitted[-1].decode("ascii")
        self.capture_id = ""
        if config.capture_secret is not None:
            capture_public = capture_keys(keys, config.capture_secret).client_public
            admitted.append(capture_public)
            self.capture_id = capture_public.decode("ascii")
        self.launcher_id = ""
        if config.launcher_secret is not None:
            launcher_public = launcher_keys(keys, config.launcher_secret).client_public
            admitted.append(launcher_public)
            self.launcher_id = launcher_public.decode("ascii")
        self.auth = start_authenticator(context, *admitted)
        self.sock = context.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, OVERSIZE_SEEN * config.max_message_bytes)
        secure_server(self.sock, keys)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILURES)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.join: Any = None
        self.behind = False  # the last poll left messages waiting (its budget ran out)
        self.on_capture: Callable[[bytes], None] | None = None  # ``traceml capture``'s requests
        # The control channel to the ranks (capture asks): a CURVE PUB, so a rank knows
        # what it reads came from the holder of the session's server key.
        self.control = context.socket(zmq.PUB)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.SNDHWM, CONTROL_HWM)
        secure_server(self.control, keys)
        try:
            self.port = _bind(self.sock, config.bind_host, config.port)
            self.control_port = _bind(self.control, config.bind_host, 0)
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

    def poll(self, timeout_ms: int, collector: Collector,
             budget_s: float = COMMIT_INTERVAL_S) -> int:
        """Handle what arrived, for ``budget_s`` at most (at least one message; the rest
        waits in the socket: under a flood the caller still commits on time); returns
        how many data messages were handled."""
        events = dict(self.poller.poll(timeout_ms))
        if self.monitor in events:
            self._count_handshake_failures(collector)
        if self.join is not None and self.join in events:
            self._answer_join(collector)
        if self.sock not in events:
            return 0
        n = 0
        until = time.monotonic() + budget_s
        while True:
            if n and time.monotonic() >= until:  # a clock read is nothing beside handle()
                self.behind = True
                return n
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.behind = False
                return n
            user = frame.get("User-Id")
            if self.capture_id and user == self.capture_id:
                self._capture_request(frame.bytes, collector)
                n += 1
                continue
            collector.handle(frame.bytes, bool(self.launcher_id) and user == self.launcher_id,
                             bool(self.relay_id) and user == self.relay_id)
            n += 1

    def _capture_request(self, data: bytes, collector: Collector) -> None:
        """A request of ``traceml capture`` (it came with the capture key alone)."""
        try:
            if self.on_capture is None:
                raise ValueError("no captures here")
            self.on_capture(data)
        except ValueError:
            collector.reject("malformed capture request")

    def publish(self, ask: CaptureAsk) -> None:
        """Send an ask to every rank on the control channel (dropped, not queued without
        bound, when a rank reads slowly: asks are repeated)."""
        try:
            self.control.send(orjson.dumps(ask.payload()), zmq.NOBLOCK)
        except zmq.Again:
            pass

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
            data = self.join.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        received = self.clock()
        try:
            request = orjson.loads(data)
        except orjson.JSONDecodeError:
            request = None
        if isinstance(request, dict) and "clock" in request:
            self._answer_clock(request["clock"], received, collector)
            return
        problem = "malformed join request"
        try:
            problem = join_problem(request, self.config)
        except (TypeError, AttributeError, ValueError, LookupError, RecursionError):
            pass  # the problem stays "malformed join request"
        try:
            if problem:
                collector.reject("node with mismatching options")
                if collector.rejected["node with mismatching options"] <= MAX_JOIN_ERRORS:
                    collector.store.add_join_error(JoinError(time.time(), problem))
        except StoreError:
            collector.store_failed = True
        finally:  # a REP socket owes every request its answer
            self.join.send(orjson.dumps({"ok": not problem, "error": problem}))

    def _answer_clock(self, request: Any, received: float, collector: Collector) -> None:
        """A node's clock exchange (`traceml.clocks`): the request's arrival and the
        answer's departure on this node's clock; the burst's best exchange it carries,
        stored (at most `MAX_CLOCK_ROWS` of one launcher, `MAX_CLOCK_LAUNCHERS`
        launchers).  Always answered, whatever it holds."""
        answer: dict[str, Any] = {"ok": False, "error": "malformed clock exchange"}
        try:
            host, pid, best = _clock_request(request)
            if best is not None:
                known = (host, pid) in self.clock_rows
                if known or len(self.clock_rows) < MAX_CLOCK_LAUNCHERS:
                    stored = self.clock_rows[host, pid] = self.clock_rows.get((host, pid), 0) + 1
                    if stored <= MAX_CLOCK_ROWS:
                        collector.store.add_clock_exchange(host, pid, best)
            answer = {"ok": True, "t2": received}
        except (TypeError, ValueError, LookupError, ArithmeticError):
            collector.reject("malformed clock exchange")
        except StoreError:
            collector.store_failed = True
            answer = {"ok": True, "t2": received}  # the exchange still stands
        finally:
            if answer["ok"]:
                answer["t3"] = self.clock()
            self.join.send(orjson.dumps(answer))

    def close(self) -> None:
        for sock in (self.join, self.monitor, self.sock, self.control):
            if sock is not None:
                sock.close(0)
        if self.auth is not None:
            self.auth.stop()


def _shown(value: Any) -> str:
    """A peer's value as printable text, short: it goes on node 0's terminal."""
    text = ascii(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _clock_request(request: Any) -> tuple[str, int, Exchange | None]:
    """A clock exchange's launcher (host, pid) and the best exchange of its last burst
    (None: none yet); ValueError or TypeError when it is not one a launcher sends."""
    who, best = request["who"], request.get("best")
    host, pid = who
    if (type(host) is not str or not 0 < len(host) <= 255 or type(pid) is not int
            or not 0 <= pid <= MAX_PID):
        raise ValueError("not a launcher")
    if best is None:
        return host, pid, None
    times = list(best)
    if len(times) != 4 or not all(type(t) in (int, float) and 0.0 <= t <= 1e11
                                  for t in times):  # NaN fails too
        raise ValueError("not four times")
    return host, pid, Exchange(*map(float, times))


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
          open_store: Callable[[CollectorConfig], Store] = open_store_writer,
          metrics: LiveServer | None = None, exporter: Exporter | None = None,
          captures: Captures | None = None) -> int:
    """Run until the launcher ends the session; returns the exit status (3: the
    store could not be written, so what arrived is not all stored).

    ``dashboard`` is started when the configuration asks for one (``dashboard_port``),
    ``metrics`` likewise (``metrics_port``; a port it cannot listen on stops the start:
    scrape configurations name the port, so it is not moved); ``exporter`` pushes
    until the end, and how its pushes went is stored with the run;
    ``open_store`` opens where accepted messages go (a relay: its batches to node 0);
    ``captures`` plans the profiler captures, which this process publishes to the ranks."""
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
    ready: dict[str, Any] = {"port": listener.port, "pid": os.getpid(),
                             "control_port": listener.control_port}
    if metrics is not None and config.metrics_port is not None:
        try:  # before the store: a refused start leaves no store behind
            ready["metrics"] = metrics.start(config.metrics_host, config.metrics_port)
        except OSError as exc:
            listener.close()
            return _not_ready(context, f"--metrics-port {config.metrics_port}: cannot listen "
                                       f"on {config.metrics_host}:{config.metrics_port} "
                                       f"({exc.strerror or exc}); choose a free port",
                              usage_error=True)
    if exporter is not None:
        try:
            ready["otlp"] = exporter.start()
        except Exception as exc:  # an OpenTelemetry setting it cannot use
            listener.close()
            if metrics is not None and "metrics" in ready:
                metrics.finish()
            return _not_ready(context, f"--otlp-endpoint: cannot export: {exc!r}",
                              usage_error=True)
    try:
        store = open_store(config)
    except StoreError as exc:
        listener.close()
        if metrics is not None and "metrics" in ready:
            metrics.finish()
        if exporter is not None:
            _finishing(exporter.finish)
        return _not_ready(context, f"cannot write telemetry to {config.db_path}: {exc}",
                          store_error=True)
    collector = Collector(config, store)
    if listener.join is not None:  # other nodes set their clocks against this launcher's
        collector.save_clock_reference(socket.gethostname(), config.parent_pid)
    dashboard = _start_dashboard(dashboard, config, ready)
    asks = None
    if captures is not None:
        asks = AskPublisher(listener, collector, captures)
        listener.on_capture = captures.request
        captures.start(collector.is_local_rank)
    print(orjson.dumps(ready).decode(), flush=True)
    try:
        _loop(listener, collector, config, asks)
    finally:
        if captures is not None:
            _finishing(captures.finish)
        collector.flush()
        if exporter is not None:
            _finishing(lambda: collector.save_exports({"otlp": exporter.finish()}))
        collector.close()
        if dashboard is not None:
            dashboard.finish()
        if metrics is not None and "metrics" in ready:
            _finishing(metrics.finish)
        listener.close()
        context.term()
    return 3 if collector.store_failed else 0


def _finishing(step: Callable[[], object]) -> None:
    """One of the collector's last steps (a metrics export's end): its error is said,
    and the rest of the end (the store's close, the sockets) still runs."""
    try:
        step()
    except Exception as exc:
        print(f"traceml collector: warning: {exc!r} at the end", file=sys.stderr, flush=True)


def _not_ready(context: Any, error: str, store_error: bool = False,
               usage_error: bool = False) -> int:
    """Say why the collector cannot run, on the line the launcher waits for
    (``usage_error``: an option of the user's cannot be honoured)."""
    print(orjson.dumps({"error": error, "store_error": store_error,
                        "usage_error": usage_error}).decode(), flush=True)
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


class AskPublisher:
    """Node 0's capture asks: each stored once, published a few times (`ASK_REPEATS`)."""

    def __init__(self, listener: Listener, collector: Collector, captures: Captures) -> None:
        self.listener = listener
        self.collector = collector
        self.captures = captures
        self._due: list[tuple[float, CaptureAsk]] = []

    def tick(self) -> None:
        now = time.monotonic()
        try:
            planned = self.captures.take()
        except Exception as exc:  # never the collector's loop
            planned = []
            print(f"traceml collector: warning: capture not asked: {exc!r}", file=sys.stderr,
                  flush=True)
        for ask, rows in planned:
            try:
                for row in rows:
                    self.collector.store.add_capture_ask(row)
            except StoreError:
                self.collector.store_failed = True
            self._due += [(now + after, ask) for after in ASK_REPEATS]
        if not self._due:
            return
        due = [d for d in self._due if d[0] <= now]
        self._due = [d for d in self._due if d[0] > now]
        for _, ask in due:
            self.listener.publish(ask)


def _loop(listener: Listener, collector: Collector, config: CollectorConfig,
          asks: AskPublisher | None = None) -> None:
    # A relay commits a batch to node 0 every relay interval (1-4 s, by the job's nodes);
    # node 0 commits to SQLite more often.
    interval_s = COMMIT_INTERVAL_S if config.upstream is None else config.relay_interval_s
    last_commit = time.monotonic()
    drain_since: float | None = None
    last_data = time.monotonic()
    while True:
        if listener.poll(POLL_MS, collector, interval_s):
            last_data = time.monotonic()
        if asks is not None:
            asks.tick()
        now = time.monotonic()
        # Behind (the poll stopped on its budget): commit less often, as each commit
        # writes every page it touched, but never less than once a second.
        due_s = max(interval_s, BEHIND_COMMIT_S) if listener.behind else interval_s
        if now - last_commit >= due_s:
            collector.flush()
            last_commit = now
        if drain_since is None and (collector.ended or os.getppid() != config.parent_pid):
            drain_since = now
            if not collector.ended:  # the launcher vanished: it will never record the end
                collector.launcher_lost(time.time(), "process" if config.in_process else "launcher")
        # Draining: until the senders are quiet or all said goodbye, DRAIN_MAX_S at most,
        # or DRAIN_BEHIND_MAX_S while a backlog is still being worked through.
        drain_max_s = DRAIN_BEHIND_MAX_S if listener.behind else DRAIN_MAX_S
        if drain_since is not None and (
            now - last_data >= DRAIN_IDLE_S or now - drain_since >= drain_max_s
            or (collector.ended and collector.all_said_bye())
        ):
            return
