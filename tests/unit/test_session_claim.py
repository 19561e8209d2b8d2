"""Who runs the collector on c10d when two launchers on the endpoint's host start at
once: the one that claims the session folder; the other connects once that
collector holds the port, and an old run's folder is still refused."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from traceml.config import RunConfig
from traceml.errors import UsageError
from traceml.launcher import launch, topology
from traceml.launcher.args import parse


def _c10d(tmp_path: Path, port: int) -> tuple[RunConfig, topology.Topology]:
    cfg = parse("run", ["--logs-dir", str(tmp_path), "--session-id", "c1", "--nnodes=2",
                        "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400",
                        f"--aggregator-port={port}", "--aggregator-bind-host=127.0.0.1",
                        "train.py"])
    topo = topology.resolve(cfg)
    assert topo.may_host and not topo.collector_here
    return cfg, topo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_launcher_that_claims_the_folder_runs_the_collector(tmp_path: Path) -> None:
    cfg, topo = _c10d(tmp_path, _free_port())
    path, hosting = launch.session_dir_for(cfg, topo)
    assert hosting and (path / "telemetry.sqlite").exists()


def test_the_other_connects_once_the_peer_collector_holds_the_port(tmp_path: Path) -> None:
    port = _free_port()
    cfg, topo = _c10d(tmp_path, port)
    launch.session_dir_for(cfg, topo)  # the peer claimed the folder first
    peer = socket.socket()
    starting = threading.Timer(0.5, lambda: (peer.bind(("127.0.0.1", port)), peer.listen()))
    starting.start()  # ... and its collector takes the port a moment later
    try:
        path, hosting = launch.session_dir_for(cfg, topo)
    finally:
        starting.join()
        peer.close()
    assert not hosting and path == tmp_path / "c1"


def test_an_old_runs_folder_is_still_refused(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "PEER_COLLECTOR_S", 0.3)
    cfg, topo = _c10d(tmp_path, _free_port())
    launch.session_dir_for(cfg, topo)  # a finished run's folder: nobody holds the port
    with pytest.raises(UsageError, match="already holds a run"):
        launch.session_dir_for(cfg, topo)
