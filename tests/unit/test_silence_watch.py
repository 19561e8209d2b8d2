"""Node 0's silence watch: a node whose launcher went quiet is named before its
partial summary is written; a summary that cannot be written is said in one line,
and the watch goes on; stopping it waits for a partial summary being written, so
the final summary, written after, is the one that stays."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.rows import sent_by, step_record
from traceml.launcher import nodes
from traceml.launcher.nodes import SilenceWatch
from traceml.report import session
from traceml.store import SenderState, StoreWriter
from traceml.wire.identity import Sender
from traceml.wire.records import RunStart

RANK = Sender(role="rank", host="h0", pid=10, node_rank=0, rank=0, local_rank=0, world_size=2)
NODE0 = Sender(role="system", host="h0", pid=9, node_rank=0)
NODE1 = Sender(role="system", host="h1", pid=19, node_rank=1)


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    lines: list[str] = []
    monkeypatch.setattr(nodes, "_say", lines.append)
    return lines


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
    writer.add_steps(sent_by(RANK, [step_record(s, t_begin=now - 60 + s, total_ms=10.0) for s in range(5)]))
    writer.close()


def _watch(folder: Path, said: list[str], last: str) -> None:
    """Run the watch until it has said a line starting with ``last``."""
    watch = SilenceWatch(folder, silent_after_s=15)
    watch.start()
    try:
        assert wait_until(lambda: any(line.startswith(last) for line in said), 20), said
        assert watch.is_alive()  # it goes on watching
    finally:
        watch.stop()
    assert not watch.is_alive()


def test_the_silent_node_is_named_before_its_summary_is_written(
        tmp_path: Path, said: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _store(tmp_path)
    write = session.write_summary
    said_first: list[str] = []

    def writing(*args: Any, **kwargs: Any) -> session.SummaryFiles:
        said_first.extend(said)  # what was said before the summary was written
        return write(*args, **kwargs)

    monkeypatch.setattr(session, "write_summary", writing)
    _watch(tmp_path, said, "partial summary written to")
    assert said_first == ["node 1 (h1) stopped reporting 15 s ago; writing a partial summary"]
    assert said[-1] == f"partial summary written to {tmp_path / 'final_summary.json'}"
    assert (tmp_path / "final_summary.json").exists()


def test_a_summary_that_cannot_be_written_is_one_line(
        tmp_path: Path, said: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _store(tmp_path)

    def full_disk(*args: Any, **kwargs: Any) -> session.SummaryFiles:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(session, "write_summary", full_disk)
    _watch(tmp_path, said, "cannot write")
    assert said[-1] == "cannot write the partial summary: [Errno 28] No space left on device"


def test_stopping_waits_for_the_partial_summary_being_written(
        tmp_path: Path, said: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _store(tmp_path)
    writing = threading.Event()
    write = session.write_summary

    def slow(*args: Any, **kwargs: Any) -> session.SummaryFiles:
        writing.set()
        watch.done.wait(20)  # a wide job's summary takes seconds: still writing at stop()
        return write(*args, **kwargs)

    monkeypatch.setattr(session, "write_summary", slow)
    watch = SilenceWatch(tmp_path, silent_after_s=15)
    watch.start()
    assert writing.wait(20)
    watch.stop()  # the run ended: the launcher writes the final summary next
    assert not watch.is_alive() and (tmp_path / "final_summary.json").exists()
