"""Batched, never-blocking ZeroMQ PUSH to the collector (agent and system
sampler side).

One background thread owns the socket: it is created lazily in that thread,
never used across fork, sends with ``NOBLOCK`` under a bounded high-water
mark, and closes with a short bounded linger at exit (ZeroMQ's default linger
would hang the process when the collector is gone).  Every envelope carries
this sender's sequence number and its sent/dropped counts, so the collector
can count gaps and the summary can report both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import zmq

from traceml.errors import WarnOnce
from traceml.security import CurveKeys, secure_client
from traceml.wire.envelope import Envelope, Message, encode
from traceml.wire.identity import Sender
from traceml.wire.records import Hello

SEND_HWM = 1000
EXIT_LINGER_MS = 1000
CONTROL_HWM = 16  # control messages read per tick, and queued
CONTROL_MAX_BYTES = 64 * 1024

# Called by the thread each flush: returns the messages to send.
Producer = Callable[[], list[Message]]


class BatchSender:
    """A daemon thread that sends whatever the producers return, periodically."""

    def __init__(self, endpoint: str, session_id: str, identity: Sender,
                 interval_s: float, producers: list[Producer], *, keys: CurveKeys,
                 final_producers: list[Producer] | None = None,
                 on_exit: Callable[[], None] | None = None,
                 token_of: Callable[[Sender], str | None] | None = None,
                 prepare: Callable[[], None] | None = None,
                 control: tuple[str, Callable[[Any], None]] | None = None) -> None:
        self.endpoint = endpoint
        self.session_id = session_id
        self.identity = identity
        self.interval_s = interval_s
        self.producers = producers
        self.final_producers = final_producers or []
        self.keys = keys
        self.on_exit = on_exit  # the thread ended (stopped, or failed): nothing drains producers
        # The token proving each identity it sends as (`traceml.security.TokenBook`), and
        # what the thread does before its first message (an agent asks for its token).
        self.token_of = token_of or (lambda _: None)
        self.prepare = prepare
        # Node 0's control channel (a CURVE SUB: only the collector holding the session's
        # server key can publish on it) and what takes each message it carries.
        self.control = control
        self._control_socket: Any = None
        self.num_sent = 0
        self.num_dropped = 0
        self._seqs: dict[Sender, int] = {}
        self.last_seq: dict[str, int] = {}  # kind -> sequence number of its last message
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.num_flushes = 0
        self._thread = threading.Thread(target=self._run, name="traceml-sender", daemon=True)
        self._socket: Any = None
        self._context: Any = None
        self._warnings = WarnOnce()

    def start(self) -> None:
        self._thread.start()

    def flush_soon(self) -> int:
        """Wake the thread to send now; returns the flush count to wait past."""
        done = self.num_flushes
        self._wake.set()
        return done

    def stop(self, timeout_s: float = 3.0) -> None:
        """Flush what is left and close; bounded in time."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            if self.prepare is not None:
                self.prepare()
            self._open()
            self.send(Hello(time.time()))
            while not self._stop.is_set():
                self._wake.wait(self.interval_s)
                self._wake.clear()
                if self._stop.is_set():
                    break
                self._read_control()
                self._flush(self.producers)
                self.num_flushes += 1
            self._flush(self.producers + self.final_producers)
        except Exception as exc:  # fail open: telemetry stops, training goes on
            self._warnings.to_stderr("stopped", f"telemetry sender stopped: {exc!r}")
        finally:
            self._close()
            if self.on_exit is not None:
                self.on_exit()

    def _open(self) -> None:
        self._context = zmq.Context()
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, self.keys)  # every collector socket speaks CURVE
        sock.connect(self.endpoint)
        self._socket = sock
        if self.control is not None:
            sub = self._context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, CONTROL_HWM)
            sub.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
            secure_client(sub, self.keys)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self.control[0])
            self._control_socket = sub

    def _read_control(self) -> None:
        """What node 0 published since the last tick (a few messages at most); a
        message the handler refuses is dropped, said once."""
        if self._control_socket is None or self.control is None:
            return
        for _ in range(CONTROL_HWM):
            try:
                data = self._control_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.control[1](orjson.loads(data))
            except Exception as exc:
                self._warnings.to_stderr("control", f"a control message was dropped: {exc!r}")

    def _close(self) -> None:
        if self._control_socket is not None:
            self._control_socket.close(0)
            self._control_socket = None
        if self._socket is not None:
            self._socket.setsockopt(zmq.LINGER, EXIT_LINGER_MS)
            self._socket.close()
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def _flush(self, producers: list[Producer]) -> None:
        for produce in producers:
            for message in produce():
                self.send(message)

    def send(self, message: Message, identity: Sender | None = None) -> None:
        """Send now, never blocking; ``identity`` speaks for another sender
        (the watch sampler reports each rank it watches under that rank)."""
        who = identity or self.identity
        seq = self._seqs.get(who, 0)
        self._seqs[who] = seq + 1
        env = Envelope(session_id=self.session_id, sender=who, seq=seq, sent_at=time.time(),
                       message=message, num_sent=self.num_sent, num_dropped=self.num_dropped,
                       token=self.token_of(who))
        try:
            self._socket.send(encode(env), zmq.NOBLOCK)
            self.num_sent += 1
            if identity is None:
                self.last_seq[message.KIND] = seq
        except zmq.Again:
            self.num_dropped += 1
