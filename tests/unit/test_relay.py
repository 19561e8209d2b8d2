"""A node's relay between its senders and node 0's collector, over real ZeroMQ
sockets on 127.0.0.1 with CURVE: what it forwards, in how many messages, and
what node 0 refuses."""

from __future__ import annotations

import socket
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import zmq

from tests.conftest import free_port
from tests.raw_wire import envelope_bytes
from traceml.collector import relay as relay_module
from traceml.collector.config import (
    RELAY_BATCHES_PER_S,
    RELAY_INTERVAL_S,
    CollectorConfig,
    relay_interval_s,
)
from traceml.collector.dispatch import Collector
from traceml.collector.rank_steps import RankSteps
from traceml.collector.relay import Outbox, open_outbox
from traceml.collector.server import BEHIND_COMMIT_S, Listener
from traceml.errors import ProtocolError
from traceml.launcher.nodes import RELAY_SILENT_S
from traceml.records import Incident
from traceml.security import derive_keys, relay_keys, secure_client
from traceml.store import SenderState, StoreWriter
from traceml.store.schema import BLOCK_SUMMED
from traceml.store.writer import SENDER_SAVE_S
from traceml.wire import events as ev
from traceml.wire.envelope import Envelope, Message, encode
from traceml.wire.events import EventBatch
from traceml.wire.identity import Sender
from traceml.wire.incidents import EXIT, RESUMED, STALL, IncidentReport
from traceml.wire.records import Bye, Hello
from traceml.wire.relay import BLOCK_COLUMNS, RelayBatch
from traceml.wire.rows import PROCESS_FIELDS, SYSTEM_FIELDS, ProcessRows, SystemRows

SESSION, SECRET = "relay-test", "a secret"
HOST = socket.gethostname()


def iteration(times: list[list[float]], t: float) -> None:
    """One training iteration's events as an agent logs them."""
    for code, at in ((ev.INPUT, t), (ev.END, t + 0.001),
                     (ev.FORWARD, t + 0.001), (ev.END, t + 0.02),
                     (ev.BACKWARD, t + 0.02), (ev.END, t + 0.06),
                     (ev.OPTIMIZER, t + 0.06), (ev.OPTIMIZER_END, t + 0.07)):
        times[code].append(at)


def events(batch: int, steps: range, close: bool = False) -> EventBatch:
    times: list[list[float]] = [[] for _ in range(ev.NUM_EVENT_CODES)]
    for i in steps:
        iteration(times, 0.1 * i)
    if close:
        times[ev.CLOSE].append(0.1 * steps.stop)
    return EventBatch(batch, 1.7e9, times)


def rank(r: int, node: int = 1) -> Sender:
    return Sender("rank", HOST, 20_000 + r, node, rank=r, local_rank=r % 8, world_size=16)


@dataclass
class Agent:
    """A sender's PUSH socket with the session's key."""

    sock: Any
    identity: Sender
    seq: int = 0

    def send(self, message: Message) -> None:
        self.sock.send(encode(Envelope(SESSION, self.identity, self.seq, time.time(), message)))
        self.seq += 1


class Nodes:
    """Node 0's collector over a real store, and node 1's relay, both polled here."""

    def __init__(self, tmp_path: Path, relay_node: int = 1) -> None:
        self.context = zmq.Context()
        self.db = str(tmp_path / "telemetry.sqlite")
        node0 = CollectorConfig(SESSION, "127.0.0.1", 0, self.db, 0, secret=SECRET)
        self.listener0 = Listener(self.context, node0)
        self.collector0 = Collector(node0, StoreWriter(self.db))
        relay = CollectorConfig(SESSION, "127.0.0.1", 0, "", 0, secret=SECRET, node_rank=relay_node,
                                upstream=f"tcp://127.0.0.1:{self.listener0.port}")
        self.relay_context = zmq.Context()
        self.listener1 = Listener(self.relay_context, relay)
        self.outbox = open_outbox(relay)
        self.relay = Collector(relay, self.outbox)
        self.keys = derive_keys(SECRET, SESSION)

    def agent(self, identity: Sender, port: int | None = None, keys: Any = None) -> Agent:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock, keys or self.keys)
        sock.connect(f"tcp://127.0.0.1:{port or self.listener1.port}")
        return Agent(sock, identity)

    def pump_until(self, done: Any, timeout_s: float = 10.0) -> None:
        """Poll the relay (and commit its batch) and node 0 until ``done()``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.listener1.poll(10, self.relay)
            self.relay.flush()
            self.listener0.poll(10, self.collector0)
            self.collector0.flush()
            if done():
                return
        raise AssertionError("not done before the deadline")

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        db = sqlite3.connect(self.db)
        try:
            return db.execute(sql).fetchall()
        finally:
            db.close()

    def close(self) -> None:
        self.outbox.close()
        self.listener1.close()
        self.listener0.close()
        self.collector0.close()
        self.context.destroy(0)
        self.relay_context.destroy(0)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    n = Nodes(tmp_path)
    yield n
    n.close()


def test_relay_forwards_steps_states_samples_and_incidents_in_few_messages(
        nodes: Nodes) -> None:
    agents = [nodes.agent(rank(r)) for r in (8, 9)]
    system = nodes.agent(Sender("system", HOST, 30_000, 1))
    tracker = RankSteps()  # rank 9's events replayed here, for where its crash is placed
    for a in agents:
        a.send(Hello(time.time()))
        for b in range(4):
            batch = events(b, range(5 * b, 5 * b + 5), close=b == 3)
            a.send(batch)
            if a.identity.rank == 9:
                tracker.feed_batch(batch)
        a.send(ProcessRows(PROCESS_FIELDS,
                           [(time.time(), 50.0, 1 << 28, 1 << 34, 2, None, None, None)]))
    system.send(SystemRows(SYSTEM_FIELDS, [(time.time(), 12.0, 30.0, 1 << 34, [])]))
    nodes.pump_until(lambda: nodes.rows("SELECT COUNT(*) FROM steps") == [(40,)])
    now = time.time()
    system.send(IncidentReport(
        EXIT, now, now, rank=9, pid=20_009, detail={"exit_code": 1}))
    nodes.pump_until(lambda: nodes.rows("SELECT COUNT(*) FROM incidents") == [(1,)])
    for a in (*agents, system):
        a.send(Bye(time.time()))
    nodes.pump_until(lambda: len(nodes.collector0.senders) == 4 and all(
        s.said_bye for s in nodes.collector0.senders.values() if s.sender.role != "relay"))
    steps = nodes.rows("SELECT rank, node_rank, COUNT(*) FROM steps GROUP BY rank")
    assert steps == [(8, 1, 20), (9, 1, 20)]  # 20 iterations each, the last ended by CLOSE
    senders = {r[0]: r[1:] for r in nodes.rows(
        "SELECT sender_id, role, node_rank, num_messages, said_bye FROM senders")}
    relay_id = nodes.outbox.upstream.identity.sender_id
    assert senders[relay_id][0] == "relay"
    assert senders[rank(8).sender_id] == ("rank", 1, 7, 1)  # hello, 4 events, process, bye
    assert senders[f"system@n1:{HOST}:30000:0"] == ("system", 1, 3, 1)
    # Node 0 got the node's 17 messages in fewer of the relay's (a batch per flush).
    assert senders[relay_id][2] < 17
    assert nodes.rows("SELECT node_rank, cpu_pct FROM system") == [(1, 12.0)]
    assert nodes.rows("SELECT rank, cpu_pct FROM process ORDER BY rank") == [(8, 50.0),
                                                                            (9, 50.0)]
    # The crash record is placed where the relay's step tracker stood.
    assert nodes.rows("SELECT what, rank, node_rank, step FROM incidents") == [
        ("exit", 9, 1, tracker.tracker.position()[0])]
    assert nodes.collector0.all_rejected() == {}


def test_a_stall_the_relay_placed_clears_on_node_0(nodes: Nodes) -> None:
    a = nodes.agent(rank(8))
    a.send(events(0, range(3)))  # steps 0 and 1 done, 2 open
    a.send(IncidentReport(
        STALL, 1.7e9, 1.7e9 + 5))
    nodes.pump_until(lambda: nodes.rows("SELECT COUNT(*) FROM incidents") == [(1,)])
    a.send(IncidentReport(
        RESUMED, 1.7e9, 1.7e9 + 9))
    nodes.pump_until(lambda: nodes.rows("SELECT cleared_at FROM incidents") == [(1.7e9 + 9,)])
    assert nodes.rows("SELECT what, step, phase FROM incidents") == [("stall", 2, None)]


def test_relay_rejections_are_counted_on_node_0(nodes: Nodes) -> None:
    stranger = nodes.agent(rank(8))
    stranger.sock.send(b"not a message")
    forged = nodes.agent(rank(9))
    forged.send(Hello(time.time()))
    forged.identity = Sender("rank", HOST, 1, 1, rank=9, local_rank=1, world_size=16)
    forged.send(Hello(time.time()))  # rank 9, another process
    nodes.pump_until(lambda: nodes.rows("SELECT reason, count FROM rejected ORDER BY reason") == [
        ("not an envelope of this protocol", 1), ("rank or node claimed by another sender", 1)])


def test_node_0_takes_relay_batches_from_the_relay_key_only(nodes: Nodes) -> None:
    batch = RelayBatch([], [], [], [], [], [], [], {})
    agent = nodes.agent(Sender("relay", HOST, 4, 1), port=nodes.listener0.port)
    agent.send(batch)
    relay_key = relay_keys(nodes.keys, SECRET, SESSION)
    relay = nodes.agent(Sender("relay", HOST, 5, 1), port=nodes.listener0.port, keys=relay_key)
    relay.send(batch)
    ours = nodes.outbox.upstream.identity.sender_id  # the relay under test said hello
    nodes.pump_until(lambda: len(nodes.collector0.senders) == 2)
    assert nodes.collector0.rejected == {"relay batch from a sender other than a relay": 1}
    assert set(nodes.collector0.senders) == {ours, relay.identity.sender_id}


def test_a_rank_that_spoke_to_node_0_cannot_be_relayed(nodes: Nodes) -> None:
    direct = nodes.agent(rank(8), port=nodes.listener0.port)
    direct.send(Hello(time.time()))
    nodes.pump_until(lambda: rank(8).sender_id in nodes.collector0.senders)
    relayed = nodes.agent(rank(8))
    relayed.identity = Sender("rank", HOST, 77, 1, rank=8, local_rank=0, world_size=16)
    relayed.send(events(0, range(3)))
    nodes.pump_until(lambda: nodes.collector0.rejected.get("relayed step of a refused sender"))
    assert nodes.collector0.rejected["rank or node claimed by another sender"] == 1
    assert nodes.rows("SELECT COUNT(*) FROM steps") == [(0,)]


def test_outbox_sends_a_heartbeat_when_nothing_came(nodes: Nodes) -> None:
    outbox: Outbox = nodes.outbox
    assert outbox.take() is None  # nothing new, and a batch went out less than 2 s ago
    nodes.pump_until(lambda: len(nodes.collector0.senders) == 1)  # the relay's hello
    outbox._last_batch -= 10  # as if the last batch left 10 s ago
    beat = outbox.take()
    assert beat is not None and beat.senders == [] and beat.step_blocks == []


ODD_VALUES: list[Any] = [None, True, -1, 2**63 - 1, 1e300, "x", [], {}, [[1]], {"a": 1}]


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        # every field of a step block (its header and rows); the first items elsewhere
        for i, v in enumerate(obj if prefix[:1] == ("blocks",) else obj[:4]):
            out += _paths(v, prefix + (i,))
    return out


def test_node_0_survives_mutated_relay_batches(nodes: Nodes, tmp_path: Path) -> None:
    """Every value of a genuine batch replaced by one of another type or range: node 0
    rejects or stores it, and never fails (nor its store)."""
    import random

    import orjson

    a = nodes.agent(rank(8))
    a.send(events(0, range(3)))
    a.send(IncidentReport(
        STALL, 1.7e9, 1.7e9 + 5))
    deadline = time.monotonic() + 10
    while not (nodes.outbox._incidents and nodes.outbox._steps) and time.monotonic() < deadline:
        nodes.listener1.poll(10, nodes.relay)  # not flushed: the batch stays in the outbox
    outbox_batch = nodes.outbox.take()
    assert outbox_batch is not None
    genuine = outbox_batch.payload()
    relay = Sender("relay", HOST, 6, 1)
    collector = nodes.collector0
    random.seed(19)
    for seq in range(400):
        payload = orjson.loads(orjson.dumps(genuine))
        path = random.choice(_paths(payload)[1:])
        parent = payload
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = random.choice(ODD_VALUES)
        collector.handle(envelope_bytes(SESSION, RelayBatch.KIND, relay, seq, payload),
                         from_relay=True)
    collector.flush()
    assert not collector.store_failed
    assert collector.rejected.get("bad relay payload", 0) > 100, collector.rejected


def test_a_c10d_relay_takes_its_node_rank_from_its_ranks(tmp_path: Path) -> None:
    nodes = Nodes(tmp_path, relay_node=-1)  # started before the rendezvous gave a node rank
    try:
        agent = nodes.agent(rank(8, node=3))  # kept: a closed socket drops what it holds
        agent.send(Hello(time.time()))
        nodes.pump_until(lambda: {s.sender.node_rank for s in nodes.collector0.senders.values()
                                  if s.sender.role == "relay"} == {-1, 3})
        relays = sorted((s.sender.node_rank, s.said_bye, s.num_gaps)
                        for s in nodes.collector0.senders.values() if s.sender.role == "relay")
        assert relays == [(-1, True, 0), (3, False, 0)]
    finally:
        nodes.close()


def test_a_relay_cannot_report_a_crash_of_another_nodes_rank(nodes: Nodes) -> None:
    """Node 1's launcher (through its relay) says rank 0 was SIGKILLed, but rank 0
    speaks to node 0 directly: refused and counted, and rank 0's ending untouched."""
    direct = nodes.agent(Sender("rank", HOST, 4242, 0, rank=0, local_rank=0, world_size=16),
                         port=nodes.listener0.port)
    direct.send(Hello(time.time()))
    nodes.pump_until(lambda: any(s.sender.rank == 0 for s in nodes.collector0.senders.values()))
    sampler = nodes.agent(Sender("system", HOST, 31337, 1))
    sampler.send(IncidentReport(
        EXIT, 1.7e9, 1.7e9 + 1, rank=0, pid=4242,
        detail={"exit_code": -9, "signal": "SIGKILL"}))
    own = nodes.agent(rank(8))  # and one about its own rank still arrives
    own.send(IncidentReport(
        STALL, 1.7e9, 1.7e9 + 5))
    nodes.pump_until(lambda: nodes.collector0.rejected.get("incident about a rank of another node"))
    nodes.pump_until(lambda: nodes.rows("SELECT what, rank FROM incidents") == [("stall", 8)])


def test_a_batch_node_0_did_not_take_gives_its_states_to_the_next(tmp_path: Path) -> None:
    """Node 0 unreachable: the batch times out and is dropped (counted), but the
    rank's goodbye and its crash go out with the next batch."""
    port = free_port()  # nothing listens on it
    config = CollectorConfig(SESSION, "127.0.0.1", 0, "", 0, secret=SECRET,
                             upstream=f"tcp://127.0.0.1:{port}", node_rank=1)
    outbox = open_outbox(config)
    try:
        who = rank(8)
        outbox.save_sender(SenderState(who, 1.7e9, 1.7e9 + 1, said_bye=True))
        outbox.add_incident(Incident("exit", 8, 1, HOST, who.pid, 1.7e9, 1.7e9 + 1,
                                     detail={"signal": "SIGKILL"}))
        while outbox.upstream.send(Hello(time.time())):
            pass  # queued for the connection until the high-water mark: then it waits, drops
        dropped = outbox.upstream.num_dropped
        outbox.commit()
        assert outbox.upstream.num_dropped == dropped + 1
        batch = outbox.take()
        assert batch is not None
        assert [(s.sender_id, values[-1]) for s, values in batch.senders] == [(who.sender_id, True)]
        assert len(batch.incidents) == 1
    finally:
        outbox.upstream.sock.close(0)
        outbox.upstream.context.term()


def test_node_0_under_a_flood_returns_to_commit_on_time(nodes: Nodes) -> None:
    # A poll handles what arrived for its budget at most, so a collector that cannot
    # keep up still commits what it took every interval, and nothing waiting in the
    # socket is lost.
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    secure_client(sock, nodes.keys)
    sock.connect(f"tcp://127.0.0.1:{nodes.listener0.port}")
    flood = Agent(sock, Sender("rank", HOST, 20_100, 0, rank=0, local_rank=0, world_size=16))
    num = 60  # under the receive high-water mark: all of them wait in the socket at once
    for _ in range(num):
        flood.send(ProcessRows(PROCESS_FIELDS,
                               [(time.time(), 50.0, 1 << 28, 1 << 34, 2, None, None, None)]))
    sock.close(linger=-1)
    context.term()  # returns once every message went out
    handled: list[int] = []
    deadline = time.monotonic() + 10
    def stored() -> int:
        return int(nodes.rows("SELECT COUNT(*) FROM process")[0][0])
    while stored() < num and time.monotonic() < deadline:
        n = nodes.listener0.poll(10, nodes.collector0, budget_s=0.0)
        handled += [n] if n else []
        nodes.collector0.flush()
    assert max(handled) == 1, handled  # a zero budget: one message a poll, then commit
    assert nodes.rows("SELECT COUNT(*) FROM process") == [(num,)], handled


def test_node_0_stores_a_known_senders_state_at_most_every_few_seconds(nodes: Nodes) -> None:
    """A wide job's ranks change state every second: node 0 stores a sender's first
    state and its goodbye at once, the others with its first flush SENDER_SAVE_S after
    the last such write (the launcher's silence watches wait 10 s); its memory is
    always current.  The clock of those writes is set by hand: no waiting."""
    agent = nodes.agent(rank(8))
    who = rank(8).sender_id

    def stored() -> list[tuple[Any, ...]]:
        return nodes.rows(f"SELECT num_messages, said_bye FROM senders WHERE sender_id = '{who}'")

    agent.send(Hello(time.time()))
    nodes.pump_until(lambda: stored() == [(1, 0)])
    nodes.collector0.store._states_saved_at = time.monotonic() + 3600  # just written
    agent.send(events(0, range(5)))
    nodes.pump_until(lambda: nodes.collector0.senders[who].num_messages == 2)
    nodes.collector0.flush()
    assert stored() == [(1, 0)]
    nodes.collector0.store._states_saved_at = time.monotonic() - SENDER_SAVE_S  # due
    nodes.collector0.flush()
    assert stored() == [(2, 0)]
    nodes.collector0.store._states_saved_at = time.monotonic() + 3600
    agent.send(Bye(time.time()))
    nodes.pump_until(lambda: stored() == [(3, 1)])


def test_a_relays_batch_interval_grows_with_the_nodes() -> None:
    """Node 0 takes at most RELAY_BATCHES_PER_S relay batches a second; a relay still
    sends at least every 4 s, well within the 10 s after which it counts as silent."""
    assert relay_interval_s(1) == relay_interval_s(RELAY_BATCHES_PER_S) == RELAY_INTERVAL_S
    assert relay_interval_s(1024) == 2.0
    assert relay_interval_s(2048) == 4.0
    # A relay's state is stored as node 0 handles its batch; node 0 behind commits
    # every BEHIND_COMMIT_S: the launcher reads it at least twice in its silence window.
    assert relay_interval_s(1 << 20) + BEHIND_COMMIT_S <= RELAY_SILENT_S / 2


def test_a_relay_holding_many_steps_sends_them_before_its_interval(
        nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay sends at once when it holds MAX_BATCH_STEPS step rows (a long relay
    interval and a fast loop would otherwise make a batch past node 0's message cap)."""
    monkeypatch.setattr(relay_module, "MAX_BATCH_STEPS", 3)
    agent = nodes.agent(rank(8))
    agent.send(events(0, range(5)))
    deadline = time.monotonic() + 10
    while nodes.collector0.num_steps < 4 and time.monotonic() < deadline:
        nodes.listener1.poll(10, nodes.relay)  # never flushed on its interval here
        nodes.listener0.poll(10, nodes.collector0)
    assert nodes.collector0.num_steps >= 4


class _NotSent:
    """An outbox's upstream of which only the identity is read (`Outbox.take`)."""

    def __init__(self) -> None:
        self.identity = Sender("relay", HOST, 3, 1)


def test_the_relay_makes_each_ranks_block_and_counts_a_run_none_can_hold() -> None:
    """The relay sends each rank's steps as the block node 0 stores (grouped, summed,
    encoded on the relay's node); a rank's run that no block can hold (a step index
    that is not one) is left out and counted as node 0 would count it."""
    from tests.rows import step_record

    outbox = Outbox(_NotSent())  # type: ignore[arg-type]
    good, bad = rank(8), rank(9)
    outbox.add_steps([step_record(s, rank=8, total_ms=10.0, input_ms=2.0) for s in range(3)])
    outbox.add_steps([step_record(s, rank=9, total_ms=10.0) for s in (-1, -2)])
    for who in (good, bad):
        outbox.save_sender(SenderState(who, 1.7e9, 1.7e9))
    batch = outbox.take()
    assert batch is not None
    decoded = RelayBatch.from_payload(orjson.loads(orjson.dumps(batch.payload())))
    index = [s.sender_id for s, _ in decoded.senders].index(good.sender_id)
    [block] = decoded.step_blocks
    assert block[:4] == [index, 0, 2, 3] and type(block[-1]) is str
    step = BLOCK_COLUMNS.index("step")
    assert [r[step] for r in orjson.loads(block[-1])] == [0, 1, 2]
    assert block[4 + BLOCK_SUMMED.index("input_ms")] == 6.0
    assert decoded.rejected == {relay_module.BAD_STEPS: 2}


def test_node_0_refuses_blocks_in_another_versions_columns_or_two_of_one_sender() -> None:
    """A relay of another traceml version lays its rows out in other columns: node 0
    refuses its batch rather than store rows it would read wrong; so it does a batch
    with two blocks of one sender (a relay makes one)."""
    outbox = Outbox(_NotSent())  # type: ignore[arg-type]
    from tests.rows import step_record

    outbox.add_steps([step_record(0, rank=8)])
    outbox.save_sender(SenderState(rank(8), 1.7e9, 1.7e9))
    batch = outbox.take()
    assert batch is not None
    payload = orjson.loads(orjson.dumps(batch.payload()))
    RelayBatch.from_payload(payload)
    twice = dict(payload, blocks=payload["blocks"] * 2)  # a relay makes one block a sender
    with pytest.raises(ProtocolError, match="two relayed step blocks of one sender"):
        RelayBatch.from_payload(twice)
    payload["block_columns"] = payload["block_columns"][:-1]
    with pytest.raises(ProtocolError, match="another version"):
        RelayBatch.from_payload(payload)
