"""The collector process: one ZeroMQ PULL socket in, the SQLite store out
(collector side).

Started by node 0's launcher before the workers.  It ignores SIGINT (Ctrl-C
is the launcher's to handle), stores every sample, counts malformed, foreign
and oversized messages and per-sender sequence gaps, and stops when the
launcher says the run ended (after draining what is still in flight) or when
the launcher disappears.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import orjson
import zmq

from traceml import protocol
from traceml.collector.store import SenderState, StoreWriter
from traceml.errors import ProtocolError
from traceml.protocol import Envelope

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

    def to_json(self) -> str:
        return orjson.dumps(self.__dict__).decode()

    @classmethod
    def from_json(cls, text: str) -> CollectorConfig:
        return cls(**orjson.loads(text))


class Collector:
    """Receives envelopes and writes them to the store."""

    def __init__(self, config: CollectorConfig, store: StoreWriter) -> None:
        self.config = config
        self.store = store
        self.senders: dict[str, SenderState] = {}
        self.rejected: dict[str, int] = {}
        self.ended = False
        self.num_steps = 0

    def handle(self, data: bytes) -> None:
        try:
            env = protocol.decode(data, self.config.max_message_bytes)
        except ProtocolError as exc:
            self._reject(str(exc).split(":")[0])
            return
        if env.session_id != self.config.session_id:
            self._reject("foreign session")
            return
        try:
            self._dispatch(env)
        except (ProtocolError, ValueError, TypeError, KeyError) as exc:
            self._reject(f"bad {env.kind} payload: {type(exc).__name__}")

    def _reject(self, reason: str) -> None:
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
        if env.kind == protocol.KIND_STEPS:
            fields, rows = protocol.iter_rows(env.payload)
            self.num_steps += self.store.add_steps(env.sender, fields, rows)
        elif env.kind == protocol.KIND_PROCESS:
            fields, rows = protocol.iter_rows(env.payload)
            self.store.add_process(env.sender, fields, rows)
        elif env.kind == protocol.KIND_SYSTEM:
            fields, rows = protocol.iter_rows(env.payload)
            self.store.add_system(env.sender, fields, rows)
        elif env.kind == protocol.KIND_BYE:
            state.said_bye = True
        self.store.save_sender(state)

    def _control(self, payload: dict[str, Any]) -> None:
        op = payload.get("op")
        if op == "meta":
            self.store.set_meta(dict(payload["values"]))
        elif op == "end":
            self.ended = True

    def flush(self) -> None:
        if self.rejected:
            self.store.save_rejected(self.rejected)
        self.store.commit()


def _bind(sock: Any, config: CollectorConfig) -> int:
    if config.port == 0:
        return int(sock.bind_to_random_port(f"tcp://{config.bind_host}"))
    sock.bind(f"tcp://{config.bind_host}:{config.port}")
    return config.port


def _receive_all(sock: Any, collector: Collector) -> int:
    n = 0
    while True:
        try:
            collector.handle(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return n
        n += 1


def serve(config: CollectorConfig) -> int:
    """Run until the launcher ends the session; returns the exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    try:
        port = _bind(sock, config)
    except zmq.ZMQError as exc:
        print(orjson.dumps({"error": f"cannot listen on {config.bind_host}:{config.port}: "
                                     f"{exc.strerror}"}).decode(), flush=True)
        return 2
    store = StoreWriter(config.db_path)
    collector = Collector(config, store)
    print(orjson.dumps({"port": port, "pid": os.getpid()}).decode(), flush=True)
    try:
        _loop(sock, collector, config)
    finally:
        collector.flush()
        store.close()
        sock.close()
        context.term()
    return 0


def _loop(sock: Any, collector: Collector, config: CollectorConfig) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    last_commit = time.monotonic()
    drain_since: float | None = None
    last_data = time.monotonic()
    while True:
        if poller.poll(POLL_MS):
            if _receive_all(sock, collector):
                last_data = time.monotonic()
        now = time.monotonic()
        if now - last_commit >= COMMIT_INTERVAL_S:
            collector.flush()
            last_commit = now
        if drain_since is None and (collector.ended or os.getppid() != config.parent_pid):
            drain_since = now
        if drain_since is not None and (
            now - last_data >= DRAIN_IDLE_S or now - drain_since >= DRAIN_MAX_S
        ):
            return


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return serve(CollectorConfig.from_json(args[0]))
