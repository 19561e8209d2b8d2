"""Who runs the collector on c10d when launchers on the endpoint's host start
together: the one that claims the session folder; another connects once that
collector has recorded the run's start, takes the folder over when the claimant
gives it back, and an ended run's folder is refused at once.  Real collectors,
real ports, real stores."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from traceml.config import RunConfig
from traceml.errors import UsageError
from traceml.launcher import launch, session_dir, topology
from traceml.launcher.args import parse
from traceml.launcher.collector_process import CollectorProcess, end_run

C10d = tuple[RunConfig, topology.Topology]


@pytest.fixture
def c10d(tmp_path: Path) -> C10d:
    cfg = parse("run", ["--logs-dir", str(tmp_path), "--session-id", "c1", "--nnodes=2",
                        "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400",
                        f"--aggregator-port={free_port()}", "--aggregator-bind-host=127.0.0.1",
                        "train.py"])
    topo = topology.resolve(cfg)
    assert topo.may_host and not topo.collector_here
    return cfg, topo


def _collector(cfg: RunConfig, topo: topology.Topology) -> CollectorProcess:
    """What the claimant does next: its collector on the port, the run's start recorded."""
    collector = launch.start_collector(cfg, topo, Path(cfg.logs_dir) / cfg.session_id, None)
    assert collector is not None
    launch.record_start(collector, cfg)
    return collector


@pytest.fixture
def collectors() -> Iterator[list[CollectorProcess]]:
    started: list[CollectorProcess] = []
    yield started
    for collector in started:
        collector.stop()


def test_the_launcher_that_claims_the_folder_runs_the_collector(c10d: C10d) -> None:
    cfg, topo = c10d
    path, hosting = session_dir.session_dir_for(cfg, topo)
    assert hosting and (path / "telemetry.sqlite").exists()


def _peer_acts(monkeypatch: pytest.MonkeyPatch, act: Callable[[], object]) -> list[str]:
    """What the waiting launcher finds each time it looks at the claimed folder; the
    peer does ``act`` right after the first look, while this one waits."""
    seen: list[str] = []
    look = session_dir._peer_run

    def looking(store: Path, topo: topology.Topology) -> str:
        seen.append(look(store, topo))
        if len(seen) == 1:
            act()
        return seen[-1]

    monkeypatch.setattr(session_dir, "_peer_run", looking)
    return seen


def test_the_other_connects_once_the_peers_collector_recorded_the_start(
        c10d: C10d, collectors: list[CollectorProcess],
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, topo = c10d
    session_dir.session_dir_for(cfg, topo)  # the peer claimed the folder first ...
    # ... and starts its collector while this launcher waits
    seen = _peer_acts(monkeypatch, lambda: collectors.append(_collector(cfg, topo)))
    path, hosting = session_dir.session_dir_for(cfg, topo)
    assert not hosting and path == Path(cfg.logs_dir) / "c1"
    # it waited (the start is stored a commit after the collector is up), then connected
    assert seen[0] == "starting" and seen[-1] == "live" and set(seen) == {"starting", "live"}
    assert collectors[0].alive()


def test_a_folder_given_back_is_claimed_again(
        c10d: C10d, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, topo = c10d
    path, _ = session_dir.session_dir_for(cfg, topo)
    # The peer's collector could not start: it gives the (empty) store back.
    seen = _peer_acts(monkeypatch, (path / "telemetry.sqlite").unlink)
    assert session_dir.session_dir_for(cfg, topo) == (path, True)
    assert seen == ["starting"]


def test_an_ended_runs_folder_is_refused_at_once(c10d: C10d) -> None:
    cfg, topo = c10d
    session_dir.session_dir_for(cfg, topo)
    end_run(_collector(cfg, topo), 0)  # the run ended, its end recorded
    began = time.monotonic()
    with pytest.raises(UsageError, match="already holds a run"):
        session_dir.session_dir_for(cfg, topo)
    assert time.monotonic() - began < 5  # not the wait for a starting peer


def test_a_folder_whose_collector_is_gone_is_refused_at_once(c10d: C10d) -> None:
    cfg, topo = c10d
    session_dir.session_dir_for(cfg, topo)
    collector = _collector(cfg, topo)
    assert collector.stop() == 0  # a launcher killed before it recorded the end
    began = time.monotonic()
    with pytest.raises(UsageError, match="already holds a run"):
        session_dir.session_dir_for(cfg, topo)
    assert time.monotonic() - began < 5


def test_a_claim_whose_collector_never_comes_is_one_line(
        c10d: C10d, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_dir, "PEER_COLLECTOR_S", 0.5)
    cfg, topo = c10d
    session_dir.session_dir_for(cfg, topo)
    with pytest.raises(UsageError, match=r"its collector did not start within 0 s"):
        session_dir.session_dir_for(cfg, topo)


def test_a_collector_that_cannot_take_the_port_gives_the_folder_back(
        c10d: C10d, capsys: pytest.CaptureFixture[str]) -> None:
    cfg, topo = c10d
    path, _ = session_dir.session_dir_for(cfg, topo)
    with socket.socket() as taken:  # another program holds the port
        taken.bind(("127.0.0.1", topo.port))
        taken.listen()
        assert launch.start_collector(cfg, topo, path, None) is None
    assert not (path / "telemetry.sqlite").exists()
    err = capsys.readouterr().err
    assert err.startswith("traceml: no collector here (cannot listen on 127.0.0.1:")
    assert f"this node sends to the one at 127.0.0.1:{topo.port}" in err
