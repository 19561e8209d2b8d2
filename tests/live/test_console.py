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


class _Clock:
    """A monotonic clock the test moves (each view build takes ``build_s`` of it)."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_a_view_whose_build_takes_long_refreshes_less_often(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refresh waits its own build time over BUILD_SHARE (a snapshot of thousands of
    ranks takes seconds, on node 0): the view takes that share of a core at most."""
    from traceml.live import console

    clock = _Clock()
    monkeypatch.setattr(console, "time", clock)
    waits: list[float] = []
    builds = iter([0.05, 4.0, 4.0])

    class Stop:
        def wait(self, timeout: float) -> bool:
            waits.append(timeout)
            return len(waits) > 3

    class Timed(console._Ticker):
        def tick(self, ended: bool) -> None:
            clock.now += next(builds)

    view = Timed(console.REFRESH_S)
    view._stop = Stop()  # type: ignore[assignment]
    view._run()
    assert waits == [1.0, 1.0, pytest.approx(4.0 / console.BUILD_SHARE),
                     pytest.approx(4.0 / console.BUILD_SHARE)]
    assert console.BUILD_SHARE <= 0.25


def test_the_page_snapshot_is_rebuilt_at_most_its_build_share_of_the_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the collector process: a 2 s build is not asked again for 2 / BUILD_SHARE s,
    however often the page polls; a quick one is, each MIN_REBUILD_S.  The first poll
    of a page opened late (the backlog) does not count, and a build that fails waits
    its turn too."""
    from traceml.live import dashboard, tail

    make_store(tmp_path / "telemetry.sqlite")
    clock = _Clock()
    monkeypatch.setattr(dashboard, "time", clock)
    monkeypatch.setattr(tail, "time", clock)  # the tail times its own first read
    built = dashboard.live_snapshot
    build_s = [0.01]
    num_builds = []
    failing = []

    def timed(*args: object, **kwargs: object) -> object:
        num_builds.append(1)
        clock.now += build_s[0]
        if failing:
            raise RuntimeError("a bug in the page model")
        return built(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dashboard, "live_snapshot", timed)
    board = dashboard.Dashboard(tmp_path / "telemetry.sqlite", "dash")
    first_read = board._tail._poll

    def backlog() -> object:
        clock.now += 60.0  # the first poll of a page opened an hour in
        monkeypatch.setattr(board._tail, "_poll", first_read)
        return first_read()

    monkeypatch.setattr(board._tail, "_poll", backlog)
    try:
        first = board.snapshot()
        clock.now += dashboard.MIN_REBUILD_S
        board.snapshot()
        assert len(num_builds) == 2  # paced by the 0.01 s build, not the 60 s read
        build_s[0] = 2.0
        clock.now += dashboard.MIN_REBUILD_S
        board.snapshot()
        for _ in range(int(2.0 / dashboard.BUILD_SHARE) - 1):  # a page polling each second
            clock.now += 1.0
            last = board.snapshot()
        assert len(num_builds) == 3 and first and last
        clock.now += 1.0
        failing.append(True)
        with pytest.raises(RuntimeError):
            board.snapshot()
        clock.now += 1.0
        assert board.snapshot() == last and len(num_builds) == 4  # the last one, unbuilt
    finally:
        board.close()
