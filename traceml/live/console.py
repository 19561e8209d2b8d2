"""Drive the ``--mode=cli`` view: a rich Live display refreshed about once a second (launcher).

Runs in the launcher process, in a thread beside torch's launch. Each refresh
reads the store's new rows (:class:`~traceml.live.tail.StoreTail`), builds a
snapshot and redraws; the workers' output is read from their log files. When
stdout is not a terminal the view degrades to one plain status line every
``PLAIN_INTERVAL_S`` and the workers' output is left alone.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from traceml.live.tail import StoreTail
from traceml.live.terminal import render_view, status_line
from traceml.live.worker_output import WorkerOutput
from traceml.report.page.snapshot import Snapshot, live_snapshot
from traceml.store import StoreError

REFRESH_S = 1.0
PLAIN_INTERVAL_S = 10.0
BUILD_SHARE = 0.2
"""A refresh waits at least its own last build time over this share, so the view
takes about this share of a core at most (a snapshot of 8192 ranks takes seconds,
on node 0, beside its collector)."""


class _Ticker:
    """A daemon thread that calls ``tick`` every ``interval_s`` (longer after a long
    tick: see BUILD_SHARE) until stopped.

    A view that breaks stops refreshing and says why when it is stopped: it
    must never cost the run its training or its final summary.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.error: BaseException | None = None
        self.build_s = 0.0  # the last tick's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traceml-view", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(max(self.interval_s, self.build_s / BUILD_SHARE)):
            began = time.monotonic()
            self.safe_tick()
            self.build_s = time.monotonic() - began

    def safe_tick(self, ended: bool = False) -> None:
        """``tick``, unless the view already broke; a failure is kept for ``stop``."""
        if self.error is not None:
            return
        try:
            self.tick(ended)
        except Exception as exc:  # noqa: BLE001 (a display bug must not end the run)
            self.error = exc

    def tick(self, ended: bool) -> None:
        """Refresh; ``ended``: the last time, the run is over."""
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def report_error(self) -> None:
        if self.error is not None:
            print(f"traceml: warning: the live view stopped: {self.error!r}; "
                  "the run went on", file=sys.stderr)


def read_snapshot(tail: StoreTail) -> Snapshot | None:
    """The current snapshot; None while the store cannot be read (busy for a moment)."""
    try:
        run, window_rows = tail.poll()
    except StoreError:
        return None
    return live_snapshot(run, window_rows)


class TerminalView(_Ticker):
    """The live view on a terminal; the workers' output comes from their log folder."""

    def __init__(self, db_path: Path, output: WorkerOutput, console: Console | None = None,
                 refresh_s: float = REFRESH_S) -> None:
        super().__init__(refresh_s)
        self.tail = StoreTail(db_path)
        self.output = output
        self.live = Live(console=console or Console(), auto_refresh=False, transient=False,
                         redirect_stdout=True, redirect_stderr=True)

    def _renderable(self, ended: bool) -> RenderableType | None:
        snap = read_snapshot(self.tail)
        if snap is None:
            return None
        if ended:
            snap = dataclasses.replace(snap, ended=True)
        return render_view(snap, self.output.poll(), str(self.output.log_dir))

    def tick(self, ended: bool) -> None:
        renderable = self._renderable(ended)
        if renderable is not None:
            self.live.update(renderable, refresh=True)

    def start(self) -> None:
        self.live.update(Text("traceml: starting the workers...", style="dim"), refresh=False)
        self.live.start(refresh=True)
        super().start()

    def stop(self) -> None:
        """Stop refreshing; the last frame, up to date, stays on the screen."""
        super().stop()
        self.safe_tick(ended=True)
        self.live.stop()
        self.report_error()


class PlainStatus(_Ticker):
    """The view without a terminal: a plain status line now and then."""

    def __init__(self, db_path: Path, stream: TextIO | None = None,
                 interval_s: float = PLAIN_INTERVAL_S) -> None:
        super().__init__(interval_s)
        self.tail = StoreTail(db_path)
        self.stream = stream

    def tick(self, ended: bool) -> None:
        snap = read_snapshot(self.tail)
        if snap is not None and snap.phases:
            stream = self.stream or sys.stdout
            print(status_line(snap), file=stream, flush=True)

    def stop(self) -> None:
        super().stop()
        self.report_error()
