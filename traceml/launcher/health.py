"""This node's ranks seen from outside: stacks of ranks whose Python cannot run,
crash records of ranks that died, and node 0's stall alert (launcher side).

A rank reports its own stalls (`traceml.agent.watchdog`) while its sender
thread can run.  A C call that holds the GIL stops that thread too, and its
heartbeat file with it: `StackWatch` then sends `stacks.STACK_SIGNAL`, on
which the rank's faulthandler writes every thread's stack, and reports the
training thread's as a stall.  When torch's agent reports a rank dead,
`StackWatch.failed` adds the launcher's record: exit status, signal, and
the stack faulthandler wrote at a fatal signal.  Both travel with the
node's system samples (`SystemSampler`), which stop last.

`StallAlert` runs on node 0: once a stall is known (every rank has reported,
or a few seconds have passed since the first did) it prints one block naming
who stopped where and who waits, and one line when the stall clears.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psutil

from traceml import stacks
from traceml.records import Incident
from traceml.stacks import STACKS_DIR, StackFiles
from traceml.wire.envelope import Message
from traceml.wire.incidents import EXIT, STALL, IncidentReport

DUMP_WAIT_S = 3.0
"""How long faulthandler gets to write a signalled rank's stacks."""
ALERT_GRACE_S = 5.0
"""How long node 0 waits for every rank's report before printing a stall."""


@dataclass(frozen=True)
class RankFailure:
    """A rank torch's agent saw die, as its ChildFailedError lists it."""

    rank: int
    pid: int
    exit_code: int  # negative: killed by that signal
    at: float  # unix seconds


def _descendant(pid: int) -> bool:
    """Whether ``pid`` is a live process this launcher started (not a reused pid)."""
    try:
        return any(p.pid == os.getpid() for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


class StackWatch:
    """Producer of the node's sampler: stalls seen from outside and crash records."""

    def __init__(self, session_dir: Path) -> None:
        self.folder = session_dir / STACKS_DIR
        self._pending: dict[int, tuple[float, int, dict[str, Any], float]] = {}
        self._stalled: set[int] = set()  # pids reported, until their heartbeat returns
        self._reports: list[IncidentReport] = []
        self._lock = threading.Lock()

    def produce(self) -> list[Message]:
        """Sender thread, every sample interval."""
        if self.folder.is_dir():
            for path in self.folder.glob("*.json"):
                self._look(path)
        with self._lock:
            reports, self._reports = self._reports, []
        return list(reports)

    def _look(self, path: Path) -> None:
        try:
            info = orjson.loads(path.read_bytes())
            last_beat = path.stat().st_mtime  # before the signal: it lets the rank run a little
            age = time.time() - last_beat
            pid, rank, threshold = int(info["pid"]), int(info["rank"]), info["threshold_s"]
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return  # being written, or gone
        if not threshold:  # the loop has not begun, or stall reports are off
            return
        if pid in self._pending:
            self._collect(pid, rank)
        elif age <= threshold:
            self._stalled.discard(pid)
        elif pid not in self._stalled and _descendant(pid):
            files = StackFiles.of(str(self.folder.parent), rank, pid)
            try:
                offset = os.path.getsize(files.dump)
                os.kill(pid, stacks.STACK_SIGNAL)
            except OSError:
                return
            self._stalled.add(pid)
            self._pending[pid] = (time.time() + DUMP_WAIT_S, offset, info, last_beat)

    def _collect(self, pid: int, rank: int) -> None:
        """The signalled rank's stack, once faulthandler has written it (or given up)."""
        deadline, offset, info, last_beat = self._pending[pid]
        text = _read_from(StackFiles.of(str(self.folder.parent), rank, pid).dump, offset)
        frames = stacks.parse_faulthandler(text, info.get("thread"))
        if not frames and time.time() < deadline:
            return
        del self._pending[pid]
        self._add(IncidentReport(STALL, last_beat, time.time(), frames,
                                 "faulthandler" if frames else None, rank, pid))

    def failed(self, failures: list[RankFailure]) -> None:
        """torch's agent reported these ranks dead (launcher thread, after the launch)."""
        for failure in failures:
            files = StackFiles.of(str(self.folder.parent), failure.rank, failure.pid)
            frames = stacks.parse_faulthandler(_read_from(files.fatal, 0), _thread(files))
            name = _signal_name(failure.exit_code)
            detail: dict[str, str | int | float | None] = {"exit_code": failure.exit_code,
                                                           "signal": name}
            self._add(IncidentReport(EXIT, failure.at, time.time(), frames,
                                     "faulthandler" if frames else None, failure.rank,
                                     failure.pid, detail))

    def _add(self, report: IncidentReport) -> None:
        with self._lock:
            self._reports.append(report)


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


def _thread(files: StackFiles) -> int | None:
    try:
        value = orjson.loads(Path(files.heartbeat).read_bytes()).get("thread")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def _signal_name(exit_code: int) -> str | None:
    try:
        return signal.Signals(-exit_code).name if exit_code < 0 else None
    except ValueError:
        return f"signal {-exit_code}"


class StallAlert:
    """Node 0: print a stall once it is known, and when it clears (a daemon thread)."""

    def __init__(self, db_path: Path, interval_s: float = 0.5) -> None:
        self.db_path = db_path
        self.interval_s = interval_s
        self._printed: dict[tuple[int, int, float], bool] = {}  # stall -> cleared printed
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="traceml-stall-alert",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop, after one last look: a stall that cleared just before the run ended
        is still said before the summary."""
        self._stop.set()
        self._thread.join(2.0)
        self._guarded_check()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s) and self._guarded_check():
            pass

    def _guarded_check(self) -> bool:
        """:meth:`check`, never in the launcher's way: an error it did not expect is said
        once and ends the alerts (the summary still says everything); False then."""
        if self._failed:
            return False
        try:
            self.check()
            return True
        except Exception as exc:  # noqa: BLE001 - a bug here must not stop the run
            self._failed = True
            _say(f"live stall alerts stopped ({exc!r}); the summary still reports stalls")
            return False

    def _news(self, stall: Incident) -> bool:
        """Whether a stall is not printed yet, or its clearing is not."""
        printed = self._printed.get((stall.rank, stall.pid, stall.began_at))
        return printed is None if stall.cleared_at is None else printed is False

    def check(self) -> None:
        from traceml.diagnosis.ending_text import stalled_finding
        from traceml.store import StoreError, StoreReader, run_data

        if not self.db_path.exists():
            return
        try:
            with StoreReader(self.db_path) as reader:
                stalls = [i for i in reader.incidents() if i.what == "stall"]
                if not any(self._news(s) for s in stalls):
                    return
                records = reader.records()
        except StoreError:
            return
        # What the finding needs of the run: who is in it (not its steps: the store
        # may be large, and this runs twice a second).
        run = run_data(records, (), (), (), tuple(stalls))
        cleared = []
        for s in stalls:
            key = (s.rank, s.pid, s.began_at)
            if s.cleared_at is not None and self._printed.get(key) is False:
                self._printed[key] = True
                cleared.append(f"r{s.rank} after {s.cleared_at - s.began_at:.1f} s")
        if cleared:
            _say(f"the stall cleared: steps resumed ({', '.join(cleared)})")
        open_stalls = [s for s in stalls if s.cleared_at is None]
        active = [s for s in open_stalls if (s.rank, s.pid, s.began_at) not in self._printed]
        if not active:
            return
        known = {s.rank for s in open_stalls}
        first = min(s.detected_at for s in active)
        if len(known) < run.meta.world_size and time.time() - first < ALERT_GRACE_S:
            return
        finding = stalled_finding(open_stalls, run, time.time())
        for s in active:
            self._printed[(s.rank, s.pid, s.began_at)] = False
        _say(f"STALLED: {finding.why}\n  Next: {finding.next}")


def _say(message: str) -> None:
    print(f"traceml: {message}", file=sys.stderr, flush=True)
