"""The collector against strangers and forgeries: a real collector process, on
127.0.0.1 (one node) and beyond it (127.0.0.2, inside the loopback range),
CURVE on both; rogue senders with no key, the wrong key, garbage bytes or a
100 MB frame; and an authenticated sender forging control messages, another
rank's steps, replays and every kind of malformed value."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import zmq

from tests.conftest import wait_until
from tests.raw_wire import empty_times, envelope_bytes
from traceml.collector.config import CollectorConfig
from traceml.launcher.collector_process import CollectorProcess
from traceml.report.session import write_summary
from traceml.security import CurveKeys, derive_keys, new_secret, secure_client
from traceml.wire import events as ev
from traceml.wire.identity import Sender
from traceml.wire.incidents import IncidentReport
from traceml.wire.records import Bye, RunEnd, RunStart, StopCollector

_ITERATION = ((ev.INPUT, 0.0), (ev.END, 1.0), (ev.FORWARD, 1.0),
              (ev.END, 2.0), (ev.BACKWARD, 2.0), (ev.END, 3.0),
              (ev.OPTIMIZER, 3.0), (ev.OPTIMIZER_END, 4.0))
RANK0 = Sender("rank", "genuine", 101, 0, rank=0, local_rank=0, world_size=2)
T0 = 1_767_225_600.0


def _events(rows: int, start: float = 0.0, batch: int = 0) -> dict[str, Any]:
    """``rows`` whole training steps, closed at the end."""
    times = empty_times()
    for i in range(rows):
        for code, dt in _ITERATION:
            times[code].append(start + 10.0 * i + dt)
    times[ev.CLOSE].append(start + 10.0 * rows)
    return ev.EventBatch(batch, T0, times).payload()


def _envelope(session: str, seq: int, rows: int = 1, sender: Sender = RANK0,
              kind: str = ev.EventBatch.KIND, payload: dict[str, Any] | None = None) -> bytes:
    return envelope_bytes(session, kind, sender, seq,
                          _events(rows) if payload is None else payload)


def _rows(db_path: Path, sql: str) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return list(db.execute(sql))
    except sqlite3.OperationalError:  # polled before the collector made its tables
        return []
    finally:
        db.close()


def _rejected(db_path: Path) -> dict[str, int]:
    return dict(_rows(db_path, "SELECT reason, count FROM rejected"))


class Pushes:
    """PUSH sockets to one collector, closed together."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.context = zmq.Context()
        self.socks: list[zmq.Socket[bytes]] = []

    def open(self, keys: CurveKeys | None) -> zmq.Socket[bytes]:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            secure_client(sock, keys)
        sock.connect(self.address)
        self.socks.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.context.term()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[CollectorProcess, Pushes, Path]]:
    """A one-node collector as ``traceml run`` starts it, with a per-run secret."""
    db = tmp_path / "telemetry.sqlite"
    collector = CollectorProcess(CollectorConfig(
        session_id="safe", bind_host="127.0.0.1", port=0, db_path=str(db),
        parent_pid=os.getpid(), secret=new_secret()))
    pushes = Pushes(f"tcp://127.0.0.1:{collector.port}")
    try:
        yield collector, pushes, db
    finally:
        pushes.close()
        collector.stop()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_strangers_are_counted_and_dropped(tmp_path: Path, host: str) -> None:
    db = tmp_path / "telemetry.sqlite"
    collector = CollectorProcess(CollectorConfig(
        session_id="safe", bind_host=host, port=0, db_path=str(db), parent_pid=os.getpid(),
        secret="the secret"))
    pushes = Pushes(f"tcp://{host}:{collector.port}")
    try:
        # The session id alone (the old default) admits no one either.
        plain, wrong, by_id = (pushes.open(None), pushes.open(derive_keys("guessed", "safe")),
                               pushes.open(derive_keys("safe", "safe")))
        for i in range(3):
            for sock in (plain, wrong, by_id):
                try:
                    sock.send(_envelope("safe", i), zmq.NOBLOCK)
                except zmq.Again:
                    pass
        with socket.create_connection((host, collector.port)) as raw:
            raw.sendall(os.urandom(4096))
        keys = derive_keys("the secret", "safe")
        pushes.open(keys).send(b"x" * (100 * 1024 * 1024))  # over 8 MiB: connection dropped
        pushes.open(keys).send(_envelope("safe", 0, rows=5))
        pushes.open(keys).send(_envelope("other-session", 0))
        assert wait_until(lambda: _rows(db, "SELECT COUNT(*) FROM steps") == [(5,)]), \
            "the legitimate sender's steps never arrived"
        assert collector.alive()
        assert wait_until(lambda: _rejected(db).get(
            "failed handshake (no or wrong session key)", 0) >= 3)
        assert wait_until(lambda: _rejected(db).get("foreign session", 0) == 1)
    finally:
        pushes.close()
        collector.stop()
    assert _rows(db, "SELECT COUNT(*) FROM steps") == [(5,)]
    assert _rows(db, "SELECT host FROM senders") == [("genuine",)]


def _forgeries(good: bytes) -> dict[str, list[bytes]]:
    """Messages an authenticated sender could forge, by the reason each must be
    rejected for."""
    stranger = Sender("rank", "rogue", 666, 0, rank=0, world_size=2)
    run_start = RunStart(
        session_id="safe", command=("\x1b[2Jevil",), started_at=T0, traceml_version="",
        torch_version="", python_version="", summary_window_rows=0, mode="run",
        expected_world_size=64).payload()
    env = orjson.loads(good)

    def edited(**changes: Any) -> bytes:
        return orjson.dumps({**env, **changes})

    big_world = ["rank", "genuine", 102, 0, 1, 1, 10**12, 0]
    bad_events = [{**env["p"], "times": [["abc"]]}, {**env["p"], "wall_offset": "x"},
                  {**env["p"], "times": [[1e300, -1e300]] * 5},
                  {**env["p"], "marks": [[1.0, [None] * 99]]}, {**env["p"], "batch": -1}]
    return {
        "control message from a sender other than the launcher": [
            _envelope("safe", 0, kind=StopCollector.KIND, payload={"op": "stop"},
                      sender=Sender("launcher", "rogue", 1, 0)),
            _envelope("safe", 1, kind=StopCollector.KIND, payload=run_start,
                      sender=Sender("launcher", "rogue", 1, 0))],
        "rank or node claimed by another sender": [_envelope("safe", 0, 50, sender=stranger)],
        "replayed or duplicate message": [good],
        "malformed envelope": [edited(**{"from": big_world}), edited(seq="1"),
                               edited(**{"from": ["rank", "\x1b[31m", 1, 0, 1, 1, 2, 0]}),
                               good.replace(b'"at":', b'"at":NaN,"x":'),
                               good[:-1] + b',"deep":' + b"[" * 5000 + b"]" * 5000 + b"}",
                               edited(seq=300, kind="nope")],
        "bad events payload": [edited(seq=100 + i, p=p) for i, p in enumerate(bad_events)],
        "bad process payload": [edited(seq=200, kind="process", p={
            "fields": ["t", "cpu_pct"], "rows": [[T0, "abc"]]})],
        "bad system payload": [edited(seq=201, kind="system", p={
            "fields": ["t", "gpus"], "rows": [[T0, [["x"]]]]})],
    }


def test_forged_messages_change_nothing_in_the_summary(
        live: tuple[CollectorProcess, Pushes, Path], tmp_path: Path) -> None:
    collector, pushes, db = live
    collector.record(RunStart(
        session_id="safe", command=("train.py",), started_at=T0, traceml_version="t",
        torch_version="t", python_version="p", summary_window_rows=0, mode="run",
        expected_world_size=2))
    sock = pushes.open(collector.keys)
    good = _envelope("safe", 0, rows=5)
    sock.send(good)
    assert wait_until(lambda: _rows(db, "SELECT COUNT(*) FROM steps") == [(5,)])
    forged = _forgeries(good)
    for messages in forged.values():
        for message in messages:
            sock.send(message)
    sock.send(_envelope("safe", 1, kind=Bye.KIND, payload={"t": T0}))
    expected = {reason: len(m) for reason, m in forged.items() if m}
    assert wait_until(lambda: all(_rejected(db).get(r, 0) == n for r, n in expected.items())), \
        (_rejected(db), expected)
    assert collector.alive()  # the forged stop did not stop it
    collector.record(RunEnd(ended_at=T0 + 60, exit_code=0))
    assert collector.stop() == 0
    files = write_summary(tmp_path)
    meta = files.summary["meta"]
    assert (meta["world_size"], meta["exit_code"], meta["command"]) == (2, 0, ["train.py"])
    assert [(s.rank, s.step) for s in files.run.steps] == [(0, i) for i in range(5)]
    assert sum(r.total_ms for r in files.run.steps) == 4 * 10_000.0 + 4000.0
    assert meta["rejected"] == {r: n for r, n in expected.items()}
    line = next(ln for ln in files.text.splitlines() if "Rejected:" in ln)
    assert f"Rejected: {sum(expected.values())} (" in line
    assert "\x1b" not in files.text


def test_join_port_is_curve_and_leaks_nothing(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.sqlite"
    port = _free_port_pair()
    collector = CollectorProcess(CollectorConfig(
        session_id="node0-secret-id", bind_host="127.0.0.2", port=port, db_path=str(db),
        parent_pid=os.getpid(), secret="s", join_port=port + 1,
        expected={"nnodes": "2", "nproc_per_node": "1"}))
    context = zmq.Context()

    def ask(request: bytes, keys: CurveKeys | None) -> dict[str, Any] | None:
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            secure_client(sock, keys)
        sock.connect(f"tcp://127.0.0.2:{port + 1}")
        try:
            sock.send(request)
            reply: dict[str, Any] | None = orjson.loads(sock.recv()) if sock.poll(2000) else None
            return reply
        finally:
            sock.close(0)

    try:
        request = orjson.dumps({"session_id": "guess", "host": "\x1b[31mred",
                                "options": {"nnodes": "2", "nproc_per_node": "\x1b[0m"}})
        assert ask(request, None) is None  # plain text gets no answer at all
        keys = derive_keys("s", "node0-secret-id")
        reply = ask(request, keys)
        assert reply is not None and reply["ok"] is False
        assert "node0-secret-id" not in reply["error"] and "\x1b" not in reply["error"]
        assert "another --session-id" in reply["error"]
        mismatch = orjson.dumps({"session_id": "node0-secret-id", "host": "\x1b[31mred",
                                 "options": {"nnodes": "2", "nproc_per_node": "\x1b[0m"}})
        for _ in range(80):
            reply = ask(mismatch, keys)
        assert reply is not None and "\x1b" not in reply["error"] and "--nproc-per-node" in \
            reply["error"]
        match = orjson.dumps({"session_id": "node0-secret-id", "host": "n1",
                              "options": {"nnodes": "2", "nproc_per_node": "1"}})
        assert ask(match, keys) == {"ok": True, "error": ""}
        deep = (b'{"session_id": "node0-secret-id", "host": ' + b"[" * 1000 + b"]" * 1000
                + b', "options": {}}')  # too deep to show: answered, the collector stays
        assert ask(deep, keys) == {"ok": False, "error": "malformed join request"}
        # Clock exchanges (traceml.clocks): node 0 stamps arrival and answer; a
        # burst's best is stored; what a launcher does not send is refused and counted.
        before = time.time()
        answer = ask(orjson.dumps({"clock": {"who": ["n1", 42], "best": None}}), keys)
        assert answer is not None and answer["ok"] is True
        assert before <= answer["t2"] <= answer["t3"] <= time.time()
        best = [before - 0.002, before, before + 0.0001, before + 0.0002]
        assert ask(orjson.dumps({"clock": {"who": ["n1", 42], "best": best}}), keys)["ok"]  # type: ignore[index]
        for bad in ({"who": ["n1"], "best": None}, {"who": ["", 1], "best": None},
                    {"who": ["n1", -1], "best": None}, {"who": ["n1", 4], "best": [1, 2, 3]},
                    {"who": ["n1", 4], "best": ["1", 2, 3, 4]}, {"who": ["n1", 4], "best": 7},
                    {"who": ["n1", 4], "best": [1, 2, 3, 1e300]}, [1, 2], {},
                    {"best": None}, {"who": ["n1", 2**63], "best": best}):
            answer = ask(orjson.dumps({"clock": bad}), keys)
            assert answer == {"ok": False, "error": "malformed clock exchange"}, bad
    finally:
        context.destroy(0)
        collector.stop()
    stored = _rows(db, "SELECT COUNT(*) FROM meta WHERE key LIKE 'join_error/%'")[0][0]
    assert stored == 64  # bounded: the other 17 are only counted
    assert _rejected(db)["node with mismatching options"] == 82
    assert _rejected(db)["malformed clock exchange"] == 11
    assert _rows(db, "SELECT host, pid, t1, t2, t3, t4 FROM clock_exchanges") == [("n1", 42, *best)]


def _free_port_pair() -> int:
    """A port whose next port is free too, on 127.0.0.2."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.2", 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.2", port + 1))
                except OSError:
                    continue
        return port
    raise AssertionError("no free port pair")


def test_an_insider_cannot_grow_the_world_nor_fail_a_successful_run(
        live: tuple[CollectorProcess, Pushes, Path], tmp_path: Path) -> None:
    """A holder of the session's key (a rank's child, say) claims ranks past what the
    launcher starts, or reports a crash of a run that exits 0: the claims are refused and
    counted, and the launcher's exit status decides the ending."""
    collector, pushes, db = live
    collector.record(RunStart(
        session_id="safe", command=("train.py",), started_at=T0, traceml_version="t",
        torch_version="t", python_version="p", summary_window_rows=0, mode="run",
        expected_world_size=2, max_world_size=2))
    sock = pushes.open(collector.keys)
    sock.send(_envelope("safe", 0, rows=5))
    assert wait_until(lambda: _rows(db, "SELECT COUNT(*) FROM steps") == [(5,)])
    huge = Sender("rank", "genuine", 102, 0, rank=1, local_rank=1, world_size=4096)
    beyond = Sender("rank", "genuine", 103, 0, rank=7, local_rank=7, world_size=8)
    for sender in (huge, beyond):
        sock.send(_envelope("safe", 0, rows=3, sender=sender))
    sock.send(_envelope("safe", 1, kind=IncidentReport.KIND, payload=IncidentReport(
        "exception", T0 + 30, T0 + 30, detail={"type": "RuntimeError",
                                               "message": "forged"}).payload()))
    sock.send(_envelope("safe", 2, kind=Bye.KIND, payload={"t": T0}))
    reason = "rank or world size beyond what the launcher starts"
    assert wait_until(lambda: _rejected(db).get(reason, 0) == 2), _rejected(db)
    assert wait_until(lambda: _rows(db, "SELECT COUNT(*) FROM incidents") == [(1,)])
    collector.record(RunEnd(ended_at=T0 + 60, exit_code=0))
    assert collector.stop() == 0
    files = write_summary(tmp_path)
    assert files.summary["meta"]["world_size"] == 2
    assert files.summary["ending"]["state"] == "completed"
    assert files.summary["primary"]["label"] != "CRASHED"
    assert "CRASH NOT CONFIRMED" in files.text
    assert len(files.text) < 20_000


def test_a_ranks_child_cannot_speak_as_rank_0(tmp_path: Path) -> None:
    """Rank 1's child asks the launcher's key service for a token (refused: it is not a
    worker the launcher started, and its worker was answered already), then sends rank 0's
    identity with forged steps, with its parent's token and without one: every message
    refused and counted, rank 0's stored steps exactly the ones it ran."""
    from tests.conftest import run_traceml, script

    result = run_traceml(tmp_path, "run", "--nproc-per-node=2", script("forging_child.py"), "30")
    assert result.returncode == 0, result.stderr[-3000:]
    forger = json.loads((result.evidence_dir / "forger.json").read_text())
    assert forger == {"asked": None, "sent": 3, "had_parent_token": True}
    ran = {r: e["steps"] for r, e in result.evidence().items()}
    assert ran == {0: 30, 1: 30}
    assert {r: len(result.steps_of(r)) for r in (0, 1)} == ran  # the forged 50 are not there
    assert result.summary is not None
    assert result.summary["meta"]["rejected"] == {"sender without the token of its identity": 3}
    assert "refuses its telemetry" not in result.stderr  # the real ranks had their tokens
