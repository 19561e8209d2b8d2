"""--mode=cli end to end: in tmux on a real 2-rank run, and without a terminal."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_traceml
from tests.live.conftest import LIVE_SCRIPTS, artifact, have_tmux, wait_for


class Tmux:
    """One tmux server of our own (its own socket), one session, one pane."""

    def __init__(self, socket_name: str) -> None:
        self.base = ["tmux", "-L", socket_name]

    def start(self, command: str, width: int = 80, height: int = 24) -> None:
        # `read` keeps the pane open after the command, so its output can be read.  The
        # environment is given explicitly: without a terminal, GNU readline (which pytest
        # loads) exports LINES=24 and COLUMNS=80 into the process's C environment, which a
        # child inherits by default; the tmux server would pass them to the pane and the
        # view (rich reads LINES before the terminal's size) would fit 24 lines, not the pane.
        subprocess.run([*self.base, "new-session", "-d", "-s", "live", "-x", str(width), "-y",
                        str(height), f"bash --norc --noprofile -c {shlex.quote(command + '; read')}"],
                       check=True, env=dict(os.environ))

    def screen(self) -> str:
        """The visible pane."""
        return subprocess.run([*self.base, "capture-pane", "-p", "-t", "live"], check=True,
                              capture_output=True, text=True).stdout

    def history(self) -> str:
        """Everything the pane showed, scrollback included, wrapped lines joined."""
        return subprocess.run([*self.base, "capture-pane", "-p", "-J", "-t", "live", "-S", "-"],
                              check=True, capture_output=True, text=True).stdout

    def kill(self) -> None:
        subprocess.run([*self.base, "kill-server"], check=False, capture_output=True)


@pytest.fixture()
def tmux() -> Iterator[Tmux]:
    if not have_tmux():
        if os.environ.get("CI"):
            pytest.fail("tmux is not installed (scripts/setup.sh installs it)")
        pytest.skip("tmux is not installed")
    server = Tmux(f"traceml-test-{os.getpid()}")
    yield server
    server.kill()


def _view_with_both_ranks(screen: str) -> str | None:
    lines = screen.splitlines()
    table = [line.split()[0] for line in lines  # phase-table rows: rank, then its step
             if line.startswith(("r0 ", "r1 ")) and line.split()[1].isdigit()]
    output = {line[:4] for line in lines if line.startswith(("[0] rank 0 step", "[1] rank 1 step"))}
    ok = table == ["r0", "r1"] and output == {"[0] ", "[1] "} and "Diagnosis: " in screen
    return screen if ok else None


def test_live_view_in_tmux_then_the_summary(tmp_path: Path, tmux: Tmux) -> None:
    logs, stop = tmp_path / "logs", tmp_path / "stop"
    command = (f"cd {shlex.quote(str(tmp_path))} && LIVE_STOP_FILE={shlex.quote(str(stop))} "
               f"LIVE_MAX_S=150 OMP_NUM_THREADS=1 {shlex.quote(sys.executable)} -m traceml run "
               f"--logs-dir {shlex.quote(str(logs))} --session-id cli --mode cli "
               f"--nproc-per-node 2 {shlex.quote(str(LIVE_SCRIPTS / 'gated.py'))} "
               "--slow-rank 1 --slow-ms 8; echo TRACEML_EXIT=$?")
    # Tall enough that the output panel fits beside a long diagnosis on every frame
    # (the view fits the terminal; 80x24 is tested in test_terminal.py).
    tmux.start(command, height=32)
    screen = wait_for(lambda: _view_with_both_ranks(tmux.screen()), 90, "the live view",
                      describe=tmux.screen)
    artifact("cli-view-tmux.txt").write_text(screen)
    # 80 columns: the phase table narrows (medians) rather than cutting values or names.
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Step time, ms"))
    end = next(i for i, line in enumerate(lines) if line.startswith("most "))
    assert not any("…" in line for line in lines[start:end + 1]), screen
    assert "communication" in lines[start + 1].split(), screen
    # Worker lines appear only inside the view, tagged with their local rank: no garbling.
    for line in screen.splitlines():
        if "rank 0 step" in line or "rank 1 step" in line:
            assert line.startswith(("[0] rank 0 step", "[1] rank 1 step")), line
    stop.touch()
    history = wait_for(lambda: h if "TRACEML_EXIT=" in (h := tmux.history()) else None, 90,
                       "the run to end", describe=tmux.screen)
    artifact("cli-view-tmux-end.txt").write_text(history)
    assert "TRACEML_EXIT=0" in history
    view_end = history.rindex("Worker output (last lines")
    assert history.index("TraceML Run Summary", view_end) > view_end  # the card after the view
    workers = logs / "cli" / "workers"
    assert f"the workers' output is in {workers}" in history
    for rank in (0, 1):  # every line the workers printed is in their log files
        stdout = next(workers.glob(f"*/attempt_0/{rank}/stdout.log")).read_text()
        stderr = next(workers.glob(f"*/attempt_0/{rank}/stderr.log")).read_text()
        assert f"rank {rank} step 0 loss" in stdout and f"rank {rank} finished after" in stdout
        assert f"rank {rank} says goodbye on stderr" in stderr


def test_without_a_terminal_the_output_stays_plain(tmp_path: Path) -> None:
    (tmp_path / "stop").touch()  # one step, then stop
    res = run_traceml(tmp_path, "run", "--mode", "cli", str(LIVE_SCRIPTS / "gated.py"),
                      env={"LIVE_STOP_FILE": str(tmp_path / "stop")})
    assert res.returncode == 0, res.stderr
    assert "stdout is not a terminal" in res.stderr
    assert "\x1b[" not in res.stdout + res.stderr
    assert "rank 0 step 0 loss" in res.stdout and "rank 0 finished after 1 steps" in res.stdout
    assert "rank 0 says goodbye on stderr" in res.stderr
    assert res.stdout.index("rank 0 finished") < res.stdout.index("TraceML Run Summary")
    assert not (res.session_dir / "workers").exists()
