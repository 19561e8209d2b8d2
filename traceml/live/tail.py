"""Follow the growing store: new rows since the last poll, recent rows kept (live views).

Runs in the launcher (``--mode=cli``) and in the collector's dashboard thread
(``--mode=dashboard``), about once a second. Each poll opens its own read-only
connection (WAL lets it read while the collector writes), reads only rows added
since the previous poll (by rowid; a stored step is never replaced), of those
steps only each rank's newest that it can keep (a late first poll, or one after
a long build, skips the rest of the backlog), and keeps the last ``steps_kept``
steps per rank and the last ``samples_kept`` samples per rank and node, so
memory and work stay bounded however long the run is.  A poll makes its rows
with the cycle collector paused (`traceml.store.paused_gc`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from traceml.records import (
    Capture,
    FlopCount,
    Incident,
    ProcessSample,
    RunData,
    StepRow,
    SystemSample,
)
from traceml.report.page.snapshot import live_window_steps
from traceml.report.session import summary_window
from traceml.store import RunRecords, StoreReader, paused_gc, run_data

LIVE_STEPS_KEPT = 300
"""Steps per rank a live view keeps (its charts' x range)..."""

LIVE_ROWS_KEPT = 19_200
"""...fewer beyond 64 ranks: about this many rows in all, and at least twice the live
window (:func:`~traceml.report.page.snapshot.live_window_steps`), so the launcher's or
collector's memory stays bounded at thousands of ranks."""

LIVE_SAMPLES_KEPT = 60
"""Process samples per rank and system samples per node a live view keeps."""

_Sample = TypeVar("_Sample", ProcessSample, SystemSample)


class StoreTail:
    """Incremental, bounded reader of one session's ``telemetry.sqlite``."""

    def __init__(self, db_path: Path, steps_kept: int = LIVE_STEPS_KEPT,
                 samples_kept: int = LIVE_SAMPLES_KEPT) -> None:
        self.db_path = db_path
        self.steps_kept = steps_kept
        self.samples_kept = samples_kept
        self._kept = steps_kept
        self._steps_after = self._process_after = self._system_after = 0  # rowids read
        self._steps: dict[int, dict[int, StepRow]] = {}
        self._restart: dict[int, int] = {}
        self._process: dict[int, deque[ProcessSample]] = {}
        self._system: dict[int, deque[SystemSample]] = {}
        self._incidents: tuple[Incident, ...] = ()
        self._flop_counts: tuple[FlopCount, ...] = ()
        self._captures: tuple[Capture, ...] = ()
        self._polled = False
        self.backlog_s = 0.0  # the last poll's time when it was the first, else 0

    def poll(self) -> tuple[RunData, int]:
        """The recent run (rows read so far, bounded) and the summary window it asked
        for.  The first one's time is kept (`backlog_s`): it reads a backlog once (a
        page opened late in a run), which is not what a view's next builds cost."""
        began = time.monotonic()
        with paused_gc():  # the first poll of a wide job makes a row object per step read
            out = self._poll()
        self.backlog_s = 0.0 if self._polled else time.monotonic() - began
        self._polled = True
        return out

    def _poll(self) -> tuple[RunData, int]:
        with StoreReader(self.db_path) as reader:
            records = reader.records()
            num_senders = max(1, len(records.senders))  # ranks and each node's sampler
            self._kept = self.kept_steps(len({s.sender.rank for s in records.senders
                                              if s.sender.rank is not None}))
            # Each rank's newest steps that can be kept: a late first poll, or one after
            # a long build, skips the rest of the backlog.  Chosen among as many blocks
            # as twice the steps every sender (node samplers and relays too) could keep,
            # at one step a block: a rank whose newest steps are older than those (one
            # that stopped long ago) is left out of a late first poll.  Newer samples
            # than this cannot all be kept either.
            steps = reader.newest_steps_after(self._steps_after, self._kept,
                                              2 * num_senders * self._kept)
            most = 2 * num_senders * self.samples_kept
            process = reader.process_after(self._process_after, most)
            system = reader.system_after(self._system_after, most)
            self._incidents = reader.incidents()  # few: stalls and crashes, read whole
            self._flop_counts = reader.flop_counts()  # a few rows per rank
            self._captures = reader.captures()  # a few per run
        self._steps_after = steps.last_row_id
        self._process_after = process.last_row_id
        self._system_after = system.last_row_id
        self._add_steps(steps.rows)
        for sample in process.rows:
            self._add_sample(self._process, sample, sample.rank)
        for system_sample in system.rows:
            self._add_sample(self._system, system_sample, system_sample.node_rank)
        return self._run(records), summary_window(records.start)

    def kept_steps(self, num_ranks: int) -> int:
        """Steps kept per rank with ``num_ranks`` ranks (see LIVE_ROWS_KEPT)."""
        floor = 2 * live_window_steps(num_ranks)
        return min(self.steps_kept, max(floor, LIVE_ROWS_KEPT // max(1, num_ranks)))

    def _add_steps(self, new: Sequence[StepRow]) -> None:
        """Keep the newest steps of each rank's latest attempt, ``self._kept`` of them."""
        touched = set()
        for row in new:
            rank, restart = row.rank, row.restart
            if restart < self._restart.get(rank, restart):
                continue  # a late row of an earlier attempt
            if restart > self._restart.get(rank, restart):
                self._steps.pop(rank, None)  # a restarted rank counts its steps from 0 again
            self._restart[rank] = restart
            self._steps.setdefault(rank, {})[row.step] = row
            touched.add(rank)
        for rank in touched:
            rows = self._steps[rank]
            if len(rows) > self._kept:
                for step in sorted(rows)[: len(rows) - self._kept]:
                    del rows[step]

    def _add_sample(self, kept: dict[int, deque[_Sample]], sample: _Sample, key: int) -> None:
        kept.setdefault(key, deque(maxlen=self.samples_kept)).append(sample)

    def _run(self, records: RunRecords) -> RunData:
        steps = tuple(row for rank in sorted(self._steps)
                      for _, row in sorted(self._steps[rank].items()))
        process = tuple(sorted((s for q in self._process.values() for s in q),
                               key=lambda s: s.t))
        system = tuple(sorted((s for q in self._system.values() for s in q), key=lambda s: s.t))
        return dataclasses.replace(run_data(records, steps, process, system, self._incidents),
                                   flop_counts=self._flop_counts, captures=self._captures)
