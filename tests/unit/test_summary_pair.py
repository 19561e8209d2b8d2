"""The summary's two files are one pair, all or nothing (traceml/report/summary_files.py):
a process writing a new pair over an old one is SIGKILLed at each step of the write;
whatever a traceml reader then sees, after it settles the folder, is the old pair or the
new one whole, with no temporary file left."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from traceml.report.summary_files import save_pair, settle

NAMES = ("final_summary.txt", "final_summary.json")
WRITER = """
import os, signal, sys
from pathlib import Path
from traceml.report import summary_files
folder, kill_at = Path(sys.argv[1]), int(sys.argv[2])
calls = [0]
def counted(real):
    def call(*args, **kwargs):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return call
os.replace = counted(os.replace)
os.fsync = counted(os.fsync)
summary_files.save_pair(folder, ("final_summary.txt", "final_summary.json"), (b"new text", b"new json"))
"""


def _pair(folder: Path) -> tuple[bytes, bytes]:
    return tuple((folder / n).read_bytes() for n in NAMES)  # type: ignore[return-value]


@pytest.mark.parametrize("kill_at", range(1, 12))
def test_a_kill_at_any_step_leaves_one_whole_pair(tmp_path: Path, kill_at: int) -> None:
    save_pair(tmp_path, NAMES, (b"old text", b"old json"))
    done = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), str(kill_at)],
                          timeout=60)
    killed = done.returncode == -signal.SIGKILL
    settle(tmp_path)  # what every writer and reader of the pair does first
    assert _pair(tmp_path) in ((b"old text", b"old json"), (b"new text", b"new json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(NAMES)
    if not killed:  # the write has fewer steps than kill_at: it completed
        assert _pair(tmp_path) == (b"new text", b"new json")


@pytest.mark.parametrize(("kill_at", "pair"), [
    (3, (b"old text", b"old json")),  # writing the temporary files: nothing committed
    (7, (b"new text", b"new json")),  # the journal is in place, no file renamed yet
    (8, (b"new text", b"new json")),  # the text renamed, the JSON not: settled forward
])
def test_before_the_commit_the_old_pair_after_it_the_new(tmp_path: Path, kill_at: int,
                                                        pair: tuple[bytes, bytes]) -> None:
    save_pair(tmp_path, NAMES, (b"old text", b"old json"))
    done = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), str(kill_at)],
                          timeout=60)
    assert done.returncode == -signal.SIGKILL
    if kill_at == 8:  # what a kill there leaves, before anything settles it
        assert _pair(tmp_path) == (b"new text", b"old json")
    settle(tmp_path)
    assert _pair(tmp_path) == pair


def test_compare_settles_a_session_folder_before_it_reads(tmp_path: Path) -> None:
    from traceml.compare.load import resolve_summary_path

    (tmp_path / "telemetry.sqlite").write_bytes(b"")  # a session folder
    save_pair(tmp_path, NAMES, (b"old text", b"old json"))
    subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), "8"], timeout=60)
    assert _pair(tmp_path) == (b"new text", b"old json")
    assert resolve_summary_path("A", str(tmp_path)) == tmp_path / "final_summary.json"
    assert _pair(tmp_path) == (b"new text", b"new json")


def test_a_crafted_journal_moves_nothing_outside_the_pair(tmp_path: Path) -> None:
    """A session folder from elsewhere (compare reads any) whose journal names other
    files: settling it renames none of them and removes the journal."""
    folder = tmp_path / "session"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine")
    (folder / ".final_summary.json.evil").write_bytes(b"planted")
    (folder / "payload").write_bytes(b"planted")
    (folder / ".final_summary.commit").write_text(
        f'{{"../victim": ".final_summary.json.evil", "{victim}": ".final_summary.json.evil",'
        ' "final_summary.txt": "../victim", "final_summary.json": "payload"}')
    settle(folder)
    assert victim.read_bytes() == b"mine"
    assert sorted(p.name for p in folder.iterdir()) == ["payload"]  # its stray temp removed


def test_settling_waits_for_a_writer_and_leaves_the_html_reports_files(tmp_path: Path) -> None:
    import fcntl
    import os
    import threading

    in_flight = tmp_path / ".final_summary.json.inflight"  # another writer's, mid-write
    html_temp = tmp_path / ".final_summary.html.abcd"  # the HTML report's, not the pair's
    in_flight.write_bytes(b"x")
    html_temp.write_bytes(b"x")
    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what the writer holds while it writes
    settler = threading.Thread(target=settle, args=(tmp_path,))
    settler.start()
    settler.join(0.5)
    assert settler.is_alive() and in_flight.exists()  # it waits for the writer
    os.close(fd)
    settler.join(30)
    assert not settler.is_alive() and not in_flight.exists() and html_temp.exists()


def test_the_wandb_and_mlflow_loader_settles_a_session_folder(tmp_path: Path) -> None:
    from traceml.integrations.summary_source import load_summary

    (tmp_path / "telemetry.sqlite").write_bytes(b"")
    save_pair(tmp_path, NAMES, (b"old text", b'{"schema_version": "1.4", "old": 1}'))
    writer = WRITER.replace('b"new json"', 'b\'{"schema_version": "1.4", "new": 1}\'')
    subprocess.run([sys.executable, "-c", writer, str(tmp_path), "8"], timeout=60)
    assert b'"old"' in (tmp_path / "final_summary.json").read_bytes()  # half a pair
    loaded = load_summary(tmp_path)
    assert (tmp_path / "final_summary.json").read_bytes() == b'{"schema_version": "1.4", "new": 1}'
    assert loaded.files[0] == tmp_path / "final_summary.json"
