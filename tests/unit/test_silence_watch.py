"""Node 0's silence watch: a node whose launcher went quiet is named before its
partial summary is written, and a summary that cannot be written is said in one
line, without ending the watch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.rows import step_record
from traceml.launcher.nodes import SilenceWatch
from traceml.protocol import RunStart, Sender
from traceml.report import session
from traceml.store import SenderState, StoreWriter

RANK = Sender(role="rank", host="h0", pid=10, node_rank=0, rank=0, local_rank=0, world_size=2)
NODE0 = Sender(role="system", host="h0", pid=9, node_rank=0)
NODE1 = Sender(role="system", host="h1", pid=19, node_rank=1)


def _store(folder: Path) -> None:
    now = time.time()
    writer = StoreWriter(str(folder / "telemetry.sqlite"))
    writer.save_run(RunStart(session_id="s", command=("traceml", "run", "t.py"), started_at=now,
                             traceml_version="9", torch_version="2", python_version="3.11",
                             summary_window_rows=50, mode="run", expected_world_size=2,
                             expected_nodes=2))
    writer.save_sender(SenderState(RANK, now - 60, now))
    writer.save_sender(SenderState(NODE0, now - 60, now + 3600))  # node 0 speaks throughout
    writer.save_sender(SenderState(NODE1, now - 60, now - 30))  # node 1: silent for 30 s
    writer.add_steps(RANK, [step_record(s, t_begin=now - 60 + s, total_ms=10.0) for s in range(5)])
    writer.close()


def _watch(folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    watch = SilenceWatch(folder, silent_after_s=15)
    watch.start()
    said = ""
    try:
        def finished() -> bool:
            nonlocal said
            said += capsys.readouterr().err
            return "partial summary written" in said or "cannot write" in said
        assert wait_until(finished, 20, 0.05), said
    finally:
        watch.stop()
        watch.join(5)
    assert not watch.is_alive()
    return said


def test_the_silent_node_is_named_before_its_summary_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _store(tmp_path)
    write = session.write_summary
    said_first: list[str] = []

    def writing(*args: Any, **kwargs: Any) -> session.SummaryFiles:
        said_first.append(capsys.readouterr().err)  # what was said before the writing
        return write(*args, **kwargs)

    monkeypatch.setattr(session, "write_summary", writing)
    said = _watch(tmp_path, capsys)
    assert "traceml: node 1 (h1) stopped reporting 15 s ago" in said_first[0]
    assert "partial summary written to" in said
    assert (tmp_path / "final_summary.json").exists()


def test_a_summary_that_cannot_be_written_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _store(tmp_path)

    def full_disk(*args: Any, **kwargs: Any) -> session.SummaryFiles:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(session, "write_summary", full_disk)
    said = _watch(tmp_path, capsys)
    assert "traceml: cannot write the partial summary: [Errno 28] No space left on device\n" in said
    assert "Traceback" not in said
