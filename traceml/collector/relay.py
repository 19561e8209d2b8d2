"""A node's relay (relay process: started by the launcher of every node but the
collector's on a multi-node job).

It listens on 127.0.0.1 for its own node's senders (the ranks' agents, the
node's system sampler) and runs the collector's own intake on what they send
(`traceml.collector.dispatch.Collector`: the same validators, CURVE keys, replay
and claim checks, rejected counts, and the step tracker with its incident
placement), but over an `Outbox` instead of the store: what node 0 would store
is collected into one `relay.RelayBatch` and sent to node 0's collector every
`config.relay_interval_s` with the relays' key (node 0 accepts relay batches
from that key alone).  So node 0 replays no rank's events, and stores the steps as
the blocks the relay made of them (grouped by rank, summed and encoded here): its
work grows with the number of nodes, not of ranks.

A relay that dies stops its node's messages: node 0 reports that node as lost
(its system sampler falls silent, and so does the relay's heartbeat), as when
the whole node dies.
"""

from __future__ import annotations

import operator
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import groupby
from typing import Any

import zmq

from traceml import step_fields
from traceml.clocks import Exchange
from traceml.collector.config import CollectorConfig
from traceml.collector.dispatch import BAD_STEPS
from traceml.collector.server import serve
from traceml.records import Capture, FlopCount, Incident, StepRow
from traceml.security import TokenBook, derive_keys, relay_keys, secure_client
from traceml.store import JoinError, SenderState, step_block
from traceml.wire.captures import CaptureReport
from traceml.wire.envelope import Envelope, Message, encode
from traceml.wire.identity import Sender
from traceml.wire.incidents import IncidentReport
from traceml.wire.records import Bye, Hello, RunEnd, RunStart
from traceml.wire.relay import RelayBatch, RelayedIncident
from traceml.wire.rows import ProcessRows, SystemRows

SEND_HWM = 100
SEND_TIMEOUT_MS = 1000  # node 0 slow or gone: the relay waits this long, then drops the batch
EXIT_LINGER_MS = 2000
HEARTBEAT_S = 2.0  # an empty batch when nothing came this long (checked every relay interval)
MAX_BATCH_STEPS = 16_384  # step rows a relay holds at most: then it sends at once (a message
# stays far below the 8 MiB a collector takes, whatever the relay interval)


class Upstream:
    """The relay's PUSH socket to node 0's collector, speaking with the relays' key.

    Not on any training path, so a send may wait (up to `SEND_TIMEOUT_MS`)
    rather than drop at once; a batch still not taken is dropped and counted."""

    def __init__(self, endpoint: str, session_id: str, identity: Sender, keys: Any,
                 token: str | None = None) -> None:
        self.session_id, self.identity, self.token = session_id, identity, token
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        secure_client(self.sock, keys)
        self.sock.connect(endpoint)
        self.seq = self.num_sent = self.num_dropped = 0
        self.send(Hello(time.time()))

    def send(self, message: Message) -> bool:
        env = Envelope(self.session_id, self.identity, self.seq, time.time(), message,
                       num_sent=self.num_sent, num_dropped=self.num_dropped, token=self.token)
        self.seq += 1
        try:
            self.sock.send(encode(env))
        except zmq.Again:
            self.num_dropped += 1
            return False
        self.num_sent += 1
        return True

    def adopt_node(self, node_rank: int) -> None:
        """Speak as the relay of ``node_rank`` from now on (c10d: the rendezvous gave
        this node its rank after the relay started): a goodbye under the old identity,
        then a hello under the new one, whose sequence and counts start afresh."""
        self.send(Bye(time.time()))
        self.identity = replace(self.identity, node_rank=node_rank)
        self.seq = self.num_sent = self.num_dropped = 0
        self.send(Hello(time.time()))

    def close(self) -> None:
        self.send(Bye(time.time()))
        self.sock.setsockopt(zmq.LINGER, EXIT_LINGER_MS)
        self.sock.close()
        self.context.term()


class Outbox:
    """The relay's `dispatch.Store`: what the collector accepted, held until the next
    batch to node 0 (`commit`)."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self._states: dict[str, SenderState] = {}  # changed since the last batch
        self._steps: list[tuple[tuple[int, int], tuple[Any, ...]]] = []  # by (rank, attempt)
        self._flops: list[tuple[str, list[Any]]] = []
        self._process: list[tuple[str, ProcessRows]] = []
        self._system: list[tuple[str, SystemRows]] = []
        self._incidents: list[RelayedIncident] = []
        self._clears: list[tuple[int, float]] = []
        self._rejected: dict[str, int] = {}
        self._rejected_sent: dict[str, int] = {}
        self._next_id = 0
        self._last_batch = time.monotonic()
        self.num_steps = 0  # forwarded so far
        self.num_bad_steps = 0  # steps no block could be made of (counted as rejected)

    def add_steps(self, rows: Sequence[StepRow]) -> int:
        """The rows' measured columns go to node 0, which takes who ran them from the
        relayed sender it accepted (a relay speaks for its own node's ranks only)."""
        self._steps += [((row.rank, row.restart), row[_NUM_IDENTITY:]) for row in rows]
        return len(rows)

    def add_relayed_blocks(self, blocks: Iterable[tuple[tuple[int, int, int], Sequence[Any]]]
                           ) -> int:
        """Another relay's blocks: a relay takes none (node 0 alone accepts relays)."""
        return 0

    def add_capture_ask(self, c: Capture) -> None:
        """Asks are node 0's: a relay stores none."""

    def add_capture_report(self, rank: int, host: str, report: CaptureReport) -> bool:
        """A rank of this node answered an ask: node 0 publishes asks to its own ranks
        only (a relay forwards no asks), so there is none to answer here."""
        return False

    def add_flop_counts(self, sender: Sender, counts: Iterable[FlopCount]) -> None:
        self._flops += [(sender.sender_id, c.values()) for c in counts]

    def add_process(self, sender: Sender, samples: ProcessRows) -> None:
        self._process.append((sender.sender_id, samples))

    def add_processes(self, samples: Iterable[tuple[Sender, ProcessRows]]) -> None:
        for sender, rows in samples:
            self.add_process(sender, rows)

    def add_system(self, sender: Sender, samples: SystemRows) -> None:
        self._system.append((sender.sender_id, samples))

    def add_incident(self, i: Incident) -> int:
        """A stall or crash placed at the rank's step here; node 0 stores it."""
        self._next_id += 1
        report = IncidentReport(i.what, i.began_at, i.detected_at, i.stack, i.stack_source,
                                i.rank, i.pid, i.detail)
        self._incidents.append(RelayedIncident(self._next_id, i.node_rank, i.cleared_at, i.step,
                                               i.phase, i.open_phases, report))
        return self._next_id

    def clear_stall(self, row_id: int, cleared_at: float) -> None:
        self._clears.append((row_id, cleared_at))

    def save_sender(self, s: SenderState) -> None:
        """A sender's state, saved after each of its messages; a full batch goes now
        (every step held has its sender's state held too)."""
        self._states[s.sender.sender_id] = s
        if len(self._steps) >= MAX_BATCH_STEPS:
            self.commit()

    def save_senders(self, states: Iterable[SenderState]) -> None:
        for s in states:
            self.save_sender(s)

    def save_rejected(self, counts: Mapping[str, int]) -> None:
        self._rejected = dict(counts)

    def save_run(self, record: RunStart | RunEnd) -> None:
        """Node 0's launcher records the run; a relay's launcher sends no such record."""

    def add_join_error(self, error: JoinError) -> None:
        """Only node 0's collector answers join checks."""

    def add_clock_exchange(self, host: str, pid: int, exchange: Exchange) -> None:
        """Only node 0's collector answers clock exchanges."""

    def save_clock_reference(self, host: str, pid: int) -> None:
        """Only node 0's collector answers clock exchanges."""

    def save_launcher_lost(self, at: float, role: str) -> None:
        """A relay's launcher is its node's: node 0 learns of it as a lost node."""

    def save_exports(self, exports: Mapping[str, Mapping[str, Any]]) -> None:
        """Metrics are exported by node 0's collector only."""

    def commit(self) -> None:
        """Send what arrived since the last batch, as one message.  A batch node 0
        did not take (it was slow or gone) gives back its sender states, incidents
        and cleared stalls to the next one: a rank's goodbye or a stall's end is
        never lost with it (its steps and samples are, counted as one drop)."""
        held = self._states, self._incidents, self._clears, self._rejected_sent
        batch = self.take()
        if batch is not None and not self.upstream.send(batch):
            # Nothing arrived since the take (one thread): what it held is all there is.
            self._states, self._incidents, self._clears, self._rejected_sent = held

    def close(self) -> None:
        self.commit()
        self.upstream.close()

    def take(self) -> RelayBatch | None:
        """The batch of everything held (None: nothing new, and a batch went out
        less than `HEARTBEAT_S` ago), and an empty outbox."""
        if not (self._states or self._incidents or self._clears
                or self._rejected != self._rejected_sent
                or time.monotonic() - self._last_batch >= HEARTBEAT_S):
            return None
        self._last_batch = time.monotonic()
        if self.upstream.identity.node_rank < 0:
            self._learn_node()
        index = {key: i for i, key in enumerate(self._states)}
        # A rank's steps came with a message of its sender, whose state is held too.
        ranks = {(s.sender.rank, s.sender.restart): index[key] for key, s in self._states.items()
                 if s.sender.rank is not None}
        # Each sender's steps together (in their order), a block each, as node 0 stores it.
        steps = sorted(((ranks[key], values) for key, values in self._steps),
                       key=operator.itemgetter(0))
        blocks = []
        for i, run in groupby(steps, key=operator.itemgetter(0)):
            rows = [values for _, values in run]
            try:
                block = step_block(rows)
            except ValueError:
                self.num_bad_steps += len(rows)
                continue
            if block is not None:
                blocks.append([i, *block[:-1], block[-1].decode()])
        if self.num_bad_steps:
            self._rejected[BAD_STEPS] = self.num_bad_steps
        batch = RelayBatch(
            senders=[(s.sender, s.counters()) for s in self._states.values()],
            step_blocks=blocks,
            flop_counts=[[index[key], *values] for key, values in self._flops],
            process=[(index[key], p) for key, p in self._process],
            system=[(index[key], p) for key, p in self._system],
            incidents=self._incidents, clears=self._clears, rejected=dict(self._rejected))
        self.num_steps += len(steps)
        self._rejected_sent = batch.rejected
        self._states, self._steps, self._flops, self._process, self._system = {}, [], [], [], []
        self._incidents, self._clears = [], []
        return batch


    def _learn_node(self) -> None:
        """The node's rank, as its ranks (their GROUP_RANK) or its system sampler say it."""
        for s in self._states.values():
            if s.sender.node_rank >= 0 and s.sender.role in ("rank", "system"):
                self.upstream.adopt_node(s.sender.node_rank)
                return


_NUM_IDENTITY = sum(f.identity for f in step_fields.STEP_FIELDS)


def open_outbox(config: CollectorConfig) -> Outbox:
    """The relay's outbox, connected to node 0's collector with the relays' key."""
    assert config.upstream is not None
    keys = derive_keys(config.secret or config.session_id, config.session_id)
    identity = Sender(role="relay", host=socket.gethostname(), pid=os.getpid(),
                      node_rank=config.node_rank)
    token = TokenBook(config.secret, config.session_id).node if config.secret else None
    return Outbox(Upstream(config.upstream, config.session_id, identity,
                           relay_keys(keys, config.secret, config.session_id), token))


def serve_relay(config: CollectorConfig) -> int:
    """Run the relay until its launcher stops it (or disappears)."""
    return serve(config, None, open_outbox)
