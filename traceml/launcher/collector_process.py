"""Start, feed and stop the collector process (launcher side).

The launcher tells its collector what runs (`RunStart`, before the workers
start) and how it ended (`RunEnd`), then asks it to stop; the collector stores
both records in the session's store.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import orjson
import zmq

from traceml import environment
from traceml.collector.config import CollectorConfig
from traceml.errors import UsageError
from traceml.security import (
    TokenBook,
    capture_keys,
    client_keys_text,
    derive_keys,
    launcher_keys,
    new_secret,
    secure_client,
)
from traceml.store import StoreError, StoreWriter
from traceml.version import __version__
from traceml.wire.envelope import Envelope, encode
from traceml.wire.identity import Sender
from traceml.wire.records import Control, RunEnd, RunStart, StopCollector

READY_TIMEOUT_S = 20.0
CAPTURE_KEY_FILENAME = "capture.key"  # the session folder's key for ``traceml capture``
STOP_TIMEOUT_S = 15.0


def _read_line(stream: IO[bytes], timeout_s: float) -> bytes:
    """One line from a pipe, or b'' after the deadline."""
    result: list[bytes] = []
    reader = threading.Thread(target=lambda: result.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return result[0] if result else b""


class StoreUnwritable(UsageError):
    """The collector cannot create the store (a full disk, a read-only folder)."""


class CollectorFailed(UsageError):
    """The collector did not start (its port is taken, or it did not say it was ready)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"traceml: collector failed: {reason}; pick another "
                         "--aggregator-port or free that one")
        self.reason = reason


class CollectorProcess:
    """Handle on the running collector: its port, a control socket, its exit.

    The control socket speaks with the launcher's own key, made here for this
    collector alone: only it may send control messages.  ``keys`` are the
    session's client keys, for every other sender."""

    def __init__(self, config: CollectorConfig) -> None:
        launcher_secret = new_secret()
        config = replace(config, launcher_secret=launcher_secret)
        self.config = config
        self.keys = derive_keys(config.secret or config.session_id, config.session_id)
        env = environment.without_traceml(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "traceml.collector"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.proc.stdin.write(config.to_json().encode() + b"\n")
        self.proc.stdin.close()
        line = _read_line(self.proc.stdout, READY_TIMEOUT_S)
        ready: dict[str, Any] = orjson.loads(line) if line.strip() else {}
        if "port" not in ready:
            self.proc.kill()
            self.proc.wait()
            reason = ready.get("error", "it did not start")
            if ready.get("store_error"):
                raise StoreUnwritable(f"traceml: warning: {reason}")
            if ready.get("usage_error"):
                raise UsageError(f"traceml: {reason}")
            raise CollectorFailed(reason)
        self.port = int(ready["port"])
        self.ready = ready  # what the collector reported: its port, its dashboard's address
        if config.capture_secret is not None:
            self._write_capture_key(config.capture_secret)
        self._context = zmq.Context()
        self._control = self._context.socket(zmq.PUSH)
        self._control.setsockopt(zmq.LINGER, 2000)
        self._control.setsockopt(zmq.SNDHWM, 100)
        secure_client(self._control, launcher_keys(self.keys, launcher_secret))
        host = "127.0.0.1" if config.bind_host in ("0.0.0.0", "") else config.bind_host
        self._control.connect(f"tcp://{host}:{self.port}")
        self._identity = Sender(role="launcher", host=socket.gethostname(), pid=os.getpid(),
                                node_rank=0)
        self._token = TokenBook(config.secret, config.session_id).node if config.secret else None
        self._seq = 0

    def _write_capture_key(self, capture_secret: str) -> None:
        """What ``traceml capture`` needs to reach this collector, in the session folder,
        readable by its owner alone: a stranger cannot ask for a capture."""
        host = ("127.0.0.1" if self.config.bind_host in ("0.0.0.0", "")
                else self.config.bind_host)
        path = Path(self.config.db_path).parent / CAPTURE_KEY_FILENAME
        text = orjson.dumps({"endpoint": f"tcp://{host}:{self.port}",
                             "keys": client_keys_text(capture_keys(self.keys, capture_secret))})
        try:
            # A new file of this run's (not one planted there, nor a link): owner only
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(text)
        except OSError as exc:
            print(f"traceml: warning: {path} not written ({exc.strerror}): traceml capture "
                  "cannot reach this run", file=sys.stderr)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def record(self, run: RunStart | RunEnd) -> None:
        """Have the collector store the run's start or end."""
        self._send(run)

    def _send(self, control: Control) -> None:
        env = Envelope(session_id=self.config.session_id, sender=self._identity, seq=self._seq,
                       sent_at=time.time(), message=control, token=self._token)
        self._seq += 1
        try:
            self._control.send(encode(env), zmq.NOBLOCK)
        except zmq.Again:
            pass  # collector gone; the launcher reports that at the end

    def stop(self) -> int | None:
        """Ask the collector to drain and exit; returns its exit status (None: killed).

        Once stopped, it returns the same status again."""
        if self._control.closed:
            return self.proc.returncode
        if self.alive():
            self._send(StopCollector())
        else:
            self._control.setsockopt(zmq.LINGER, 0)
        self._control.close()
        self._context.term()
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def end_run(collector: CollectorProcess, exit_code: int) -> RunEnd:
    """Tell the collector how the run ended and stop it; returns the end record.

    A collector that died, hung (then killed) or could not write the store
    leaves the record incomplete: the launcher writes it into the store itself
    when it can, and the summary states that the telemetry stopped early."""
    was_alive = collector.alive()
    end = RunEnd(ended_at=time.time(), exit_code=exit_code)
    collector.record(end)
    if collector.stop() == 0 and was_alive:
        return end
    end = replace(end, telemetry_complete=False)
    try:
        store = StoreWriter(collector.config.db_path)
        store.save_run(end)
        store.close()
    except StoreError:
        pass  # a full disk: the summary gets the record from the launcher
    return end


def run_start(session_id: str, command: list[str], mode: str, summary_window_rows: int,
              expected_world_size: int, expected_nodes: int = 1, count_flops: bool = True,
              peak_tflops: float = 0.0, max_world_size: int = 0) -> RunStart:
    """The record of a run starting now, under this interpreter and torch."""
    import torch

    return RunStart(
        session_id=session_id, command=tuple(command), started_at=time.time(),
        traceml_version=__version__, torch_version=str(torch.__version__),
        python_version=platform.python_version(), summary_window_rows=summary_window_rows,
        mode=mode, expected_world_size=expected_world_size, expected_nodes=expected_nodes,
        count_flops=int(count_flops), peak_tflops=peak_tflops, max_world_size=max_world_size)

