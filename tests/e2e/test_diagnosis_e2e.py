"""End to end: each example in examples/diagnosis/ under `traceml run` gets
its diagnosis, naming the rank; the summary is written in every ending."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, read_store, read_summary, run_traceml, script, wait_until

EXAMPLES = ROOT / "examples" / "diagnosis"


def _finding(summary: dict[str, Any], section: str, label: str) -> dict[str, Any]:
    for finding in summary[section]["findings"]:
        if finding["label"] == label:
            return finding  # type: ignore[no-any-return]
    labels = [f["label"] for f in summary[section]["findings"]]
    raise AssertionError(f"{label} not among {section} findings {labels}")


@pytest.mark.parametrize("example,nproc,section,labels,ranks", [
    ("healthy.py", 1, "step_time", {"COMPUTE-BOUND", "BALANCED"}, None),
    ("input_bound.py", 1, "step_time", {"INPUT-BOUND"}, None),
    ("wait_heavy.py", 1, "step_time", {"WAIT-HEAVY"}, None),
    ("memory_creep.py", 1, "step_memory", {"HOST RSS CREEP"}, None),
    ("input_straggler.py", 2, "step_time", {"INPUT STRAGGLER"}, [1]),
    ("compute_straggler.py", 2, "step_time", {"COMPUTE STRAGGLER"}, [1]),
])
def test_example_is_diagnosed(tmp_path: Path, example: str, nproc: int, section: str,
                              labels: set[str], ranks: list[int] | None) -> None:
    res = run_traceml(tmp_path, "run", f"--nproc-per-node={nproc}", str(EXAMPLES / example))
    assert res.returncode == 0, res.stderr[-3000:]
    summary = res.summary
    assert summary is not None
    diagnosis = summary[section]["diagnosis"]
    if ranks is None:
        assert diagnosis["label"] in labels, summary[section]
    else:
        (label,) = labels
        finding = _finding(summary, section, label)
        assert finding["ranks"] == ranks, finding
        assert diagnosis["label"] == label, summary[section]
    assert summary["meta"]["world_size"] == nproc and not summary["meta"]["partial"]
    assert "TraceML Run Summary" in res.stdout


def test_rank_raising_gives_partial_summary(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", script("loop.py"), "--steps", "30",
                      "--fail", "raise")
    assert res.returncode == 1
    assert res.summary is not None
    assert res.summary["meta"]["partial"] is True
    assert res.summary["meta"]["exit_code"] == 1
    assert "PARTIAL" in (res.session_dir / "final_summary.txt").read_text()


def test_rank_killed_gives_partial_summary(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", script("kill_self.py"))
    assert res.returncode == 137
    assert res.summary is not None
    assert res.summary["meta"]["partial"] is True and res.summary["meta"]["exit_code"] == 137


def test_ctrl_c_writes_partial_summary_quickly(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml", "run", "--logs-dir", str(tmp_path / "logs"),
         "--session-id", "c", "--nproc-per-node=2", script("loop.py"), "--steps", "100000",
         "--input-sleep-ms", "1"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)
    session = tmp_path / "logs" / "c"
    store = session / "telemetry.sqlite"
    if not wait_until(lambda: store.exists() and len({s["rank"] for s in read_store(store)[0]}) == 2,
                      90, 0.1):
        proc.kill()
        raise AssertionError("no steps from both ranks")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    sent = time.monotonic()
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert time.monotonic() - sent < 10
    summary = read_summary(session)
    assert summary is not None and summary["meta"]["partial"] is True


def test_report_rebuilds_summary_from_store(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", str(EXAMPLES / "input_bound.py"), "--steps", "30")
    assert res.returncode == 0
    (res.session_dir / "final_summary.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "traceml", "report", str(res.session_dir),
                           "--summary-window-rows", "10"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    summary = read_summary(res.session_dir)
    assert summary is not None
    assert summary["step_time"]["diagnosis"]["label"] == "INPUT-BOUND"
    assert "last 10 aligned steps" in proc.stdout
    assert summary["step_time"]["scope"]["num_steps"] == 10


def test_init_and_summary_in_plain_python(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, script("plain_init.py"), str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert "flat keys ok" in proc.stdout
    assert "TraceML Run Summary" in proc.stdout
    summary = read_summary(tmp_path / "logs" / "plain")
    assert summary is not None
    assert summary["step_time"]["diagnosis"]["label"] == "INPUT-BOUND"
    assert len(read_store(tmp_path / "logs" / "plain" / "telemetry.sqlite")[0]) == 30


def test_a_run_that_dies_in_set_up_is_headlined_as_a_crash_before_the_first_step(
        tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", script("loop.py"), "--fail", "setup")
    assert res.returncode == 1  # the training's own exit status
    assert res.summary is not None
    primary = res.summary["primary"]
    assert (primary["label"], primary["severity"], primary["section"]) == (
        "CRASHED", "crit", "ending")
    assert "raised RuntimeError: set-up failure on purpose before any step" in primary["why"]
    assert "loop.py:" in primary["why"]  # the script's line, not torch's
    assert f"Verdict: CRASHED [crit] (Ending, r{primary['ranks'][0]})" in res.stdout
