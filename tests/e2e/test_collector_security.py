"""The collector against strangers: a real collector process bound beyond
127.0.0.1 (on 127.0.0.2, inside the loopback range) with CURVE on, and rogue
senders that have no key, the wrong key, garbage bytes or a 100 MB frame."""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from pathlib import Path

import zmq

from tests.conftest import wait_until
from traceml import protocol
from traceml.collector.server import CollectorConfig
from traceml.launcher.collector_process import CollectorProcess
from traceml.protocol import Envelope, Sender
from traceml.security import derive_keys, secure_client

HOST = "127.0.0.2"


_ITERATION = ((protocol.INPUT, 0.0), (protocol.END, 1.0), (protocol.FORWARD, 1.0),
              (protocol.END, 2.0), (protocol.BACKWARD, 2.0), (protocol.END, 3.0),
              (protocol.OPTIMIZER, 3.0), (protocol.OPTIMIZER_END, 4.0))


def _envelope(session: str, seq: int, rows: int = 1) -> bytes:
    """One events message holding ``rows`` whole training steps."""
    times: list[list[float]] = [[] for _ in range(protocol.NUM_EVENT_CODES)]
    start = seq * 100.0
    for i in range(rows):
        for code, dt in _ITERATION:
            times[code].append(start + 10.0 * i + dt)
    times[protocol.CLOSE].append(start + 10.0 * rows)
    payload = protocol.events_payload(0, 0.0, times, [], [])
    return protocol.encode(Envelope(session, protocol.KIND_EVENTS,
                                    Sender("rank", "rogue", 1, 0, rank=0), seq, time.time(),
                                    payload))


def _rows(db_path: Path, sql: str) -> list[tuple[object, ...]]:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return list(db.execute(sql))
    finally:
        db.close()


def test_strangers_are_counted_and_dropped(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.sqlite"
    collector = CollectorProcess(CollectorConfig(
        session_id="safe", bind_host=HOST, port=0, db_path=str(db), parent_pid=os.getpid(),
        secure=True, secret="the secret"))
    address = f"tcp://{HOST}:{collector.port}"
    context = zmq.Context()
    try:
        def push(keys_secret: str | None) -> zmq.Socket[bytes]:
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if keys_secret is not None:
                secure_client(sock, derive_keys(keys_secret, "safe"))
            sock.connect(address)
            return sock

        plain, wrong = push(None), push("guessed")
        for i in range(3):
            for sock in (plain, wrong):
                try:
                    sock.send(_envelope("safe", i), zmq.NOBLOCK)
                except zmq.Again:
                    pass
        with socket.create_connection((HOST, collector.port)) as raw:
            raw.sendall(os.urandom(4096))
        big = push("the secret")
        big.send(b"x" * (100 * 1024 * 1024))  # over the 8 MiB limit: connection dropped
        good = push("the secret")
        good.send(_envelope("safe", 0, rows=5))
        foreign = push("the secret")
        foreign.send(_envelope("other-session", 0))
        stored = wait_until(lambda: _rows(db, "SELECT COUNT(*) FROM steps")[0][0] == 5)
        assert stored, "the legitimate sender's steps never arrived"
        assert collector.alive()
        assert wait_until(lambda: dict(_rows(db, "SELECT reason, count FROM rejected")).get(
            "failed handshake (no or wrong session key)", 0) >= 3)
        assert wait_until(lambda: dict(_rows(db, "SELECT reason, count FROM rejected")).get(
            "foreign session", 0) == 1)
        for sock in (plain, wrong, big, good, foreign):
            sock.close(0)
    finally:
        context.term()
        collector.stop()
    assert _rows(db, "SELECT COUNT(*) FROM steps")[0][0] == 5
    senders = _rows(db, "SELECT host FROM senders")
    assert senders == [("rogue",)]  # only the keyed sender of this session got in


def test_garbage_on_loopback_collector(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.sqlite"
    collector = CollectorProcess(CollectorConfig(
        session_id="s", bind_host="127.0.0.1", port=0, db_path=str(db), parent_pid=os.getpid()))
    context = zmq.Context()
    try:
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{collector.port}")
        for frame in (b"\x00\xff not json", b"[1, 2]", b'{"v": 99}', _envelope("s", 1)):
            sock.send(frame)
        assert wait_until(lambda: _rows(db, "SELECT COUNT(*) FROM steps")[0][0] == 1)
        assert wait_until(lambda: sum(c for _, c in _rows(db, "SELECT * FROM rejected")) == 3)
        assert collector.alive()
        sock.close(0)
    finally:
        context.term()
        collector.stop()
