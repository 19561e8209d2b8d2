"""Profiler captures planned on node 0: from a live finding held for a few live windows,
or from ``traceml capture`` (collector process, off the message loop).

A thread reads the store (`StoreTail`) and builds the live report's Step Time
section (every trigger is one of its findings), at most every
`EVAL_S` and never more than `BUILD_SHARE` of its time (node 0's collector shares its
core with the message loop).  A finding that names a rank with
confidence (a straggler of one phase, COMMUNICATION-BOUND, outlier steps; warn or crit)
and names the same rank in `HOLD` builds in a row is the trigger: the named rank (the
suspect) and a reference rank (the median rank of the others' typical step) are asked
to profile the same steps, starting `LEAD_S` of steps ahead of the furthest of the two,
so both ranks have the ask before the step.  One capture per finding kind per run, one
at a time.  The collector's loop publishes the asks (`traceml.collector.server`).
"""

from __future__ import annotations

import math
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from traceml.diagnosis.finding import Finding
from traceml.live.metrics import FINDING_PHASES
from traceml.live.tail import StoreTail
from traceml.records import Capture, RunData
from traceml.report.page.snapshot import live_step_time
from traceml.store import StoreError
from traceml.wire.captures import MAX_CAPTURE_STEPS, CaptureAsk

TRIGGERS = ("COMPUTE_STRAGGLER", "INPUT_STRAGGLER", "HOST_STRAGGLER", "STRAGGLER",
            "OUTLIER_STEPS", "COMMUNICATION_BOUND")
"""The findings that ask for a capture, when actionable (warn or crit), first first: a
straggler's cause is its own, while the others' communication waits for it."""
STRAGGLERS = frozenset(TRIGGERS[:4])
"""Once one of these was captured, COMMUNICATION-BOUND asks for none: the others' wait
in the collectives is that straggler's lateness, which its capture already shows."""
HOLD = 3  # live builds in a row that name the same rank
EVAL_S = 3.0  # the live report is built at most this often
BUILD_SHARE = 0.05  # ...and takes at most this share of a core (at 1024 ranks a build
# takes ~0.4 s: one every 8 s)
LEAD_S = 3.0  # the first profiled step starts this far ahead of the ranks' last stored step
MIN_LEAD_STEPS = 3
ASK_TIMEOUT_S = 120.0  # an ask not answered by then no longer holds the next one back


class CaptureTrigger:
    """The captures of one run (see the module docstring)."""

    def __init__(self, db_path: Path, auto: bool, steps: int, max_bytes: int) -> None:
        self.db_path = db_path
        self.auto = auto
        self.steps = steps
        self.max_bytes = max_bytes
        self._tail = StoreTail(db_path)
        self._planned: queue.SimpleQueue[tuple[CaptureAsk, list[Capture]]] = queue.SimpleQueue()
        self._requests: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traceml-captures", daemon=True)
        self._held: dict[str, tuple[int, int]] = {}  # kind -> (rank, builds in a row)
        self._done: set[str] = set()  # the kinds that captured
        self._open_until = 0.0  # the last ask holds the next one back until then...
        self._open_id: str | None = None  # ...or until every rank it asked has reported
        self._num_asked = 0
        self._failed = False
        self._is_local: Callable[[int], bool] = lambda rank: True

    # -- the collector's loop --------------------------------------------------------

    def start(self, is_local: Callable[[int], bool] = lambda rank: True) -> None:
        self._is_local = is_local
        self._thread.start()

    def request(self, payload: Any) -> None:
        """``traceml capture``'s request, ``{"op": "capture", "rank": R, "steps": K}``;
        ValueError when malformed."""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise ValueError("not JSON") from None
        rank, steps = (obj.get("rank"), obj.get("steps")) if isinstance(obj, dict) else (0, 0)
        if (not isinstance(obj, dict) or obj.get("op") != "capture" or type(rank) is not int
                or not 0 <= rank < 2**20 or type(steps) is not int
                or not 1 <= steps <= MAX_CAPTURE_STEPS):
            raise ValueError("not a capture request")
        self._requests.put((rank, steps))
        self._wake.set()

    def take(self) -> list[tuple[CaptureAsk, list[Capture]]]:
        out = []
        while True:
            try:
                out.append(self._planned.get_nowait())
            except queue.Empty:
                return out

    def finish(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5.0)

    # -- its thread --------------------------------------------------------------------

    def _run(self) -> None:
        next_build = 0.0
        while not self._stop.is_set():
            self._wake.wait(0.2)
            self._wake.clear()
            manual = []
            while not self._requests.empty():
                manual.append(self._requests.get_nowait())
            now = time.monotonic()
            if not manual and (not self.auto or now < next_build):
                continue
            began = time.monotonic()
            try:
                run, window_rows = self._tail.poll()
                for rank, steps in manual:
                    self._plan(run, rank, steps, "manual", "manual", None)
                if self.auto and now >= next_build and run.steps:
                    # every trigger is a Step Time finding: its section alone is built
                    self._watch(run, live_step_time(run, window_rows).findings)
            except StoreError:
                pass  # busy for a moment: the next build
            except Exception as exc:  # never the collector's end: said once
                if not self._failed:
                    self._failed = True
                    print(f"traceml collector: warning: captures not planned: {exc!r}",
                          file=sys.stderr, flush=True)
            spent = time.monotonic() - began
            next_build = time.monotonic() + max(EVAL_S, spent / BUILD_SHARE)

    def _watch(self, run: RunData, findings: Sequence[Finding]) -> None:
        """Count how long each trigger has named its rank; ask once it held."""
        seen: set[str] = set()
        asked = [c for c in run.captures if c.capture_id == self._open_id]
        if asked and all(c.reported_at is not None for c in asked):
            self._open_until = 0.0  # every rank asked has reported: the next may be asked
        ranked = sorted((f for f in findings if f.kind in TRIGGERS and f.actionable),
                        key=lambda f: TRIGGERS.index(f.kind))
        for f in ranked:
            if f.kind in seen:
                continue
            seen.add(f.kind)
            rank = f.ranks[0] if f.ranks else _busiest_rank(run, f.kind)
            if rank is None:
                continue
            last, n = self._held.get(f.kind, (rank, 0))
            n = n + 1 if last == rank else 1
            self._held[f.kind] = (rank, n)
            shadow = f.kind == "COMMUNICATION_BOUND" and bool(self._done & STRAGGLERS)
            if (n >= HOLD and f.kind not in self._done and not shadow
                    and time.monotonic() >= self._open_until):
                label = f"{f.label} r{rank}" if f.ranks else f.label
                if self._plan(run, rank, self.steps, f.kind, label,
                              FINDING_PHASES.get(f.kind)):
                    self._done.add(f.kind)
        for kind in set(self._held) - seen:
            del self._held[kind]

    def _plan(self, run: RunData, rank: int, steps: int, trigger: str, label: str,
              phase: str | None) -> bool:
        """Ask ``rank`` and the reference rank for ``steps`` steps; False when the rank
        has no steps yet."""
        last = _last_steps(run)
        if rank not in last or not self._is_local(rank):
            return False  # no step yet; or behind a relay, which forwards no asks
        reference = _reference_rank(run, rank, self._is_local)
        ranks = (rank,) if reference is None else (rank, reference)
        step_s = _typical_step_s(run, ranks)
        lead = max(MIN_LEAD_STEPS, math.ceil(LEAD_S / step_s) if step_s > 0 else MIN_LEAD_STEPS)
        start_after = max(last[r] + 1 for r in ranks if r in last) + lead
        self._num_asked += 1
        ask = CaptureAsk(f"c{self._num_asked}-{trigger.lower()}", ranks, start_after, steps,
                         self.max_bytes)
        now = time.time()
        rows = [Capture(ask.capture_id, r, "suspect" if r == rank else "reference", trigger,
                        label, phase, now, start_after, steps) for r in ranks]
        self._planned.put((ask, rows))
        self._open_id = ask.capture_id
        self._open_until = time.monotonic() + min(ASK_TIMEOUT_S, LEAD_S + 30 * steps * step_s
                                                  + 30.0)
        return True


def _last_steps(run: RunData) -> dict[int, int]:
    last: dict[int, int] = {}
    for row in run.steps:
        if row.step > last.get(row.rank, -1):
            last[row.rank] = row.step
    return last


def _rank_medians(run: RunData) -> dict[int, float]:
    totals: dict[int, list[float]] = {}
    for row in run.steps:
        totals.setdefault(row.rank, []).append(row.total_ms)
    return {rank: statistics.median(v[-50:]) for rank, v in totals.items()}


def _reference_rank(run: RunData, suspect: int,
                    is_local: Callable[[int], bool] = lambda rank: True) -> int | None:
    """The rank whose typical step is the median of the other ranks' that can be asked
    (None: no other)."""
    others = sorted((ms, rank) for rank, ms in _rank_medians(run).items()
                    if rank != suspect and is_local(rank))
    return others[(len(others) - 1) // 2][1] if others else None


def _typical_step_s(run: RunData, ranks: Sequence[int]) -> float:
    medians = _rank_medians(run)
    values = [medians[r] for r in ranks if r in medians]
    return max(values) / 1e3 if values else 0.0


def _busiest_rank(run: RunData, kind: str) -> int | None:
    """A finding of the whole job (COMMUNICATION-BOUND): the rank with the longest
    typical step is the one profiled."""
    medians = _rank_medians(run)
    return max(medians, key=lambda r: medians[r]) if medians else None
