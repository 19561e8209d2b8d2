"""Follow the growing store: new rows since the last poll, recent rows kept (live views).

Runs in the launcher (``--mode=cli``) and in the collector's dashboard thread
(``--mode=dashboard``), about once a second. Each poll opens its own read-only
connection (WAL lets it read while the collector writes), reads only rows added
since the previous poll (by rowid: a replaced step gets a new rowid, so it is
read again) and keeps the last ``steps_kept`` steps per rank and the last
``samples_kept`` samples per rank and node, so memory and work stay bounded
however long the run is.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

from traceml.diagnosis.samples import ProcessSample, RunData, StepRow, SystemSample
from traceml.report.session import (
    DEFAULT_WINDOW_ROWS,
    process_sample,
    run_meta,
    step_row,
    system_sample,
)
from traceml.store import StoreReader

LIVE_STEPS_KEPT = 300
"""Steps per rank a live view keeps (its charts' x range)."""

LIVE_SAMPLES_KEPT = 60
"""Process samples per rank and system samples per node a live view keeps."""


class StoreTail:
    """Incremental, bounded reader of one session's ``telemetry.sqlite``."""

    def __init__(self, db_path: Path, steps_kept: int = LIVE_STEPS_KEPT,
                 samples_kept: int = LIVE_SAMPLES_KEPT) -> None:
        self.db_path = db_path
        self.steps_kept = steps_kept
        self.samples_kept = samples_kept
        self._after = {"steps": 0, "process": 0, "system": 0}
        self._steps: dict[int, dict[int, StepRow]] = {}
        self._restart: dict[int, int] = {}
        self._process: dict[int, deque[ProcessSample]] = {}
        self._system: dict[int, deque[SystemSample]] = {}

    def poll(self) -> tuple[RunData, int]:
        """The recent run (rows read so far, bounded) and the summary window it asked for."""
        reader = StoreReader(str(self.db_path))
        try:
            senders = [dict(r) for r in reader.senders()]
            # Newer rows than this cannot all be kept: a late first poll skips the backlog.
            most = 2 * max(1, len(senders))
            for row in self._new_rows(reader, "steps", most * self.steps_kept):
                self._add_step(row)
            for row in self._new_rows(reader, "process", most * self.samples_kept):
                self._add_sample(self._process, process_sample(row), row["rank"])
            for row in self._new_rows(reader, "system", most * self.samples_kept):
                self._add_sample(self._system, system_sample(row), row["node_rank"])
            meta, rejected = reader.meta(), reader.rejected()
        finally:
            reader.close()
        return self._run(meta, senders, rejected), int(
            meta.get("summary_window_rows") or DEFAULT_WINDOW_ROWS)

    def _new_rows(self, reader: StoreReader, table: str, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` rows added since the last poll, oldest first."""
        rows = [dict(r) for r in reader.db.execute(
            f"SELECT * FROM (SELECT rowid AS row_id, * FROM {table} WHERE rowid > ? "
            "ORDER BY rowid DESC LIMIT ?) ORDER BY row_id", (self._after[table], limit))]
        if rows:
            self._after[table] = rows[-1]["row_id"]
        return rows

    def _add_step(self, row: dict[str, Any]) -> None:
        rank, restart = row["rank"], row["restart"]
        if restart < self._restart.get(rank, restart):
            return  # a late row of an earlier attempt
        if restart > self._restart.get(rank, restart):
            self._steps.pop(rank, None)  # a restarted rank counts its steps from 0 again
        self._restart[rank] = restart
        rows = self._steps.setdefault(rank, {})
        rows[row["step"]] = step_row(row)
        if len(rows) > self.steps_kept:
            for step in sorted(rows)[: len(rows) - self.steps_kept]:
                del rows[step]

    def _add_sample(self, kept: dict[int, deque[Any]], sample: Any, key: int) -> None:
        kept.setdefault(key, deque(maxlen=self.samples_kept)).append(sample)

    def _run(self, meta: dict[str, Any], senders: list[dict[str, Any]],
             rejected: dict[str, int]) -> RunData:
        steps = tuple(row for rank in sorted(self._steps)
                      for _, row in sorted(self._steps[rank].items()))
        process = tuple(sorted((s for q in self._process.values() for s in q),
                               key=lambda s: s.t))
        system = tuple(sorted((s for q in self._system.values() for s in q), key=lambda s: s.t))
        return RunData(run_meta(meta, senders, steps, process, rejected), steps, process, system)
