"""Stalls and crashes, end to end: real 2-rank gloo DDP under ``traceml run``, zero code
(`tests/e2e/scripts/stall_cases.py`).  A stalled rank is named on node 0's terminal
within the stall threshold + 10 s, with its phase and the line it blocks on, the other
rank as waiting for it; Ctrl-C then gives a STALLED summary within 10 s.  Each crash
is headlined with the rank, how it died and where, with the training's exit status."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import read_store, read_summary, run_traceml, script, wait_until

STALL_TIMEOUT_S = 3
SCRIPT = script("stall_cases.py")


def line_of(marker: str) -> int:
    """The line of stall_cases.py that carries ``# marker``."""
    lines = Path(SCRIPT).read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}"))


class Launch:
    """``traceml run`` in its own process group, stderr in a file to read while it runs."""

    def __init__(self, tmp_path: Path, case: str, *args: str) -> None:
        self.session = tmp_path / "logs" / case
        self.err_path = tmp_path / f"{case}.err"
        self.evidence = tmp_path / "evidence"
        self.evidence.mkdir(exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", EVIDENCE_DIR=str(self.evidence))
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "traceml", "run", "--logs-dir", str(tmp_path / "logs"),
                 "--session-id", case, "--stall-timeout", str(STALL_TIMEOUT_S),
                 "--nproc-per-node=2", SCRIPT, "--case", case, *args],
                env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True,
                start_new_session=True)

    def stderr(self) -> str:
        return self.err_path.read_text()

    def steps_of(self, rank: int) -> int:
        store = self.session / "telemetry.sqlite"
        if not store.exists():
            return 0
        return sum(1 for row in read_store(store)[0] if row["rank"] == rank)

    def interrupt(self) -> tuple[str, float]:
        """Ctrl-C (SIGINT to the whole group, as a terminal sends it); stdout and how
        long the summary took."""
        os.killpg(self.proc.pid, signal.SIGINT)
        sent = time.monotonic()
        out, _ = self.proc.communicate(timeout=60)
        return out, time.monotonic() - sent

    def kill(self) -> None:
        """Everything of the run, also a DataLoader worker still hung after its rank
        exited (the group outlives its leader while a member lives)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def alert_after_stall(launch: Launch, rank: int = 1, at: int = 30) -> str:
    """Node 0's STALLED block, waited for from the moment ``rank``'s steps before
    ``at`` are stored (all but the last, which ends where the next begins); fails
    unless it comes within the threshold + 10 s."""
    if not wait_until(lambda: launch.steps_of(rank) >= at - 1, 120, 0.2):
        raise AssertionError(f"r{rank} never reached step {at}: {launch.stderr()[-2000:]}")
    reached = time.monotonic()
    if not wait_until(lambda: "traceml: STALLED:" in launch.stderr(), STALL_TIMEOUT_S + 10, 0.1):
        raise AssertionError(f"no stall alert within {STALL_TIMEOUT_S + 10} s of step {at}: "
                             f"{launch.stderr()[-2000:]}")
    assert time.monotonic() - reached <= STALL_TIMEOUT_S + 10
    text = launch.stderr()
    return text[text.index("traceml: STALLED:"):]


def stalled_summary(launch: Launch) -> dict[str, Any]:
    out, took = launch.interrupt()
    assert launch.proc.returncode == 130  # Ctrl-C's status, as torchrun gives it
    assert took < 10, f"the summary took {took:.1f} s after Ctrl-C"
    summary = read_summary(launch.session)
    assert summary is not None
    primary = summary["primary"]
    assert (primary["label"], primary["section"], primary["ranks"]) == ("STALLED", "ending", [1])
    assert summary["ending"]["state"] == "stalled" and summary["ending"]["culprits"] == [1]
    assert "Verdict: STALLED [crit] (Ending, r1)" in out
    return summary


def stall_then_ctrl_c(tmp_path: Path, case: str, *in_alert: str) -> dict[str, Any]:
    """Run ``case``, check node 0's alert says each of ``in_alert``, then Ctrl-C: the
    STALLED summary."""
    launch = Launch(tmp_path, case)
    try:
        alert = alert_after_stall(launch)
        for needle in in_alert:
            assert needle in alert, alert
        return stalled_summary(launch)
    finally:
        launch.kill()


def stall_of(summary: dict[str, Any], rank: int) -> dict[str, Any]:
    return next(i for i in summary["ending"]["incidents"]
                if i["what"] == "stall" and i["rank"] == rank)


def user_line(incident: dict[str, Any]) -> int:
    return [f for f in incident["stack"] if f["user"]][-1]["line"]


def test_a_rank_blocked_in_python_is_named_live_and_headlines_the_summary(tmp_path: Path) -> None:
    block = line_of("BLOCK-PYTHON")
    summary = stall_then_ctrl_c(
        tmp_path, "python", "r1 (n0) made no progress for",
        f"at step 30 in forward (stall_cases.py:{block} in forward",
        "r0 (n0) waited for it in communication (backward's gradient all-reduce)")
    r1, r0 = stall_of(summary, 1), stall_of(summary, 0)
    assert (r1["step"], r1["phase"], r1["waiting_in_collective"]) == (30, "forward", False)
    assert r1["stack_source"] == "python" and user_line(r1) == block
    assert (r0["phase"], r0["open_phases"], r0["waiting_in_collective"]) == (
        "communication", ["backward", "communication"], True)
    assert f"stall_cases.py:{block} in forward" in summary["primary"]["why"]


def test_a_rank_blocked_in_a_c_call_holding_the_gil_still_gets_its_stack(tmp_path: Path) -> None:
    summary = stall_then_ctrl_c(tmp_path, "gil", "r0 (n0) waited for it in communication")
    r1 = stall_of(summary, 1)
    # Its own sender thread could not run: the launcher's signal made faulthandler write it.
    assert r1["stack_source"] == "faulthandler"
    assert user_line(r1) == line_of("BLOCK-GIL")
    assert r1["phase"] is None  # after its optimizer step, outside every phase
    assert f"stall_cases.py:{line_of('BLOCK-GIL')} in main" in summary["primary"]["why"]


def test_a_hung_dataloader_worker_is_a_stall_in_input(tmp_path: Path) -> None:
    summary = stall_then_ctrl_c(tmp_path, "loader", "at step 30 in input")
    assert stall_of(summary, 1)["phase"] == "input"
    assert "DataLoader" in summary["primary"]["next"]


def test_a_stall_that_clears_is_listed_with_its_duration(tmp_path: Path) -> None:
    # Long enough that the alert (threshold 3 s, up to 5 s more waiting for r0's own
    # report) comes while the pause lasts: only a printed stall is said to clear.
    launch = Launch(tmp_path, "pause", "--steps", "60", "--pause-s", "11")
    try:
        out, _ = launch.proc.communicate(timeout=180)
    finally:
        launch.kill()
    assert launch.proc.returncode == 0
    assert "traceml: STALLED:" in launch.stderr()  # printed while it lasted
    # r0, waiting in the all-reduce, may have been reported stalled too: both clear,
    # in one line or in two (their reports may reach node 0 a poll apart).
    cleared = [line for line in launch.stderr().splitlines()
               if line.startswith("traceml: the stall cleared: steps resumed (")]
    assert any(re.search(r"[(, ]r1 after \d+\.\d s", line) for line in cleared), launch.stderr()
    summary = read_summary(launch.session)
    assert summary is not None
    assert summary["ending"]["state"] == "completed" and summary["ending"]["headline"] is None
    findings = [f for f in summary["ending"]["findings"] if f["kind"] == "STALL_CLEARED"]
    assert len(findings) == 1 and findings[0]["ranks"] == [1]
    assert 10.0 <= findings[0]["evidence"]["stalled_s"] <= 15.0
    assert "STALL CLEARED [warn]: r1 (n0) made no progress for" in out
    assert stall_of(summary, 1)["cleared_at"] is not None
    assert launch.steps_of(0) == launch.steps_of(1) == 60  # the steps are still exact


def crash_run(tmp_path: Path, case: str, *args: str) -> Any:
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", SCRIPT, "--case", case,
                      "--steps", "60", "--at", "25", *args, session=case)
    assert res.summary is not None
    assert res.summary["primary"]["section"] == "ending"
    return res


def test_an_exception_on_one_rank_is_a_crash_naming_it(tmp_path: Path) -> None:
    res = crash_run(tmp_path, "raise")
    assert res.returncode == 1
    primary = res.summary["primary"]
    assert (primary["label"], primary["ranks"]) == ("CRASHED", [1])
    assert (f"r1 (n0) raised ValueError: bad batch on this rank at step 25 in forward "
            f"(stall_cases.py:{line_of('RAISE')} in forward)") in primary["why"]
    assert "exit 1" in primary["why"]
    assert "Verdict: CRASHED [crit] (Ending, r1)" in res.stdout


def test_a_segfault_is_a_crash_with_its_faulthandler_stack(tmp_path: Path) -> None:
    res = crash_run(tmp_path, "segv")
    assert res.returncode == 128 + signal.SIGSEGV
    primary = res.summary["primary"]
    assert (primary["label"], primary["ranks"]) == ("CRASHED", [1])
    assert "r1 (n0) was killed by SIGSEGV" in primary["why"]
    assert f"stall_cases.py:{line_of('SEGV')} in forward" in primary["why"]


def test_a_rank_killed_from_outside_is_a_crash_with_the_likely_sender(tmp_path: Path) -> None:
    launch = Launch(tmp_path, "none")
    try:
        pid_file = launch.evidence / "pid-1"
        assert wait_until(lambda: pid_file.exists() and launch.steps_of(1) >= 10, 120, 0.2)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        launch.proc.communicate(timeout=60)
    finally:
        launch.kill()
    assert launch.proc.returncode == 128 + signal.SIGKILL
    summary = read_summary(launch.session)
    assert summary is not None
    primary = summary["primary"]
    assert (primary["label"], primary["ranks"]) == ("CRASHED", [1])
    assert "r1 (n0) was killed by SIGKILL" in primary["why"]
    # This test machine's memory is far from full: not the kernel's OOM killer.
    assert "not the out-of-memory killer" in primary["why"]


def test_an_exception_before_the_first_step_is_a_crash_before_any_step(tmp_path: Path) -> None:
    res = crash_run(tmp_path, "setup")
    assert res.returncode == 1
    primary = res.summary["primary"]
    assert (primary["label"], primary["ranks"]) == ("CRASHED", [1])
    assert ("r1 (n0) raised RuntimeError: cannot open the dataset before any step of it was "
            f"recorded outside every phase (stall_cases.py:{line_of('SETUP')} in main)"
            in primary["why"])
