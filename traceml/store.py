"""The session's SQLite store, ``logs/<session>/telemetry.sqlite``, and every SQL
statement traceml runs (shared: the collector writes it; the launcher, offline
analysis and the live views read it).

WAL journal, batched transactions.  One table per kind of record; the steps
table has one column per phase of `traceml.phases`; the meta table holds the
launcher's `RunStart` and `RunEnd` (one JSON value per field, keyed by the
field's name) and the nodes whose options did not match (``join_error/<t>``).
`StoreWriter` takes typed records; `StoreReader` gives back `RunData` and the
same records: every row, what a summary over its window reads (that window's
rows, the samples taken while it ran, and per-rank sums over the whole run in
SQL: `StoreReader.window_run`), or the rows added since a rowid (the live
views' tail).
Whatever SQLite raises comes out as `StoreError`.  A stored row whose values
no collector writes (a string for a time, NaN, a world of 10^12 ranks: the
file was edited or damaged) is skipped and counted with the rejections, so a
summary always builds from what is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, TypeVar

import orjson

from traceml import phases, stacks
from traceml.diagnosis.ending import RAM_LOOKBACK_S
from traceml.diagnosis.samples import (
    TOTALED,
    FlopCount,
    GpuSample,
    Incident,
    NodeInfo,
    ProcessSample,
    RankTotals,
    RunData,
    RunMeta,
    StepRow,
    SystemSample,
    totals_of,
)
from traceml.diagnosis.thresholds import WARMUP_FRACTION, WARMUP_MAX_STEPS
from traceml.diagnosis.window import num_aligned, select_window, tail_decides, window_steps
from traceml.errors import ProtocolError
from traceml.protocol import (
    MAX_WORLD_SIZE,
    PROCESS_FIELDS,
    SYSTEM_FIELDS,
    RunEnd,
    RunStart,
    Sender,
    record_from_json,
    record_to_json,
)

STORE_FILENAME = "telemetry.sqlite"
SCHEMA_VERSION = 4  # 2: a column per phase (communication), collective_ms
# 3: samples, tokens, flops, flops_counted, boundary, eval_ms, num_eval per step; the
# flop_counts and incidents tables
# 4: indexes on process(t) and system(t), for the summary's bounded read (a store
# without them reads the same, scanning those tables)
JOIN_ERROR_PREFIX = "join_error/"


class StoreError(Exception):
    """The store cannot be read or written (missing, not a store, busy, malformed)."""


@dataclass(frozen=True)
class StepRecord:
    """One finished step of a rank as the collector stores it (times in ms)."""

    step: int
    t_begin: float  # unix seconds
    total_ms: float
    wait_ms: float
    phase_ms: tuple[float, ...]  # per phase of `traceml.phases.PHASES`
    counts: tuple[int, ...]  # calls per phase
    num_skipped: int = 0  # GradScaler steps that skipped the update
    rss_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    gpu_ms: tuple[float | None, ...] = ()  # per GPU-timed phase; empty off CUDA
    collective_ms: float | None = None  # any collective in flight; None: none timed
    samples: int | None = None  # in the step's batches; None: not measured
    tokens: int | None = None
    flops: float | None = None  # per step, from the latest count; None: not known
    flops_counted: bool = False  # the FLOP counter ran in this step
    boundary: str = phases.STEP_BOUNDARIES[0]  # what ended the step
    eval_ms: float = 0.0  # evaluation wall time that ended where the step began
    num_eval: int = 0  # ...in this many evaluation passes

    def values(self) -> tuple[Any, ...]:
        """The record in :data:`STEP_COLUMNS` order."""
        gpu = self.gpu_ms or (None,) * len(phases.gpu_timed())
        return (self.step, self.t_begin, self.total_ms, self.wait_ms, *self.phase_ms,
                *self.counts, self.num_skipped, self.rss_bytes, self.peak_allocated_bytes,
                self.peak_reserved_bytes, *gpu, self.collective_ms, self.samples, self.tokens,
                self.flops, int(self.flops_counted), self.boundary, self.eval_ms, self.num_eval)

    def columns(self) -> dict[str, Any]:
        """The record by :data:`STEP_COLUMNS` name."""
        return dict(zip(STEP_COLUMNS, self.values()))


STEP_COLUMNS: tuple[str, ...] = (
    "step", "t_begin", "total_ms", "wait_ms",
    *(p.column for p in phases.PHASES), *(p.count_column for p in phases.PHASES),
    "num_skipped", "rss_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
    *(p.gpu_column for p in phases.gpu_timed()), "collective_ms",
    "samples", "tokens", "flops", "flops_counted", "boundary", "eval_ms", "num_eval",
)
"""The steps table's columns after (rank, restart, node_rank), from the phase table."""


@dataclass
class SenderState:
    """One sender as the collector tracks it between messages: a row of ``senders``."""

    sender: Sender
    first_seen: float  # unix seconds
    last_seen: float
    num_messages: int = 0
    num_gaps: int = 0
    last_seq: int = -1
    num_sent: int = 0
    num_dropped: int = 0
    said_bye: bool = False

    def counters(self) -> list[Any]:
        """Every field after ``sender``, in order: how a relay forwards a state
        (``SenderState(sender, *counters)`` takes it back), how it is stored."""
        return [self.first_seen, self.last_seen, self.num_messages, self.num_gaps,
                self.last_seq, self.num_sent, self.num_dropped, self.said_bye]


@dataclass(frozen=True, order=True)
class JoinError:
    """A node whose options did not match node 0's, as the collector answered it."""

    at: float  # unix seconds
    problem: str  # the one line both launchers print


@dataclass(frozen=True)
class RunRecords:
    """What the store holds about the run besides its samples."""

    start: RunStart | None  # None: the launcher's record never arrived
    end: RunEnd | None  # None: the run has not ended (or its launcher died)
    senders: tuple[SenderState, ...]
    rejected: Mapping[str, int]  # messages dropped, by reason


@dataclass(frozen=True)
class StoredStep:
    """A step row and the attempt (restart) of its rank that ran it."""

    restart: int
    row: StepRow


_T = TypeVar("_T")


@dataclass(frozen=True)
class NewRows(Generic[_T]):
    """Rows added after a rowid, oldest first, and the rowid to read after next time."""

    rows: tuple[_T, ...]
    last_row_id: int


_STEP_INT = {"step", "num_skipped", "num_eval", "rss_bytes", "peak_allocated_bytes",
             "peak_reserved_bytes", *(p.count_column for p in phases.PHASES), "samples", "tokens",
             "flops_counted"}
_FLOP_COUNT_COLUMNS = ("t", "flops", "dtype", "dtype_share", "device_name", "sm_count",
                       "reason", "ran")

_STEP_TYPE = {"boundary": "TEXT"}

_SENDER_COLUMNS = ("sender_id", "role", "host", "pid", "node_rank", "rank", "local_rank",
                   "world_size", "restart", "first_seen", "last_seen", "num_messages",
                   "num_gaps", "last_seq", "num_sent", "num_dropped", "said_bye")

_DDL = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS senders (
        sender_id TEXT PRIMARY KEY, role TEXT NOT NULL, host TEXT NOT NULL,
        pid INTEGER NOT NULL, node_rank INTEGER NOT NULL, rank INTEGER,
        local_rank INTEGER, world_size INTEGER, restart INTEGER NOT NULL,
        first_seen REAL NOT NULL, last_seen REAL NOT NULL,
        num_messages INTEGER NOT NULL DEFAULT 0, num_gaps INTEGER NOT NULL DEFAULT 0,
        last_seq INTEGER NOT NULL DEFAULT -1, num_sent INTEGER NOT NULL DEFAULT 0,
        num_dropped INTEGER NOT NULL DEFAULT 0, said_bye INTEGER NOT NULL DEFAULT 0)""",
    "CREATE TABLE IF NOT EXISTS steps (rank INTEGER NOT NULL, restart INTEGER NOT NULL, "
    "node_rank INTEGER NOT NULL, "
    + ", ".join(f"{c} {_STEP_TYPE.get(c, 'INTEGER' if c in _STEP_INT else 'REAL')}"
                for c in STEP_COLUMNS)
    + ", PRIMARY KEY (rank, restart, step))",
    "CREATE TABLE IF NOT EXISTS flop_counts (rank INTEGER NOT NULL, restart INTEGER NOT NULL, "
    "node_rank INTEGER NOT NULL, t REAL NOT NULL, flops REAL, dtype TEXT, dtype_share REAL, "
    "device_name TEXT, sm_count INTEGER, reason TEXT, ran INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS rejected (reason TEXT PRIMARY KEY, count INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS process (rank INTEGER NOT NULL, restart INTEGER NOT NULL, "
    "node_rank INTEGER NOT NULL, t REAL NOT NULL, cpu_pct REAL, rss_bytes INTEGER, "
    "host_ram_total_bytes INTEGER, num_cpus INTEGER, device_allocated_bytes INTEGER, "
    "device_reserved_bytes INTEGER, device_total_bytes INTEGER)",
    "CREATE TABLE IF NOT EXISTS system (node_rank INTEGER NOT NULL, host TEXT NOT NULL, "
    "t REAL NOT NULL, cpu_pct REAL, ram_pct REAL, ram_total_bytes INTEGER, gpus TEXT)",
    # The summary reads the samples taken while its window ran (the steps table's
    # primary key already orders each rank's steps).
    "CREATE INDEX IF NOT EXISTS process_t ON process (t)",
    "CREATE INDEX IF NOT EXISTS system_t ON system (t)",
    "CREATE TABLE IF NOT EXISTS incidents (what TEXT NOT NULL, rank INTEGER NOT NULL, "
    "node_rank INTEGER NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, "
    "began_at REAL NOT NULL, detected_at REAL NOT NULL, cleared_at REAL, step INTEGER, "
    "phase TEXT, open_phases TEXT NOT NULL, stack TEXT NOT NULL, stack_source TEXT, "
    "detail TEXT NOT NULL)",
]

_INCIDENT_COLUMNS = ("what", "rank", "node_rank", "host", "pid", "began_at", "detected_at",
                     "cleared_at", "step", "phase", "open_phases", "stack", "stack_source",
                     "detail")


def _insert(table: str, columns: Sequence[str], verb: str = "INSERT") -> str:
    return (f"{verb} INTO {table} ({', '.join(columns)}) "
            f"VALUES ({', '.join('?' * len(columns))})")


# A stored step is never replaced: a second row for it is a duplicate.
_STEPS_SQL = _insert("steps", ("rank", "restart", "node_rank", *STEP_COLUMNS), "INSERT OR IGNORE")
_PROCESS_SQL = _insert("process", ("rank", "restart", "node_rank", *PROCESS_FIELDS))
_FLOP_COUNT_SQL = _insert("flop_counts", ("rank", "restart", "node_rank", *_FLOP_COUNT_COLUMNS))
_SYSTEM_SQL = _insert("system", ("node_rank", "host", *SYSTEM_FIELDS))
_SENDER_SQL = _insert("senders", _SENDER_COLUMNS, "INSERT OR REPLACE")
_REJECTED_SQL = _insert("rejected", ("reason", "count"), "INSERT OR REPLACE")
_INCIDENT_SQL = _insert("incidents", _INCIDENT_COLUMNS)
_META_SQL = ("INSERT INTO meta (key, value) VALUES (?, ?) "
             "ON CONFLICT(key) DO UPDATE SET value = excluded.value")


@contextlib.contextmanager
def _sqlite_errors() -> Iterator[None]:
    """SQLite's exceptions as StoreError."""
    try:
        yield
    except sqlite3.Error as exc:
        raise StoreError(str(exc)) from exc


def _pick(fields: Sequence[str], wanted: Sequence[str],
          rows: Iterable[Sequence[Any]]) -> list[list[Any]]:
    """Columnar rows reordered to ``wanted``; a field the sender did not send is None."""
    index = [fields.index(f) if f in fields else None for f in wanted]
    return [[row[i] if i is not None else None for i in index] for row in rows]


class StoreWriter:
    """Appends to the store (the collector's one connection); the caller decides when
    to commit."""

    def __init__(self, path: str) -> None:
        self.path = path
        with _sqlite_errors():
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            for ddl in _DDL:
                self.db.execute(ddl)
        self._set_meta({"store_schema_version": SCHEMA_VERSION})
        self._execute("BEGIN")

    def commit(self) -> None:
        """Commit the batch and begin the next; StoreError when the batch could not
        be written (a full disk: it is lost, and the next batch begins anyway)."""
        try:
            self._execute("COMMIT")
        finally:
            with contextlib.suppress(sqlite3.Error):
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                self.db.execute("BEGIN")

    def close(self) -> None:
        """Commit and fold the write-ahead log into the file: the closed store is one
        self-contained file (no ``-wal`` beside it), synced to disk."""
        try:
            self._execute("COMMIT")
            with contextlib.suppress(StoreError):  # a reader still open keeps the log
                self._execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._execute("PRAGMA journal_mode=DELETE")
        finally:
            self.db.close()

    def save_run(self, record: RunStart | RunEnd) -> None:
        """The launcher's record of the run's start or end."""
        self._set_meta(record_to_json(record))

    def add_join_error(self, error: JoinError) -> None:
        self._set_meta({f"{JOIN_ERROR_PREFIX}{error.at:.6f}": error.problem})

    def add_steps(self, sender: Sender, records: Iterable[StepRecord]) -> int:
        """Store the steps; returns how many were new (a step already stored is kept)."""
        prefix = (sender.rank, sender.restart, sender.node_rank)
        return self.add_step_rows([prefix + record.values() for record in records])

    def add_step_rows(self, rows: Sequence[Sequence[Any]]) -> int:
        """Steps as rows of (rank, restart, node_rank, *STEP_COLUMNS values), as a
        node's relay forwards them; returns how many were new."""
        if not rows:
            return 0
        with _sqlite_errors():
            return int(self.db.executemany(_STEPS_SQL, rows).rowcount)

    def add_flop_counts(self, sender: Sender, counts: Iterable[FlopCount]) -> None:
        prefix = (sender.rank, sender.restart, sender.node_rank)
        self._executemany(_FLOP_COUNT_SQL, [
            (*prefix, *c.values()) for c in counts])

    def add_process(self, sender: Sender, fields: Sequence[str],
                    rows: Iterable[Sequence[Any]]) -> None:
        """Process samples as columnar rows of ``fields`` (of `protocol.PROCESS_FIELDS`)."""
        prefix = (sender.rank, sender.restart, sender.node_rank)
        self._executemany(_PROCESS_SQL, [(*prefix, *values)
                                         for values in _pick(fields, PROCESS_FIELDS, rows)])

    def add_system(self, sender: Sender, fields: Sequence[str],
                   rows: Iterable[Sequence[Any]]) -> None:
        """System samples as columnar rows of ``fields`` (of `protocol.SYSTEM_FIELDS`)."""
        gpus = SYSTEM_FIELDS.index("gpus")
        batch = []
        for values in _pick(fields, SYSTEM_FIELDS, rows):
            values[gpus] = orjson.dumps(values[gpus] or []).decode()
            batch.append((sender.node_rank, sender.host, *values))
        self._executemany(_SYSTEM_SQL, batch)

    def add_incident(self, i: Incident) -> int:
        """A stall or crash; returns its row id (a stall's end is set later)."""
        with _sqlite_errors():
            cursor = self.db.execute(_INCIDENT_SQL, (
                i.what, i.rank, i.node_rank, i.host, i.pid, i.began_at, i.detected_at,
                i.cleared_at, i.step, i.phase, orjson.dumps(list(i.open_phases)).decode(),
                orjson.dumps(stacks.to_json(i.stack)).decode(), i.stack_source,
                orjson.dumps(dict(i.detail)).decode()))
        return int(cursor.lastrowid or 0)

    def clear_stall(self, row_id: int, cleared_at: float) -> None:
        """The stall stored as ``row_id`` ended: the rank's steps resumed."""
        self._execute("UPDATE incidents SET cleared_at = ? WHERE rowid = ?", (cleared_at, row_id))

    def save_sender(self, s: SenderState) -> None:
        self.save_senders((s,))

    def save_senders(self, states: Iterable[SenderState]) -> None:
        self._executemany(_SENDER_SQL, [(
            s.sender.sender_id, s.sender.role, s.sender.host, s.sender.pid, s.sender.node_rank,
            s.sender.rank, s.sender.local_rank, s.sender.world_size, s.sender.restart,
            *s.counters()) for s in states])

    def save_rejected(self, counts: Mapping[str, int]) -> None:
        self._executemany(_REJECTED_SQL, list(counts.items()))

    def _set_meta(self, values: Mapping[str, Any]) -> None:
        self._executemany(_META_SQL, [(k, orjson.dumps(v).decode()) for k, v in values.items()])

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        with _sqlite_errors():
            self.db.execute(sql, params)

    def _executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        with _sqlite_errors():
            self.db.executemany(sql, rows)


class StoreReader:
    """Read-only access to a store (no torch needed), as a ``with`` block or closed by
    the caller; StoreError from any method when the store cannot be read."""

    def __init__(self, path: str | Path, timeout_s: float = 5.0) -> None:
        self.skipped: dict[str, int] = {}  # stored rows not read back, by reason
        self._step_columns: str | None = None  # those of _READ_STEP_COLUMNS the store has
        with _sqlite_errors():
            self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
        self._db.row_factory = sqlite3.Row
        try:
            self._rows("SELECT key FROM meta LIMIT 1")  # not a store: say so now
        except StoreError:
            self.close()
            raise

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def records(self) -> RunRecords:
        """The run's records; the rejections include the stored rows skipped so far."""
        meta = self._meta()
        start = self._run_record(RunStart, meta, "session_id")
        end = self._run_record(RunEnd, meta, "ended_at")
        senders = self.senders()
        rejected = {r["reason"]: r["count"] for r in self._rows("SELECT * FROM rejected")
                    if type(r["reason"]) is str and type(r["count"]) is int}
        return RunRecords(start, end, senders, {**rejected, **self.skipped})

    def senders(self, role: str | None = None) -> tuple[SenderState, ...]:
        """Every sender that spoke (of one role: ``"system"`` is each node's launcher)."""
        where, params = ("WHERE role = ?", (role,)) if role is not None else ("", ())
        rows = self._rows(f"SELECT * FROM senders {where} ORDER BY node_rank, rank", params)
        return tuple(self._read(rows, _sender_state, "sender"))

    def _read(self, rows: list[dict[str, Any]], convert: Callable[[dict[str, Any]], _T],
              what: str) -> list[_T]:
        """``rows`` converted; a row that will not convert is skipped and counted."""
        out = []
        for r in rows:
            try:
                out.append(convert(r))
            except (TypeError, ValueError, KeyError, orjson.JSONDecodeError):
                self._skip(f"stored {what} row with bad values")
        return out

    def _skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    def _run_record(self, cls: type[_Run], meta: Mapping[str, Any], key: str) -> _Run | None:
        """The run record kept in ``meta``, if its ``key`` is there and it is whole."""
        if key not in meta:
            return None
        try:
            return _checked_record(record_from_json(cls, meta))
        except ProtocolError:
            self._skip(f"stored {cls.__name__} with bad values")
            return None

    def join_errors(self) -> tuple[JoinError, ...]:
        return tuple(sorted(
            JoinError(float(key[len(JOIN_ERROR_PREFIX):]), str(value))
            for key, value in self._meta().items() if key.startswith(JOIN_ERROR_PREFIX)))

    def run(self, records: RunRecords) -> RunData:
        """The whole run, every stored row, described by its ``records`` (see
        :meth:`records`)."""
        steps = self._steps_where("1", ())
        process = tuple(self._read(self._rows(
            "SELECT * FROM process ORDER BY t, rowid"), _process_sample, "process"))
        # A c10d launcher samples before it learns its node rank (-1): not a node yet.
        system = tuple(self._read(self._rows(
            f"SELECT * FROM system WHERE {_NODE_SAMPLE} ORDER BY t, rowid"), _system_sample,
            "system"))
        return self._run_data(records, steps, process, system, totals_of(steps))

    def window_run(self, records: RunRecords, window_rows: int) -> RunData:
        """What a summary over the last ``window_rows`` aligned steps per rank reads:
        each rank's steps from a little before that window to its end (enough to
        place it and its warm-up exactly), the process and system samples taken
        while it ran, and each rank's whole-run totals summed in SQL.  Only the
        stored rows the reader loads are checked one by one (see the module
        docstring)."""
        totals, spans = self._step_totals()
        steps = self._window_steps(spans, window_steps(window_rows, len(totals)))
        span = select_window(steps, window_rows, 0).time_span()
        num_ranks = max(len(totals), len({s.sender.rank for s in records.senders}))
        process = tuple(self._read(self._samples_near(
            "process", "rank", "1", span, num_ranks), _process_sample, "process"))
        incidents = self.incidents()
        num_nodes = len({s.sender.node_rank for s in records.senders})
        system = tuple(self._read(self._samples_near(
            "system", "node_rank", _NODE_SAMPLE, span, num_nodes, _crash_spans(incidents)),
            _system_sample, "system"))
        return self._run_data(records, steps, process, system, totals, incidents)

    def _run_data(self, records: RunRecords, steps: tuple[StepRow, ...],
                  process: tuple[ProcessSample, ...], system: tuple[SystemSample, ...],
                  totals: tuple[RankTotals, ...],
                  incidents: tuple[Incident, ...] | None = None) -> RunData:
        rejected = {**records.rejected, **self.skipped}
        return dataclasses.replace(
            run_data(RunRecords(records.start, records.end, records.senders, rejected),
                     steps, process, system,
                     self.incidents() if incidents is None else incidents, totals),
            flop_counts=self.flop_counts())

    def _step_totals(self) -> tuple[tuple[RankTotals, ...], list[_StepSpan]]:
        """Per rank, its stored steps summed in SQL (one pass over the table), and per
        attempt of a rank its first and last step.  A rank whose sums are not what a
        collector writes (the file was edited) is summed row by row instead."""
        have = {r["name"] for r in self._rows("PRAGMA table_info(steps)")}
        sums = ", ".join(f"SUM({c}) AS {c}" if c in have else f"0.0 AS {c}"
                         for c in _TOTALED_COLUMNS)
        evals = ("SUM(CASE WHEN num_eval != 0 THEN eval_ms ELSE 0 END) AS eval_ms, "
                 "SUM(num_eval) AS num_eval" if "num_eval" in have
                 else "0.0 AS eval_ms, 0 AS num_eval")
        groups = self._rows(
            "SELECT rank, restart, COUNT(*) AS num_rows, MIN(step) AS first_step, "
            f"MAX(step) AS last_step, {sums}, {evals}, "
            "COUNT(peak_allocated_bytes) AS num_cuda FROM steps GROUP BY rank, restart")
        parts: dict[int, list[RankTotals]] = {}
        spans = []
        for g in groups:
            try:
                rank = _integer(g["rank"], 0, MAX_WORLD_SIZE - 1)
            except ValueError:  # none of its rows can be read
                self._skip("stored step row with bad values", int(g["num_rows"]))
                continue
            try:
                first, part = _integer(g["first_step"], 0), _group_totals(rank, g)
            except (TypeError, ValueError):
                rows = self._steps_where("rank = ? AND restart = ?", (g["rank"], g["restart"]),
                                         count=False)  # counted where the window reads them
                if not rows:
                    continue
                first, part = min(r.step for r in rows), totals_of(rows)[0]
            parts.setdefault(rank, []).append(part)
            spans.append(_StepSpan(rank, g["restart"], first, part.last_step))
        return tuple(_merged(parts[r]) for r in sorted(parts)), spans

    def _window_steps(self, spans: Sequence[_StepSpan], window_rows: int) -> tuple[StepRow, ...]:
        """Each rank's steps up to the last one every rank reached, from far enough
        back that the window and its warm-up are what all of them would give."""
        if not spans:
            return ()
        last: dict[int, int] = {}
        for s in spans:
            last[s.rank] = max(last.get(s.rank, s.last), s.last)
        upper = min(last.values())
        first = min(s.first for s in spans)
        depth = max(window_rows + WARMUP_MAX_STEPS, math.ceil(WARMUP_MAX_STEPS / WARMUP_FRACTION))
        ranks = sorted(last)
        while True:
            low = upper - depth
            if low < first:  # every step up to there: read in one pass
                return self._steps_where(f"step <= ? AND {_READABLE_RANK}", (upper,))
            steps = tuple(row for s in spans if s.last > low and s.first <= upper
                          for row in self._steps_where(
                              "rank = ? AND restart = ? AND step > ? AND step <= ?",
                              (s.rank, s.restart, low, upper)))
            if tail_decides(num_aligned(steps, ranks), window_rows):
                return steps
            depth *= 4  # steps missing in some rank (dropped): look further back

    def _steps_where(self, where: str, params: Sequence[Any],
                     count: bool = True) -> tuple[StepRow, ...]:
        """The stored steps ``where`` says, by rank, attempt and step; a row that will
        not convert is skipped (and counted, with ``count``)."""
        if self._step_columns is None:
            have = {r["name"] for r in self._rows("PRAGMA table_info(steps)")}
            self._step_columns = ", ".join(c for c in _READ_STEP_COLUMNS if c in have)
        checked = self._in_range(where, params)
        with _sqlite_errors():
            cursor = self._db.cursor()
            cursor.row_factory = None  # tuples: a dict per row costs more than the row
            rows = cursor.execute(f"SELECT {self._step_columns} FROM steps WHERE {where} "
                                  "ORDER BY rank, restart, step", params)
            convert = _step_converter(tuple(d[0] for d in cursor.description), not checked)
            out = []
            for row in rows:
                try:
                    out.append(convert(row))
                except (TypeError, ValueError):
                    if count:
                        self._skip("stored step row with bad values")
        return tuple(out)

    def _in_range(self, where: str, params: Sequence[Any]) -> bool:
        """Whether every number of the steps ``where`` says is one a collector writes:
        SQL's MIN and MAX of each column tell (a text sorts above every number), so
        the rows need not be checked one by one."""
        assert self._step_columns is not None
        numeric = [c for c in self._step_columns.split(", ") if c not in _STEP_TYPE]
        bounds = self._rows("SELECT " + ", ".join(f"MIN({c}) AS lo_{c}, MAX({c}) AS hi_{c}"
                                                  for c in numeric)
                            + f" FROM steps WHERE {where}", params)[0]
        for c in numeric:
            low = 0.0 if c.endswith("_ms") else -_LIMIT
            try:
                _number(bounds[f"lo_{c}"], True, low)
                _number(bounds[f"hi_{c}"], True, low)
            except ValueError:
                return False
        return True

    def _samples_near(self, table: str, source: str, where: str,
                      span: tuple[float, float] | None, num_sources: int,
                      extra: Sequence[tuple[float, float]] = ()) -> list[dict[str, Any]]:
        """The samples of ``table`` taken within ``span``; of a ``source`` with none in
        it (a window shorter than the sample interval), its samples nearest the span,
        and with no span (no step window: ``traceml watch``) its latest ones, at most
        :data:`SAMPLES_PER_SOURCE` shared out (so all of them in a short run, as
        `traceml.diagnosis.window.in_span` takes); and those within the ``extra``
        spans (merged where they overlap, asked in chunks).  Oldest first."""
        cap = max(MIN_SAMPLES_PER_SOURCE, SAMPLES_PER_SOURCE // max(1, num_sources))
        columns = f"rowid AS row_id, *, {source} AS _source"
        if span is None:
            rows = self._rows(
                f"SELECT * FROM (SELECT {columns}, ROW_NUMBER() OVER (PARTITION BY {source} "
                f"ORDER BY t DESC) AS nearness FROM {table} WHERE {where}) WHERE nearness <= ?",
                (cap,))
        else:
            start, end = span
            inside = f"{where} AND t >= ? AND t <= ?"
            rows = self._rows(
                f"SELECT * FROM (SELECT {columns}, ROW_NUMBER() OVER (PARTITION BY {source} "
                f"ORDER BY ABS(t - ?)) AS nearness FROM {table} WHERE {where} AND {source} "
                f"NOT IN (SELECT {source} FROM {table} WHERE {inside})) WHERE nearness <= ? "
                f"UNION ALL SELECT {columns}, 0 AS nearness FROM {table} WHERE {inside}",
                ((start + end) / 2, start, end, cap, start, end))
        spans = _merged_spans(extra)
        for i in range(0, len(spans), _SPANS_PER_QUERY):
            chunk = spans[i:i + _SPANS_PER_QUERY]
            rows += self._rows(
                f"SELECT {columns}, 0 AS nearness FROM {table} WHERE {where} AND ("
                + " OR ".join(["(t >= ? AND t <= ?)"] * len(chunk)) + ")",
                [bound for low_high in chunk for bound in low_high])
        rows.sort(key=lambda r: (r["t"] if isinstance(r["t"], (int, float)) else math.inf,
                                 r["row_id"]))
        return list({r["row_id"]: r for r in rows}.values())  # a sample in two spans once

    def incidents(self) -> tuple[Incident, ...]:
        """Every stall and crash, in the order they were reported (none in a store
        written before they were kept)."""
        if not self._has_table("incidents"):
            return ()
        return tuple(self._read(self._rows("SELECT * FROM incidents ORDER BY rowid"),
                                _incident, "incident"))

    def flop_counts(self) -> tuple[FlopCount, ...]:
        """Every rank's FLOP counts, oldest first per rank (none in a store written
        before FLOPs were counted)."""
        if not self._has_table("flop_counts"):
            return ()
        return tuple(
            FlopCount(**{k: r[k] for k in _FLOP_COUNT_COLUMNS[:-1]}, ran=bool(r["ran"]),
                      rank=r["rank"])
            for r in self._rows("SELECT * FROM flop_counts ORDER BY rank, t"))

    def _has_table(self, name: str) -> bool:
        return bool(self._rows("SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?",
                               (name,)))

    def num_steps(self) -> int:
        return int(self._rows("SELECT COUNT(*) AS n FROM steps")[0]["n"])

    def steps_after(self, row_id: int, limit: int) -> NewRows[StoredStep]:
        """The newest ``limit`` steps stored after ``row_id``."""
        rows, last = self._after("steps", row_id, limit)
        return NewRows(tuple(self._read(
            rows, lambda r: StoredStep(r["restart"], _step_row(r)), "step")), last)

    def process_after(self, row_id: int, limit: int) -> NewRows[ProcessSample]:
        rows, last = self._after("process", row_id, limit)
        return NewRows(tuple(self._read(rows, _process_sample, "process")), last)

    def system_after(self, row_id: int, limit: int) -> NewRows[SystemSample]:
        rows, last = self._after("system", row_id, limit)
        return NewRows(tuple(self._read(rows, _system_sample, "system")), last)

    def _after(self, table: str, row_id: int, limit: int) -> tuple[list[dict[str, Any]], int]:
        rows = self._rows(
            f"SELECT * FROM (SELECT rowid AS row_id, * FROM {table} WHERE rowid > ? "
            "ORDER BY rowid DESC LIMIT ?) ORDER BY row_id", (row_id, limit))
        return rows, (int(rows[-1]["row_id"]) if rows else row_id)

    def _meta(self) -> dict[str, Any]:
        pairs = self._read(self._rows("SELECT * FROM meta"),
                           lambda r: (_text(r["key"]), orjson.loads(r["value"])), "meta")
        return dict(pairs)

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with _sqlite_errors():
            return [dict(r) for r in self._db.execute(sql, params)]


_Run = TypeVar("_Run", RunStart, RunEnd)

_LIMIT = float(2**62)  # beyond any count, byte size, time or duration a run stores


def _number(value: Any, nullable: bool = True, low: float = -_LIMIT) -> Any:
    """A stored number as a collector writes it; ValueError otherwise."""
    if value is None and nullable:
        return None
    if type(value) not in (int, float) or not low <= value <= _LIMIT:  # NaN fails too
        raise ValueError(f"{value!r} is not a stored number")
    return value


def _integer(value: Any, low: int = -1, high: float = _LIMIT) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{value!r} is not a stored integer")
    return value


def _text(value: Any) -> str:
    if type(value) is not str:
        raise ValueError(f"{value!r} is not text")
    return value


def _numbers(r: Mapping[str, Any], columns: Iterable[str]) -> dict[str, Any]:
    """The row's ``columns``, each None or a number a collector writes."""
    return {c: _number(r.get(c)) for c in columns}


def _checked_record(record: _Run) -> _Run:
    """A run record whose numbers are finite (a stored one may not be)."""
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if type(value) in (int, float) and not -_LIMIT <= value <= _LIMIT:
            raise ProtocolError(f"{f.name} out of range")
    if isinstance(record, RunStart) and not 0 <= record.expected_world_size <= MAX_WORLD_SIZE:
        raise ProtocolError("expected_world_size out of range")
    return record


def _sender_state(r: Mapping[str, Any]) -> SenderState:
    rank = r["rank"]
    world_size = r["world_size"]
    sender = Sender(role=_text(r["role"]), host=_text(r["host"]), pid=_integer(r["pid"]),
                    node_rank=_integer(r["node_rank"]),
                    rank=None if rank is None else _integer(rank, 0, MAX_WORLD_SIZE - 1),
                    local_rank=r["local_rank"],
                    world_size=(None if world_size is None
                                else _integer(world_size, 1, MAX_WORLD_SIZE)),
                    restart=_integer(r["restart"], 0))
    return SenderState(sender, _number(r["first_seen"], False), _number(r["last_seen"], False),
                       _integer(r["num_messages"], 0), _integer(r["num_gaps"], 0),
                       _integer(r["last_seq"]), _integer(r["num_sent"], 0),
                       _integer(r["num_dropped"], 0), bool(r["said_bye"]))


def _boundary(value: Any) -> str:
    """A step's boundary rule; a store written before steps kept one: optimizer."""
    if value is None:
        return phases.STEP_BOUNDARIES[0]
    if value not in phases.STEP_BOUNDARIES:
        raise ValueError(f"{value!r} is not a step boundary")
    return str(value)


_not_none = functools.partial(operator.is_not, None)


def _step_row(r: Mapping[str, Any]) -> StepRow:
    return _step_converter(tuple(r.keys()))(tuple(r.values()))


_OPTIONAL_STEP_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes", "rss_bytes",
                         "collective_ms", "samples", "tokens", "flops", "flops_counted",
                         "boundary", "eval_ms", "num_eval", phases.PHASES[0].count_column)


_READ_STEP_COLUMNS = ("rank", "restart", "step", "t_begin", "total_ms", "wait_ms",
                      *(p.column for p in phases.PHASES), *(p.gpu_column for p in phases.gpu_timed()),
                      *_OPTIONAL_STEP_FIELDS)
"""What a StepRow is made of (and the attempt, which orders them): a bulk read selects
these only, since every column costs in a read of millions of rows."""


@functools.lru_cache(maxsize=8)
def _step_converter(names: tuple[str, ...],
                    check: bool = True) -> Callable[[tuple[Any, ...]], StepRow]:
    """Stored step rows of these columns -> StepRow; ValueError or TypeError for a row
    a collector does not write (``check``: every number in range; without, rows whose
    numbers are known to be).  Built once per query: a summary converts millions."""
    at = {n: i for i, n in enumerate(names)}
    missing = len(names)  # a column the store lacks reads as None (the row gets one more)
    # Several columns each (rank, step, ...; total_ms, wait_ms, ...): the getters give tuples.
    numeric = operator.itemgetter(*(i for n, i in at.items() if n not in _STEP_TYPE))
    times = operator.itemgetter(*(i for n, i in at.items() if n.endswith("_ms")))
    # A store written before a phase existed has no column for it: it took 0.
    phase_names = tuple(p.name for p in phases.PHASES)
    phase_ms = operator.itemgetter(*(at.get(p.column, missing) for p in phases.PHASES))
    gpu_ms = operator.itemgetter(*(at.get(p.gpu_column, missing) for p in phases.gpu_timed()),
                                 missing, missing)  # a tuple, also without GPU-timed phases
    fields = operator.itemgetter(at["rank"], at["step"], at["total_ms"], at["wait_ms"],
                                 at["t_begin"],
                                 *(at.get(f, missing) for f in _OPTIONAL_STEP_FIELDS))

    def convert(stored: tuple[Any, ...]) -> StepRow:
        if check:
            values = tuple(filter(_not_none, numeric(stored)))
            # A string or blob fails the sum (TypeError); Inf, or a number far out of
            # range, takes it out of range (summing is cheaper than comparing each).
            if not -_LIMIT <= sum(values) <= _LIMIT * len(values):
                raise ValueError("a stored number out of range")
            if min(filter(_not_none, times(stored)), default=0.0) < 0:
                raise ValueError("a negative time")
        row = (*stored, None)
        (rank, step, total_ms, wait_ms, t_begin, peak_allocated, peak_reserved, rss, collective,
         samples, tokens, flops, flops_counted, boundary, eval_ms, num_eval,
         num_input) = fields(row)
        gpu = gpu_ms(row)[:-2]
        times_ms = phase_ms(row)
        if None in times_ms:
            times_ms = tuple(v or 0.0 for v in times_ms)
        # Positional, in StepRow's field order: a call with keywords costs more.
        return StepRow(
            _integer(rank, 0, MAX_WORLD_SIZE - 1), _integer(step, 0),
            dict(zip(phase_names, times_ms)), _number(total_ms, False, 0.0),
            _number(wait_ms, False, 0.0), peak_allocated, peak_reserved, rss,
            float(sum(gpu)) if None not in gpu else None,
            (t_begin + total_ms / 1e3) if t_begin is not None else None, collective,
            samples, tokens, flops, bool(flops_counted), _boundary(boundary),
            eval_ms or 0.0, num_eval or 0, num_input or 0)

    return convert


def _process_sample(r: Mapping[str, Any]) -> ProcessSample:
    v = _numbers(r, r.keys())
    return ProcessSample(
        rank=_integer(r["rank"], 0, MAX_WORLD_SIZE - 1), node_rank=_integer(r["node_rank"]),
        t=_number(r["t"], False), cpu_pct=v["cpu_pct"] or 0.0,
        rss_bytes=v["rss_bytes"] or 0, host_ram_total_bytes=v["host_ram_total_bytes"] or 0,
        num_cpus=v["num_cpus"] or 1, device_allocated_bytes=v["device_allocated_bytes"],
        device_reserved_bytes=v["device_reserved_bytes"],
        device_total_bytes=v["device_total_bytes"],
    )


def _incident(r: Mapping[str, Any]) -> Incident:
    detail = orjson.loads(_text(r["detail"]))
    if not isinstance(detail, dict) or not all(
            isinstance(v, (str, int, float)) or v is None for v in detail.values()):
        raise TypeError("incident detail is not an object of scalars")
    phase, source = r["phase"], r["stack_source"]
    return Incident(
        what=_text(r["what"]), rank=_integer(r["rank"], 0, MAX_WORLD_SIZE - 1),
        node_rank=_integer(r["node_rank"]), host=_text(r["host"]), pid=_integer(r["pid"], 0),
        began_at=_number(r["began_at"], False), detected_at=_number(r["detected_at"], False),
        cleared_at=_number(r["cleared_at"]),
        step=None if r["step"] is None else _integer(r["step"], 0),
        phase=None if phase is None else _text(phase),
        open_phases=tuple(_text(p) for p in orjson.loads(_text(r["open_phases"]))),
        stack=stacks.from_json(orjson.loads(_text(r["stack"]))),
        stack_source=None if source is None else _text(source), detail=detail)


def _system_sample(r: Mapping[str, Any]) -> SystemSample:
    v = _numbers(r, ("cpu_pct", "ram_pct", "ram_total_bytes"))
    gpus = orjson.loads(r["gpus"] or "[]")
    if type(gpus) is not list:
        raise ValueError("gpus is not a list")
    return SystemSample(node_rank=_integer(r["node_rank"]), host=_text(r["host"]),
                        t=_number(r["t"], False), cpu_pct=v["cpu_pct"] or 0.0,
                        ram_pct=v["ram_pct"] or 0.0, ram_total_bytes=v["ram_total_bytes"] or 0,
                        gpus=tuple(_gpu_sample(g) for g in gpus))


def _gpu_sample(values: Any) -> GpuSample:
    if type(values) is not list:
        raise ValueError("a GPU sample is not a list")
    index, *rest = values
    return GpuSample(_integer(index, 0), *(_number(x) for x in rest))


# -- the bounded read's SQL and sums --------------------------------------------------------

_TOTALED_COLUMNS = tuple(p.column for p in TOTALED)
_NODE_SAMPLE = "node_rank >= 0"  # a c10d launcher samples before it learns its node rank
_READABLE_RANK = f"typeof(rank) = 'integer' AND rank BETWEEN 0 AND {MAX_WORLD_SIZE - 1}"
SAMPLES_PER_SOURCE = 200_000
"""Process (or system) samples a bounded read takes, shared out over the ranks (nodes),
of the sources with none taken while the window ran."""
MIN_SAMPLES_PER_SOURCE = 60


@dataclass(frozen=True)
class _StepSpan:
    """One attempt of a rank: its first and last stored step."""

    rank: int
    restart: int
    first: int
    last: int


def _group_totals(rank: int, g: Mapping[str, Any]) -> RankTotals:
    """One attempt's sums as SQL gave them; ValueError when one is not what a
    collector's rows add up to."""
    return RankTotals(
        rank=rank, num_rows=_integer(g["num_rows"], 1), last_step=_integer(g["last_step"], 0),
        sum_ms={p.name: float(_number(g[p.column] or 0.0, False, 0.0)) for p in TOTALED},
        eval_ms=float(_number(g["eval_ms"] or 0.0, False, 0.0)),
        num_eval=_integer(g["num_eval"] or 0, 0), device_measured=bool(g["num_cuda"]))


def _merged(parts: Sequence[RankTotals]) -> RankTotals:
    """One rank's totals from those of its attempts."""
    return RankTotals(
        rank=parts[0].rank, num_rows=sum(p.num_rows for p in parts),
        last_step=max(p.last_step for p in parts),
        sum_ms={p.name: sum(t.sum_ms.get(p.name, 0.0) for t in parts) for p in TOTALED},
        eval_ms=sum(p.eval_ms for p in parts), num_eval=sum(p.num_eval for p in parts),
        device_measured=any(p.device_measured for p in parts))


_SPANS_PER_QUERY = 100  # OR terms of one query (SQLite caps a compound SELECT at 500 terms)


def _merged_spans(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` sorted, those that overlap made one (crashes of a job come together)."""
    out: list[tuple[float, float]] = []
    for low, high in sorted(spans):
        if out and low <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def _crash_spans(incidents: Sequence[Incident]) -> list[tuple[float, float]]:
    """Around each crash, the host samples its ending reads (a SIGKILL's memory)."""
    return [(i.began_at - RAM_LOOKBACK_S, i.began_at + 1.0)
            for i in incidents if i.what != "stall"]


# -- the run, described from its records --------------------------------------------------

_NO_START = RunStart(session_id="", command=(), started_at=0.0, traceml_version="",
                     torch_version="", python_version="", summary_window_rows=0, mode="run")


def run_data(records: RunRecords, steps: tuple[StepRow, ...], process: tuple[ProcessSample, ...],
             system: tuple[SystemSample, ...], incidents: tuple[Incident, ...] = (),
             totals: tuple[RankTotals, ...] | None = None) -> RunData:
    """The run as the diagnosis reads it: these samples (all, the window's, or the
    recent ones a live view keeps), what ``records`` say about the run and each rank's
    whole-run ``totals`` (None: ``steps`` are all there is)."""
    meta = _run_meta(records, totals_of(steps) if totals is None else totals, process)
    return RunData(meta, steps, process, system, incidents=incidents, totals=totals)


def _run_meta(records: RunRecords, totals: tuple[RankTotals, ...],
              process: tuple[ProcessSample, ...]) -> RunMeta:
    start = records.start or _NO_START
    world_size, missing = _ranks(records, totals)
    exit_code = records.end.exit_code if records.end is not None else None
    complete = records.end.telemetry_complete if records.end is not None else True
    cuda = any(t.device_measured for t in totals) or any(
        p.device_total_bytes is not None for p in process)
    senders = records.senders
    return RunMeta(
        count_flops=bool(start.count_flops),
        peak_tflops=start.peak_tflops or None,
        session_id=start.session_id, command=list(start.command),
        started_at=start.started_at,
        ended_at=records.end.ended_at if records.end is not None else start.started_at,
        exit_code=exit_code, partial=bool(missing) or exit_code != 0 or not complete,
        world_size=world_size, missing_ranks=missing, nodes=_nodes(senders),
        device="cuda" if cuda else "cpu",
        versions={"traceml": start.traceml_version, "torch": start.torch_version,
                  "python": start.python_version},
        transport={"sent": sum(s.num_sent for s in senders),
                   "dropped": sum(s.num_dropped for s in senders),
                   "gaps": sum(s.num_gaps for s in senders),
                   "rejected": sum(records.rejected.values())},
        mode=start.mode, rejected=dict(records.rejected), telemetry_complete=complete,
    )


def _ranks(records: RunRecords, totals: tuple[RankTotals, ...]) -> tuple[int, tuple[int, ...]]:
    """The world size and the ranks missing from it."""
    start = records.start or _NO_START
    ranked = [s for s in records.senders if s.sender.rank is not None]
    reported = [s.sender.world_size for s in records.senders if s.sender.world_size]
    world_size = max(reported + [start.expected_world_size, len({s.sender.rank for s in ranked}),
                                 1 + max((t.rank for t in totals), default=-1)])
    # A rank that never said goodbye was lost (killed, or its node died): its data
    # stops early.  Watch mode has no agent to say goodbye.
    seen = {s.sender.rank for s in ranked if s.said_bye or start.mode != "run"}
    return world_size, tuple(r for r in range(world_size) if r not in seen)


def _nodes(senders: Sequence[SenderState]) -> tuple[NodeInfo, ...]:
    hosts: dict[int, str] = {}
    ranks: dict[int, set[int]] = {}
    for s in senders:
        node = s.sender.node_rank
        if node < 0:
            continue  # a c10d launcher before it learnt its node rank
        hosts.setdefault(node, s.sender.host)
        ranks.setdefault(node, set())
        if s.sender.rank is not None:
            ranks[node].add(s.sender.rank)
    return tuple(NodeInfo(n, hosts[n], tuple(sorted(ranks[n]))) for n in sorted(hosts))
