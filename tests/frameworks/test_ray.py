"""Ray Train, on a real local Ray cluster (2 CPUs) the tests start once: the docs'
minimal TorchTrainer example on 2 gloo workers, driven by a driver script with the
one traceml line (`traceml.integrations.ray.fit`).  Per-rank steps as the loop's, a
rank slowed in forward named, the trainer's metrics unchanged, a summary after a
worker raises or its process dies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import read_store, read_summary

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.frameworks
DRIVER = Path(__file__).resolve().parent / "scripts" / "ray_driver.py"
EPOCHS, BATCHES = 2, 15  # the driver's defaults: each rank takes 30 optimizer steps
SLOW_MS = 15.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster of 2 CPUs (one per worker), shared by this file's tests;
    its address, for the drivers."""
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield str(context.address_info["gcs_address"])
    finally:
        ray.shutdown()


def drive(cluster: str, tmp_path: Path, *args: str) -> tuple[dict[str, Any], str, str]:
    """Run the driver script against ``cluster``; what it wrote, its stdout and stderr."""
    evidence = tmp_path / "evidence"
    evidence.mkdir(exist_ok=True)
    out = tmp_path / "out.json"
    env = {**os.environ, "EVIDENCE_DIR": str(evidence), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(DRIVER), "--address", cluster, "--storage", str(tmp_path / "ray"),
         "--out", str(out), "--logs-dir", str(tmp_path / "logs"), *args],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def untraced(cluster: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same training without traceml: the metrics the trainer returns."""
    result, _, err = drive(cluster, tmp_path_factory.mktemp("untraced"),
                           "--slow-rank=1", f"--slow-ms={SLOW_MS}")
    assert "metrics" in result, err[-3000:]
    return result


def test_every_worker_traced_and_the_slow_rank_named(cluster: str, tmp_path: Path,
                                                     untraced: dict[str, Any]) -> None:
    result, out, err = drive(cluster, tmp_path, "--traced", "--session-id=ray", "--html",
                             "--slow-rank=1", f"--slow-ms={SLOW_MS}")
    session = tmp_path / "logs" / "ray"
    assert result["metrics"] == untraced["metrics"]  # the trainer's result, unchanged
    assert result["loop"] is True  # the trainer's own function is back in place
    summary = read_summary(session)
    assert summary is not None, err[-3000:]
    assert "TraceML Run Summary" in out and (session / "final_summary.html").exists()
    assert summary["meta"]["world_size"] == 2 and summary["meta"]["missing_ranks"] == []
    steps, senders = read_store(session / "telemetry.sqlite")
    loop_steps = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())["steps"]
                  for p in (tmp_path / "evidence").glob("rank*.json")}
    assert loop_steps == {0: EPOCHS * BATCHES, 1: EPOCHS * BATCHES}
    assert {r: sum(s["rank"] == r for s in steps) for r in (0, 1)} == loop_steps
    assert all(s["communication_ms"] > 0 for s in steps if s["rank"] == 0)  # DDP's all-reduce
    stragglers = [(f["kind"], f["ranks"]) for f in summary["step_time"]["findings"]
                  if "STRAGGLER" in f["kind"] and f["ranks"]]
    assert stragglers == [("COMPUTE_STRAGGLER", [1])], summary["step_time"]["findings"]
    assert summary["step_time"]["diagnosis"]["why"].startswith("r1 forward was")
    # health: every rank's process samples and goodbye, and the driver node's system
    assert summary["process"]["scope"]["ranks"] == [0, 1]
    assert all(s["said_bye"] for s in senders if s["role"] == "rank")
    assert summary["system"]["diagnosis"]["kind"] != "NOT_MEASURED"


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failed_worker_still_leaves_a_summary(cluster: str, tmp_path: Path,
                                                how: str) -> None:
    result, out, err = drive(cluster, tmp_path, "--traced", "--session-id=failed",
                             "--fail-rank=1", "--fail-at=10", f"--fail={how}")
    assert result["error"] == "WorkerGroupError"  # Ray's own error, passed through
    summary = read_summary(tmp_path / "logs" / "failed")
    assert summary is not None, err[-3000:]
    assert summary["meta"]["exit_code"] == 1 and "TraceML Run Summary" in out
    headline = summary["ending"]["headline"]
    if how == "raise":
        assert headline["kind"] == "CRASHED" and headline["ranks"] == [1], headline
        assert "RuntimeError: rank failed on purpose at step 10" in headline["why"]
    else:  # the process is gone without a word: its rank is named as lost
        assert 1 in summary["meta"]["missing_ranks"], summary["meta"]
        assert summary["ending"]["state"] != "completed", summary["ending"]


def test_a_restarted_worker_group_is_every_ranks_next_attempt(cluster: str,
                                                                tmp_path: Path) -> None:
    """Rank 1 raises once; Ray restarts the group (FailureConfig): each rank's second
    attempt is a sender of its own, counted by the fit's actor, and stored whole."""
    result, _, err = drive(cluster, tmp_path, "--traced", "--session-id=again",
                           "--fail-rank=1", "--fail-at=10", "--max-failures=1")
    assert "metrics" in result, (result, err[-3000:])  # the fit succeeded on its retry
    steps, senders = read_store(tmp_path / "logs" / "again" / "telemetry.sqlite")
    ranks = {(s["rank"], s["restart"]) for s in senders if s["role"] == "rank"}
    assert {(0, 0), (1, 0), (0, 1), (1, 1)} <= ranks, senders
    again = {r: sum(s["rank"] == r and s["restart"] == 1 for s in steps) for r in (0, 1)}
    assert again == {0: EPOCHS * BATCHES, 1: EPOCHS * BATCHES}
    summary = read_summary(tmp_path / "logs" / "again")
    assert summary is not None and summary["meta"]["exit_code"] == 0
    assert "rank or node claimed by another sender" not in summary["meta"]["rejected"]


class NotV2:
    """A trainer without train_loop_per_worker (Ray Train V1 keeps it private)."""

    def fit(self) -> None:
        raise AssertionError("never called")


def test_what_fit_refuses_it_says_before_starting_anything(tmp_path: Path) -> None:
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from traceml.errors import UsageError
    from traceml.integrations.ray import fit

    with pytest.raises(UsageError, match="NotV2 has no train_loop_per_worker; give it a Ray "
                                         "Train V2 trainer"):
        fit(NotV2())
    trainer = TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2))
    with pytest.raises(UsageError, match="invalid session_id '../up'"):
        fit(trainer, logs_dir=str(tmp_path), session_id="../up")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "telemetry.sqlite").write_bytes(b"")
    with pytest.raises(UsageError, match="already holds a run; give another session_id"):
        fit(trainer, logs_dir=str(tmp_path), session_id="taken")


@pytest.mark.parametrize("takes_config", [True, False])
def test_the_wrapped_loop_keeps_the_functions_signature(takes_config: bool) -> None:
    """Ray passes ``config`` only to a function that takes one argument."""
    from ray.train._internal.utils import count_required_parameters

    from traceml.environment import AgentEnv
    from traceml.integrations.ray import TracedLoop

    def with_config(config: dict[str, Any]) -> None: ...
    def without() -> None: ...

    fn = with_config if takes_config else without
    loop = TracedLoop(fn, AgentEnv(session_id="s", endpoint="tcp://127.0.0.1:1", launcher_pid=1))
    assert count_required_parameters(loop) == count_required_parameters(fn) == int(takes_config)
    assert loop.__name__ == fn.__name__
