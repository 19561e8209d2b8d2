"""Several nodes on one machine: two launchers over loopback act as two nodes
(static and c10d rendezvous), node 1's telemetry through its relay; node loss, a
relay's loss; mismatching options; watch."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests import trace_events
from tests.conftest import read_store, read_summary, script, wait_until


def free_ports() -> tuple[int, int]:
    """A rendezvous port and a collector port, distinct and free on every address,
    with the collector's next port free too (node 0's join check takes it)."""
    held: list[socket.socket] = []

    def bind(port: int) -> int:
        sock = socket.socket()
        held.append(sock)
        sock.bind(("", port))
        return int(sock.getsockname()[1])

    try:
        for _ in range(50):
            rendezvous, collector = bind(0), bind(0)
            try:
                bind(collector + 1)
            except OSError:
                continue
            return rendezvous, collector
    finally:
        for sock in held:
            sock.close()
    raise AssertionError("no free ports")


class Nodes:
    """Launch `traceml run` once per node with shared options."""

    def __init__(self, tmp_path: Path, session: str, common: list[str],
                 env: dict[str, str] | None = None) -> None:
        self.tmp_path, self.session, self.common = tmp_path, session, common
        self.evidence = tmp_path / "evidence"
        self.evidence.mkdir(exist_ok=True)
        # Several nodes share a session secret (without one each launcher refuses).
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "EVIDENCE_DIR": str(self.evidence),
                    "TRACEML_SECRET": "nodes test secret", **(env or {})}
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *extra: str, command: str = "run",
              env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "traceml", command, "--logs-dir",
               str(self.tmp_path / "logs"), "--session-id", self.session, *self.common, *extra]
        proc = subprocess.Popen(cmd, env={**self.env, **(env or {})}, cwd=self.tmp_path, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def finish(self, timeout: float = 180) -> list[tuple[int, str, str]]:
        out = []
        for proc in self.procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            out.append((proc.returncode, stdout, stderr))
        return out

    @property
    def session_dir(self) -> Path:
        return self.tmp_path / "logs" / self.session

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc.pid)


def kill_tree(pid: int) -> None:
    import psutil

    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _system_nodes(session_dir: Path) -> set[int]:
    import sqlite3

    db = sqlite3.connect(f"file:{session_dir / 'telemetry.sqlite'}?mode=ro", uri=True)
    try:
        return {r[0] for r in db.execute("SELECT DISTINCT node_rank FROM system")}
    finally:
        db.close()


def _assert_all_ranks(nodes: Nodes, world: int) -> dict[str, Any]:
    summary = read_summary(nodes.session_dir)
    assert summary is not None
    assert summary["meta"]["world_size"] == world and summary["meta"]["missing_ranks"] == []
    assert sorted(summary["step_time"]["scope"]["ranks"]) == list(range(world))
    assert {n["node_rank"] for n in summary["meta"]["nodes"]} == {0, 1}
    evidence = [p.read_text() for p in nodes.evidence.glob("rank*.json")]
    assert len(evidence) == world and all(
        f'"allreduce": {world * (world + 1) / 2}' in e for e in evidence)
    assert _system_nodes(nodes.session_dir) == {0, 1}  # node 1's system samples arrived
    _assert_relayed(nodes, world)
    return summary


def _assert_relayed(nodes: Nodes, world: int) -> None:
    """Node 1's steps came through its relay: the relay spoke to node 0 (and said
    goodbye) in fewer messages than node 1's ranks sent it, and node 0 refused
    nothing (a rank of node 1 speaking to node 0 itself would be refused there)."""
    steps, senders = read_store(nodes.session_dir / "telemetry.sqlite")
    relays = [s for s in senders if s["role"] == "relay"]
    # c10d: the relay starts before the rendezvous, then speaks as its node's relay.
    (relay,) = [s for s in relays if s["node_rank"] >= 0]
    relayed = [s for s in senders if s["role"] == "rank" and s["node_rank"] == relay["node_rank"]]
    assert all(r["said_bye"] == 1 and r["num_gaps"] == 0 and r["num_dropped"] == 0
               for r in relays)
    assert len(relayed) == world // 2 and all(s["said_bye"] for s in relayed)
    assert {st["rank"] for st in steps} == set(range(world))
    assert 2 <= relay["num_messages"] < sum(s["num_messages"] for s in relayed) + 2


@pytest.mark.parametrize("nproc", [1, 2])
def test_two_nodes_static(tmp_path: Path, nproc: int) -> None:
    master, port = free_ports()
    common = ["--nnodes=2", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
              f"--master-port={master}", f"--aggregator-port={port}",
              "--aggregator-bind-host=127.0.0.1"]
    nodes = Nodes(tmp_path, "st", common)
    nodes.start("--node-rank=0", script("allreduce.py"))
    nodes.start("--node-rank=1", script("allreduce.py"))
    results = nodes.finish()
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    _assert_all_ranks(nodes, 2 * nproc)
    assert "TraceML Run Summary" in results[0][1]
    assert "node 0 writes the summary" in results[1][2]


def test_node_1s_clock_is_measured_against_node_0s(tmp_path: Path) -> None:
    """Node 1's clock set 250 ms ahead (the test-only skew: its launcher's exchanges and
    its rank's step times): the summary states its offset within 1 ms, and the ranks'
    step starts, which DDP's all-reduce holds together, agree once it is taken off."""
    master, port = free_ports()
    common = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1",
              f"--master-port={master}", f"--aggregator-port={port}",
              "--aggregator-bind-host=127.0.0.1"]
    nodes = Nodes(tmp_path, "clk", common)
    nodes.start("--node-rank=0", script("allreduce.py"), "40")
    nodes.start("--node-rank=1", script("allreduce.py"), "40",
                env={"TRACEML_TEST_CLOCK_SKEW_S": "0.25"})
    results = nodes.finish()
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    summary = read_summary(nodes.session_dir)
    assert summary is not None
    clocks = {n["node_rank"]: n["clock"] for n in summary["meta"]["nodes"]}
    assert clocks[0]["offset_ms"] == 0.0 and clocks[0]["num_bursts"] == 0  # the reference
    clock = clocks[1]
    assert clock is not None and clock["num_bursts"] >= 1
    assert abs(clock["offset_ms"] - 250.0) <= min(1.0, clock["uncertainty_ms"] + 0.01)
    assert "Clocks against node 0's: node 1 +2" in results[0][1]
    steps, _ = read_store(nodes.session_dir / "telemetry.sqlite")
    begins = {(r["rank"], r["step"]): r["t_begin"] for r in steps}
    apart = sorted(begins[1, s] - begins[0, s] for s in range(5, 40))
    assert abs(apart[len(apart) // 2] - 0.25) < 0.02  # as stored: node 1's clock
    assert abs(apart[len(apart) // 2] - clock["offset_ms"] / 1e3) < 0.01  # aligned
    # The ranks reach each step's all-reduce together: on node 0's clock, not 250 ms apart
    arrival = summary["step_time"]["arrival"]
    assert arrival is not None and arrival["num_steps"] >= 30
    assert arrival["median_ms"] < 20.0
    # The offset's uncertainty, widened by an unknown drift (50 ppm) over the seconds between
    # the measurement and the steps: a short run adds a fraction of a millisecond.
    assert clock["uncertainty_ms"] <= arrival["uncertainty_ms"] <= clock["uncertainty_ms"] + 2.0
    # The exported timeline is on node 0's clock too: the two ranks' steps side by side.
    out = tmp_path / "timeline.json.gz"
    done = subprocess.run([sys.executable, "-m", "traceml", "export", str(nodes.session_dir),
                           "--perfetto", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "not measured" not in done.stderr, done.stderr
    document = trace_events.load(out)
    trace_events.check(document["traceEvents"])
    assert document["otherData"]["clocks"]["1"]["offset_ms"] == clock["offset_ms"]
    starts = {(e["args"]["rank"], e["args"]["step"]): e["ts"] for e in document["traceEvents"]
              if e.get("cat") == "step"}
    apart_us = sorted(starts[1, s] - starts[0, s] for s in range(5, 40))
    assert abs(apart_us[len(apart_us) // 2]) < 5_000  # µs: not 250 ms


def test_two_nodes_c10d_with_curve(tmp_path: Path) -> None:
    # Bound beyond 127.0.0.1, every sender must speak CURVE with the session secret.
    rendezvous, port = free_ports()
    common = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{rendezvous}", f"--aggregator-port={port}",
              "--aggregator-bind-host=127.0.0.2", "--aggregator-host=127.0.0.2"]
    nodes = Nodes(tmp_path, "c1", common, env={"TRACEML_SECRET": "correct horse"})
    nodes.start(script("allreduce.py"))
    # The first launcher takes the collector port.
    assert wait_until((nodes.session_dir / "telemetry.sqlite").exists, 60)
    nodes.start(script("allreduce.py"))
    results = nodes.finish()
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    summary = _assert_all_ranks(nodes, 4)
    assert summary["meta"]["transport"]["rejected"] == 0


def _two_nodes_training(tmp_path: Path, session: str, steps: str) -> Nodes:
    """Two one-rank nodes (static), started and polled until both stored steps."""
    master, port = free_ports()
    common = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1",
              f"--master-port={master}", f"--aggregator-port={port}",
              "--aggregator-bind-host=127.0.0.1"]
    nodes = Nodes(tmp_path, session, common)
    for node in (0, 1):
        nodes.start(f"--node-rank={node}", script("allreduce.py"), steps, "0.02")
    store = nodes.session_dir / "telemetry.sqlite"
    if not wait_until(lambda: store.exists() and {s["rank"] for s in read_store(store)[0]} == {0, 1},
                      90, 0.1):
        nodes.kill_all()
        raise AssertionError("both nodes never stored steps")
    return nodes


def test_node_lost_mid_run(tmp_path: Path) -> None:
    nodes = _two_nodes_training(tmp_path, "lost", "400")
    node0, node1 = nodes.procs
    kill_tree(node1.pid)  # the whole node goes away: launcher, workers, sampler
    # Rank 0 now hangs in gloo until torch's 30-minute timeout; node 0 must not.
    summary_path = nodes.session_dir / "final_summary.json"
    found = wait_until(summary_path.exists, 60, 0.2)
    nodes.kill_all()
    _, err = node0.communicate(timeout=60)
    node1.wait()
    assert found, err[-3000:]
    summary = read_summary(nodes.session_dir)
    assert summary is not None and summary["meta"]["partial"] is True
    assert summary["meta"]["missing_ranks"] == [1]
    # Either node 0 noticed the silence, or its rank failed and the run ended:
    # both say which node is gone.
    assert "node 1" in err, err[-3000:]


def test_relay_killed_mid_run_is_a_lost_node(tmp_path: Path) -> None:
    import psutil

    nodes = _two_nodes_training(tmp_path, "relay-lost", "500")
    (relay,) = [p for p in psutil.Process(nodes.procs[1].pid).children()
                if "traceml.collector" in p.cmdline()]
    os.kill(relay.pid, signal.SIGKILL)  # the relay alone: node 1's ranks train on
    try:
        (code0, out0, err0), (code1, _, err1) = nodes.finish(timeout=120)
    finally:
        nodes.kill_all()
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
    assert "relay to node 0 died" in err1, err1[-2000:]
    assert "no goodbye from node 1" in err0 and "its relay stopped" in err0, err0[-3000:]
    summary = read_summary(nodes.session_dir)
    assert summary is not None and summary["meta"]["partial"] is True
    assert summary["meta"]["missing_ranks"] == [1]
    assert "TraceML Run Summary" in out0


def test_mismatching_node_is_reported_not_hung(tmp_path: Path) -> None:
    master, port = free_ports()
    common = ["--nnodes=2", "--master-addr=127.0.0.1", f"--master-port={master}",
              f"--aggregator-port={port}", "--aggregator-bind-host=127.0.0.1"]
    nodes = Nodes(tmp_path, "mm", common)
    node0 = nodes.start("--node-rank=0", "--nproc-per-node=1", script("allreduce.py"))
    node1 = nodes.start("--node-rank=1", "--nproc-per-node=2", script("allreduce.py"))
    try:
        _, err1 = node1.communicate(timeout=90)
        assert node1.returncode == 2
        lines = [ln for ln in err1.splitlines() if ln.startswith("traceml:")]
        assert len(lines) == 1 and "--nproc-per-node" in lines[0], err1
    finally:
        nodes.kill_all()
        node0.communicate(timeout=60)


def test_node_of_another_session_is_refused_without_learning_node_0s_id(
        tmp_path: Path) -> None:
    # Its key derives from its own session id: node 0's join port refuses the
    # handshake, and the node says so in one line instead of hanging.
    master, port = free_ports()
    common = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1",
              f"--master-port={master}", f"--aggregator-port={port}",
              "--aggregator-bind-host=127.0.0.1"]
    node0 = Nodes(tmp_path, "secret-id-of-node-0", common)
    stranger = Nodes(tmp_path, "other", common)
    node0.start("--node-rank=0", script("allreduce.py"))
    node1 = stranger.start("--node-rank=1", script("allreduce.py"))
    try:
        _, err1 = node1.communicate(timeout=90)
        assert node1.returncode == 2, err1
        lines = [ln for ln in err1.splitlines() if ln.startswith("traceml:")]
        assert len(lines) == 1 and "refused this node's key" in lines[0], err1
        assert "secret-id-of-node-0" not in err1
    finally:
        node0.kill_all()
        stranger.kill_all()
        node0.finish(timeout=60)


def test_watch_reports_system_and_process_only(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text(
        "import time\nx = [0] * 10**6\nt = time.time()\nwhile time.time() - t < 2.5:\n"
        "    pass\nprint('done')\n")
    for name, target in (("torch", script("loop.py")), ("plain", str(tmp_path / "plain.py"))):
        nodes = Nodes(tmp_path, f"w-{name}", ["--nproc-per-node=2", "--sample-interval=0.25"])
        nodes.start(target, command="watch")
        ((code, out, err),) = nodes.finish()
        assert code == 0, err[-2000:]
        summary = read_summary(nodes.session_dir)
        assert summary is not None
        assert summary["step_time"]["diagnosis"]["label"] == "STEP TIME NOT MEASURED"
        assert summary["process"]["scope"]["ranks"] == [0, 1], summary["process"]["scope"]
        assert summary["system"]["diagnosis"]["kind"] != "NOT_MEASURED"
        steps, senders = read_store(nodes.session_dir / "telemetry.sqlite")
        assert steps == []  # nothing was injected


def test_node_that_never_comes_is_named_within_the_join_timeout(tmp_path: Path) -> None:
    rendezvous, port = free_ports()
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{rendezvous}", "--rdzv-conf=join_timeout=5",
              f"--aggregator-port={port}", "--aggregator-bind-host=127.0.0.1"]
    nodes = Nodes(tmp_path, "alone", common)
    start = time.monotonic()
    nodes.start(script("allreduce.py"))
    ((code, out, err),) = nodes.finish(timeout=120)
    assert code == 1
    assert time.monotonic() - start < 60  # torch's join timeout, not 10-15 minutes
    assert "Traceback" not in err
    assert "rendezvous failed" in err and "never joined" in err
    summary = read_summary(nodes.session_dir)
    assert summary is not None and summary["meta"]["partial"] is True
    assert summary["meta"]["missing_ranks"] == [0, 1]
    assert "TraceML Run Summary" in out


def test_several_nodes_without_a_secret_refuse_in_one_line(tmp_path: Path) -> None:
    """No key is derived from the session id alone (it is on every command line): each
    launcher of a multi-node job without TRACEML_SECRET says how to set one, exit 2."""
    rendezvous, collector = free_ports()
    common = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1",
              f"--master-port={rendezvous}", f"--aggregator-port={collector}"]
    nodes = Nodes(tmp_path, "nosecret", common, env={"TRACEML_SECRET": ""})
    nodes.start("--node-rank=0", script("loop.py"), "--steps", "5")
    nodes.start("--node-rank=1", script("loop.py"), "--steps", "5")
    for code, _, err in nodes.finish(timeout=60):
        assert code == 2, err
        [line] = err.strip().splitlines()
        assert line.startswith("traceml run: several nodes need a session secret: set "
                               "TRACEML_SECRET"), line
    assert not (tmp_path / "logs" / "nosecret" / "telemetry.sqlite").exists()
