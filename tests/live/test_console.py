"""The launcher side of --mode=cli: the refresh thread, its plain fallback, a broken view."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from tests.live.conftest import wait_for
from tests.live.test_dashboard import make_store
from traceml.live.console import PlainStatus, TerminalView
from traceml.live.worker_output import WorkerOutput


def test_terminal_view_refreshes_then_leaves_the_last_frame(tmp_path: Path) -> None:
    make_store(tmp_path / "telemetry.sqlite")
    screen = io.StringIO()
    console = Console(file=screen, width=100, height=40, force_terminal=True, color_system=None)
    view = TerminalView(tmp_path / "telemetry.sqlite", WorkerOutput(tmp_path / "w"), console,
                        refresh_s=0.05)
    view.start()
    wait_for(lambda: "r1 " in screen.getvalue(), 20, "a refresh with both ranks")
    view.stop()
    assert "| ended" in screen.getvalue().rsplit("traceml session", 1)[1]
    assert view.error is None


def test_plain_status_prints_lines(tmp_path: Path) -> None:
    make_store(tmp_path / "telemetry.sqlite")
    out = io.StringIO()
    plain = PlainStatus(tmp_path / "telemetry.sqlite", out, interval_s=0.05)
    plain.start()
    wait_for(lambda: out.getvalue().count("\n") >= 2, 20, "two status lines")
    plain.stop()
    assert out.getvalue().startswith("traceml: ") and "step r0 11, r1 11" in out.getvalue()


def test_a_broken_view_stops_refreshing_and_says_so(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    class Broken(PlainStatus):
        def tick(self, ended: bool) -> None:
            raise ZeroDivisionError("display bug")

    broken = Broken(tmp_path / "absent.sqlite", io.StringIO(), interval_s=0.01)
    broken.start()
    wait_for(lambda: broken.error is not None, 20, "the failure")
    broken.stop()
    assert "the live view stopped: ZeroDivisionError('display bug'); the run went on" in (
        capsys.readouterr().err)
