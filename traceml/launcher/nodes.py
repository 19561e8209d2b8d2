"""Several nodes, seen from one launcher (launcher side).

* `JoinCheck` (nodes other than the collector's): tells node 0's collector
  this node's options; a mismatch (another ``--session-id``, ``--nnodes`` or
  ``--nproc-per-node``) ends this launcher with one line instead of a hang in
  torch's rendezvous.
* `Waiting` (every node): until this node's workers start, says every few
  seconds what the rendezvous is waiting for (torch's own timeouts are 10-15
  minutes of silence otherwise); on node 0 it also reports nodes whose options
  do not match.
* `wait_for_nodes`: node 0 writes the summary once every node's launcher has
  said goodbye, or after a bounded wait, naming what is missing.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson
import psutil
import zmq

from traceml import clocks
from traceml.config import RunConfig
from traceml.environment import SECRET_HINT, clock_skew_for_tests_s
from traceml.errors import UsageError
from traceml.security import CurveKeys, secure_client
from traceml.store import STORE_FILENAME, JoinError, SenderState, StoreError, StoreReader

WAIT_REPORT_S = 10.0
NODES_FINISH_TIMEOUT_S = 20.0
STOP_WAIT_S = 60.0  # a partial summary being written (seconds at thousands of ranks)
RELAY_SILENT_S = 10.0  # 2.5 of the longest relay interval (`collector.config.relay_interval_s`)
JOIN_REPLY_TIMEOUT_MS = 2000


def _say(message: str) -> None:
    print(f"traceml: {message}", file=sys.stderr, flush=True)


def local_workers_started(skip_pids: set[int]) -> bool:
    try:
        return any(c.pid not in skip_pids for c in psutil.Process().children())
    except psutil.Error:
        return False


_T = TypeVar("_T")


def _read_store(db_path: Path, read: Callable[[StoreReader], tuple[_T, ...]]) -> tuple[_T, ...]:
    """What ``read`` finds in the store; nothing while it cannot be read (not made yet, busy)."""
    try:
        with StoreReader(db_path, timeout_s=1.0) as reader:
            return read(reader)
    except StoreError:
        return ()


def _launchers(db_path: Path) -> tuple[SenderState, ...]:
    """Each node's launcher (its system sampler) that reached the collector."""
    return _read_store(db_path, lambda reader: reader.senders(role="system"))


class JoinCheck(threading.Thread):
    """Ask node 0's collector whether this node's options match; exit 2 if not
    (or when its CURVE handshake fails: another session id or secret)."""

    def __init__(self, cfg: RunConfig, host: str, port: int, keys: CurveKeys) -> None:
        super().__init__(name="traceml-join", daemon=True)
        self.keys = keys
        self.request = orjson.dumps({
            "session_id": cfg.session_id, "host": os.uname().nodename,
            "options": {"nnodes": cfg.torch.nnodes, "nproc_per_node": cfg.torch.nproc_per_node},
        })
        self.address = f"tcp://{host}:{port}"
        self.done = threading.Event()

    def run(self) -> None:
        context = zmq.Context()
        try:
            while not self.done.is_set():
                reply = self._ask(context)
                if reply is not None:
                    self._act(reply)
                    self._sync_clock(context)
                    return
        finally:
            context.destroy(0)

    def _sync_clock(self, context: Any) -> None:
        """Bursts of clock exchanges with node 0 (`traceml.clocks`) until the launcher
        stops: one as the node joins, then at `SYNC_INTERVALS_S`.  A request after each
        burst carries its best exchange to node 0's store."""
        clock = clocks.wall_clock(clock_skew_for_tests_s())
        who = [socket.gethostname(), os.getpid()]
        sock = None
        intervals = itertools.chain(clocks.SYNC_INTERVALS_S,
                                    itertools.repeat(clocks.SYNC_INTERVALS_S[-1]))
        wait = 0.0
        try:
            while not self.done.wait(wait):
                burst: list[clocks.Exchange] = []
                for n in range(clocks.EXCHANGES_PER_BURST + 1):
                    best = clocks.best(burst) if n == clocks.EXCHANGES_PER_BURST else None
                    if sock is None:
                        sock = context.socket(zmq.REQ)
                        sock.setsockopt(zmq.LINGER, 0)
                        secure_client(sock, self.keys)
                        sock.connect(self.address)
                    sent = clock()
                    sock.send(orjson.dumps({"clock": {
                        "who": who, "best": None if best is None else
                        [best.t1, best.t2, best.t3, best.t4]}}))
                    if not sock.poll(JOIN_REPLY_TIMEOUT_MS):
                        sock.close(0)  # a REQ socket waits for its answer: a new one
                        sock = None
                        continue
                    reply = orjson.loads(sock.recv())
                    received = clock()
                    if reply.get("ok"):
                        burst.append(clocks.Exchange(sent, float(reply["t2"]),
                                                     float(reply["t3"]), received))
                wait = next(intervals) * random.uniform(0.9, 1.1)  # nodes' bursts apart
        except (zmq.ZMQError, orjson.JSONDecodeError, TypeError, ValueError, KeyError):
            pass  # no clock offset for this node; the run goes on
        finally:
            if sock is not None:
                sock.close(0)

    def _ask(self, context: Any) -> dict[str, Any] | None:
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, self.keys)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        try:
            sock.connect(self.address)
            sock.send(self.request)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            events = dict(poller.poll(JOIN_REPLY_TIMEOUT_MS))
            if sock in events:
                reply: dict[str, Any] = orjson.loads(sock.recv())
                return reply
            if monitor in events:
                return {"ok": False, "error": "node 0's collector refused this node's key: "
                        f"use the same --session-id on every node, and {SECRET_HINT}"}
            return None
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    def _act(self, reply: dict[str, Any]) -> None:
        if reply.get("ok"):
            return
        _say(f"error: {reply.get('error')}")
        sys.stdout.flush()
        os._exit(2)  # still in torch's rendezvous: nothing of the user's to clean up

    def stop(self) -> None:
        self.done.set()


class Waiting(threading.Thread):
    """Report what the launch waits for, until this node's workers start."""

    def __init__(self, cfg: RunConfig, rendezvous: str, db_path: Path | None,
                 skip_pids: set[int]) -> None:
        super().__init__(name="traceml-waiting", daemon=True)
        self.cfg, self.rendezvous, self.db_path = cfg, rendezvous, db_path
        self.skip_pids = skip_pids
        self.done = threading.Event()
        self.reported: set[JoinError] = set()

    def run(self) -> None:
        next_report = time.monotonic() + WAIT_REPORT_S
        while not self.done.wait(0.5):
            if local_workers_started(self.skip_pids):
                return
            self._report_mismatches()
            if time.monotonic() >= next_report:
                next_report += WAIT_REPORT_S
                _say(self._status())

    def _status(self) -> str:
        want = self.cfg.min_nodes
        if self.db_path is None:
            return (f"waiting for the rendezvous at {self.rendezvous} "
                    f"({want} nodes expected; torch's rendezvous timeout applies)")
        joined = len({(s.sender.host, s.sender.pid) for s in _launchers(self.db_path)})
        return (f"waiting for nodes to join the rendezvous at {self.rendezvous}: "
                f"{joined} of {want} launchers have reached the collector")

    def _report_mismatches(self) -> None:
        if self.db_path is None:
            return
        for error in _read_store(self.db_path, StoreReader.join_errors):
            if error not in self.reported:
                self.reported.add(error)
                _say(f"error: {error.problem}")

    def stop(self) -> None:
        self.done.set()


def _lost_relays(senders: tuple[SenderState, ...]) -> set[int]:
    """Nodes whose relay fell silent without a goodbye: what it had not forwarded is lost."""
    now = time.time()
    return {s.sender.node_rank for s in senders if s.sender.role == "relay" and not s.said_bye
            and s.sender.node_rank >= 0 and now - s.last_seen > RELAY_SILENT_S}


def wait_for_nodes(db_path: Path, num_nodes: int) -> list[str]:
    """Wait until every node's launcher that reported said goodbye (or its relay fell
    silent); what is missing.

    A node that never reported (it never joined) is not waited for, only named.
    """
    deadline = time.monotonic() + NODES_FINISH_TIMEOUT_S
    announced = False
    while True:
        senders = _read_store(db_path, StoreReader.senders)
        launchers = [s for s in senders if s.sender.role == "system" and s.sender.node_rank >= 0]
        seen = {s.sender.node_rank for s in launchers}
        done = {s.sender.node_rank for s in launchers if s.said_bye}
        lost = _lost_relays(senders) - done
        if done | lost >= seen or time.monotonic() >= deadline:
            missing = [f"node {s.sender.node_rank} ({s.sender.host}"
                       + ("; its relay stopped)" if s.sender.node_rank in lost else ")")
                       for s in launchers if s.sender.node_rank not in done]
            never = max(0, num_nodes - len(seen))
            return missing + ([f"{never} node(s) that never joined"] if never else [])
        if not announced:
            announced = True
            _say(f"waiting up to {NODES_FINISH_TIMEOUT_S:.0f} s for the other nodes to finish")
        time.sleep(0.2)


class SilenceWatch(threading.Thread):
    """Node 0: a node whose launcher stops reporting has died (or lost its
    network).  Its ranks would hang in their collectives until torch's timeout
    (30 minutes for gloo), so write a partial summary now, naming it."""

    def __init__(self, session_dir: Path, silent_after_s: float) -> None:
        super().__init__(name="traceml-silence", daemon=True)
        self.session_dir = session_dir
        self.silent_after_s = silent_after_s
        self.done = threading.Event()
        self.reported: set[int] = set()

    def run(self) -> None:
        from traceml.report.session import write_summary

        while not self.done.wait(1.0):
            launchers = _launchers(self.session_dir / STORE_FILENAME)
            now = time.time()
            silent = [s.sender for s in launchers
                      if s.sender.node_rank >= 0 and not s.said_bye
                      and now - s.last_seen > self.silent_after_s
                      and s.sender.node_rank not in self.reported]
            if not silent:
                continue
            if self.done.is_set():  # the run ended meanwhile: the final summary is written
                return
            self.reported.update(n.node_rank for n in silent)
            names = ", ".join(f"node {n.node_rank} ({n.host})" for n in silent)
            # Said before the summary is written: whoever sees the summary has seen why.
            _say(f"{names} stopped reporting {self.silent_after_s:.0f} s ago; writing a "
                 "partial summary")
            try:
                files = write_summary(self.session_dir)
            except (OSError, UsageError) as exc:
                _say(f"cannot write the partial summary: {str(exc).removeprefix('traceml: ')}")
                continue
            _say(f"partial summary written to {files.json_path}")

    def stop(self) -> None:
        """No partial summary after this: one being written is finished first, so the
        final summary, written next, is the one that stays."""
        self.done.set()
        if self.is_alive():
            self.join(STOP_WAIT_S)
