"""How a run ends when the job, the user or the disk ends it: a real launcher,
real workers and collector, a real (small, full) tmpfs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import read_store, read_summary, script, wait_until


def _launch(tmp_path: Path, logs: Path, *args: str, session: str = "e") -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", EVIDENCE_DIR=str(tmp_path))
    return subprocess.Popen(
        [sys.executable, "-m", "traceml", "run", "--logs-dir", str(logs), "--session-id",
         session, *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)


def _stored_steps(store: Path) -> int:
    return len(read_store(store)[0]) if store.exists() else 0


@contextmanager
def _training(tmp_path: Path, logs: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A run of until_marker.py (``args`` before the script, then marker and status),
    once it has stored a step; killed with its process group if still running after."""
    *options, marker, status = args
    proc = _launch(tmp_path, logs, *options, script("until_marker.py"), marker, status)
    try:
        assert wait_until(lambda: _stored_steps(logs / "e" / "telemetry.sqlite") > 0, 90), \
            "no step was stored"
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigterm_to_the_process_group_keeps_a_whole_summary(tmp_path: Path) -> None:
    # What `timeout` or `scancel` does: every process of the job gets SIGTERM.
    with _training(tmp_path, tmp_path / "logs", "--nproc-per-node", "2",
                   str(tmp_path / "never"), "0") as proc:
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    summary = read_summary(tmp_path / "logs" / "e")
    assert summary is not None, err[-3000:]
    assert summary["meta"]["exit_code"] == 143
    assert summary["meta"]["telemetry_complete"] is True  # the collector outlived the signal
    assert "Traceback" not in err and "TraceML Run Summary" in out
    assert not (tmp_path / "logs" / "e" / "telemetry.sqlite-wal").exists()  # one file


def test_second_ctrl_c_during_the_summary_does_not_abort_it(tmp_path: Path) -> None:
    summary_json = tmp_path / "logs" / "e" / "final_summary.json"  # written last
    with _training(tmp_path, tmp_path / "logs", str(tmp_path / "never"), "0") as proc:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal
        # ... and again, impatiently, until the summary is written.
        while not wait_until(lambda: proc.poll() is not None or summary_json.exists(), 0.2):
            os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    summary = read_summary(tmp_path / "logs" / "e")
    assert summary is not None and summary["meta"]["exit_code"] == 130, err[-3000:]
    assert "TraceML Run Summary" in out


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path) -> None:
    """Fill the disk to the last byte.  Unbuffered: a buffered file's close would
    try again to write what did not fit, and raise."""
    with open(disk / "filler", "wb", buffering=0) as f:
        for size in (65536, 4096, 512, 1):
            try:
                while f.write(b"\0" * size):
                    pass
            except OSError:
                pass


def test_disk_full_during_the_run_keeps_the_exit_code_and_prints_the_card(
        tmp_path: Path, small_disk: Path) -> None:
    marker = tmp_path / "stop"
    with _training(tmp_path, small_disk, str(marker), "3") as proc:
        _fill(small_disk)
        marker.write_text("")
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err[-3000:]
    assert "TraceML Run Summary" in out and "exit 3" in out, err[-3000:]
    assert "Telemetry stopped early" in out  # what came after the disk filled is missing
    lines = [ln for ln in err.splitlines() if "cannot write" in ln]
    assert len(lines) == 1 and "No space left on device" in lines[0], err[-3000:]
    assert "Traceback" not in err


def test_disk_full_at_start_runs_the_training_with_one_line(tmp_path: Path,
                                                           small_disk: Path) -> None:
    _fill(small_disk)
    marker = tmp_path / "stop"
    marker.write_text("")
    proc = _launch(tmp_path, small_disk, script("until_marker.py"), str(marker), "3")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err[-3000:]
    ours = [ln for ln in err.splitlines() if ln.startswith("traceml")]
    assert len(ours) == 1 and "runs without traceml" in ours[0], err[-3000:]
    assert "Traceback" not in err


def test_report_where_no_file_can_be_written_prints_the_card_and_one_line(
        tmp_path: Path, small_disk: Path) -> None:
    """The launcher's disk-full message tells the user to run `traceml report` later: on a
    disk still full, or a read-only one, it prints the summary, says in one line why it
    could not write it (exit 2), and leaves no temporary file behind."""
    import shutil

    from tests.conftest import ROOT, run_traceml

    res = run_traceml(tmp_path, "run", str(ROOT / "examples" / "diagnosis" / "input_bound.py"),
                      "--steps", "20")
    assert res.returncode == 0, res.stderr[-3000:]
    # Owner only: the store and the summaries hold command lines and host names.
    for name in ("telemetry.sqlite", "final_summary.json", "final_summary.txt"):
        assert oct((res.session_dir / name).stat().st_mode & 0o777) == "0o600", name
    session = small_disk / "s"
    shutil.copytree(res.session_dir, session)
    for name in ("final_summary.json", "final_summary.txt"):
        (session / name).unlink()

    def report() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "traceml", "report", str(session)],
                              capture_output=True, text=True, timeout=120)

    _fill(small_disk)
    full = report()
    (small_disk / "filler").unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    read_only = report()
    for done, why in ((full, "No space left on device"), (read_only, "Read-only file system")):
        assert done.returncode == 2, done.stderr[-3000:]
        assert "TraceML Run Summary" in done.stdout and "Step Time" in done.stdout
        assert "Traceback" not in done.stderr
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"traceml report: the summary is printed above, but {session} "
                               f"takes no file ({why})"), line
        left = sorted(p.name for p in session.iterdir())
        assert "telemetry.sqlite" in left and not [n for n in left if "summary" in n], left
