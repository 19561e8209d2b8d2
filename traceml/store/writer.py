"""`StoreWriter`: typed records appended to the store in batched transactions
(the collector process, its one connection; a node's relay forwards step rows to it)."""

from __future__ import annotations

import contextlib
import math
import operator
import os
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from itertools import groupby
from typing import Any

import orjson

from traceml import stacks, step_fields
from traceml.clocks import Exchange
from traceml.records import Capture, FlopCount, Incident, StepRow
from traceml.store.records import JoinError, SenderState
from traceml.store.schema import (
    BLOCK_COLUMNS_KEY,
    BLOCK_SUMMED,
    CAPTURE_ASK_SQL,
    CAPTURE_REPORT_SQL,
    CLOCK_EXCHANGE_SQL,
    CLOCK_REFERENCE_KEY,
    DDL,
    EXPORTS_KEY,
    FLOP_COUNT_SQL,
    INCIDENT_SQL,
    JOIN_ERROR_PREFIX,
    LAUNCHER_LOST_KEY,
    LAUNCHER_LOST_ROLE_KEY,
    META_SQL,
    PROCESS_SQL,
    REJECTED_SQL,
    SCHEMA_VERSION,
    SENDER_SQL,
    STEP_BLOCK_SQL,
    STORE_MODE,
    SYSTEM_SQL,
    StoreError,
    sqlite_errors,
)
from traceml.wire.captures import CaptureReport
from traceml.wire.identity import Sender
from traceml.wire.records import RunEnd, RunStart, record_to_json
from traceml.wire.relay import BLOCK_LENGTH
from traceml.wire.rows import PROCESS_FIELDS, SYSTEM_FIELDS, ProcessRows, SystemRows


def _pick(fields: Sequence[str], wanted: Sequence[str],
          rows: Iterable[Sequence[Any]]) -> list[list[Any]]:
    """Columnar rows reordered to ``wanted``; a field the sender did not send is None."""
    index = [fields.index(f) if f in fields else None for f in wanted]
    return [[row[i] if i is not None else None for i in index] for row in rows]


_MEASURED = {f.name: i for i, f in enumerate(step_fields.measured())}
_STEP = _MEASURED["step"]
_SUMMED = tuple(_MEASURED[c] for c in BLOCK_SUMMED)
_EVAL_MS, _NUM_EVAL = _MEASURED["eval_ms"], _MEASURED["num_eval"]
_PEAK = _MEASURED["peak_allocated_bytes"]
_NUM_IDENTITY = len(step_fields.STEP_FIELDS) - len(_MEASURED)
_MAX_STEP = int(step_fields.field("step").high)
_identity = operator.itemgetter(*range(_NUM_IDENTITY))  # (rank, restart, node_rank)

SENDER_SAVE_S = 2.0
"""How stale a rank's stored state may get (its last message, counts): the launcher's
silence watches read the nodes' own senders, stored at once, and wait 10 s and more."""

Prefix = tuple[int, int, int]
"""A step row's identity columns: rank, restart (its attempt), node rank."""


class StoreWriter:
    """Appends to the store (the collector's one connection); the caller decides when
    to commit."""

    def __init__(self, path: str) -> None:
        self.path = path
        with sqlite_errors():
            # Owner-only: the store holds command lines and host names.  SQLite gives its
            # -wal and -shm files the store's mode; the summaries take it too.
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, STORE_MODE))
            except FileExistsError:
                pass
            except OSError as exc:
                raise StoreError(f"cannot create {path}: {exc.strerror or exc}") from exc
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            # The pages every commit touches (the tables' and indexes' ends) stay cached:
            # a wide job's blocks would push them out of SQLite's default 2 MiB.
            self.db.execute("PRAGMA cache_size=-65536")
            if self.db.execute("SELECT 1 FROM sqlite_master WHERE name = 'steps' "
                               "AND type = 'table'").fetchone():
                self.db.close()
                raise StoreError(f"{path} was written by an older traceml (a steps table): "
                                 "write to a new session folder")
            for ddl in DDL:
                self.db.execute(ddl)
        self._set_meta({"store_schema_version": SCHEMA_VERSION,
                        BLOCK_COLUMNS_KEY: [f.name for f in step_fields.measured()]})
        # (rank, restart) -> its last stored step: a step at or before it is a duplicate
        self._last_step: dict[tuple[int, int], int] = {}
        self.num_bad_steps = 0  # refused by `add_blocks`: a step index or sum out of bounds
        self._saved_states: set[str] = set()  # senders whose state is stored
        self._held_states: dict[str, SenderState] = {}  # ranks' states not stored yet
        self._states_saved_at = time.monotonic()
        self._execute("BEGIN")

    def commit(self) -> None:
        """Commit the batch (with the ranks' states held since SENDER_SAVE_S) and begin
        the next; StoreError when the batch could not be written (a full disk: it is
        lost, and the next batch begins anyway)."""
        try:
            if self._held_states and time.monotonic() - self._states_saved_at >= SENDER_SAVE_S:
                self._write_held_states()
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
            self._write_held_states()
            self._execute("COMMIT")
            with contextlib.suppress(StoreError):  # a reader still open keeps the log
                self._execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._execute("PRAGMA journal_mode=DELETE")
        finally:
            self.db.close()

    def save_run(self, record: RunStart | RunEnd) -> None:
        """The launcher's record of the run's start or end."""
        self._set_meta(record_to_json(record))

    def add_clock_exchange(self, host: str, pid: int, exchange: Exchange) -> None:
        """A node launcher's best exchange of one burst against node 0's clock."""
        self._execute(CLOCK_EXCHANGE_SQL, (host, pid, exchange.t1, exchange.t2, exchange.t3,
                                           exchange.t4))

    def save_clock_reference(self, host: str, pid: int) -> None:
        """The launcher on the collector's node: the other nodes' clocks are set against it."""
        self._set_meta({CLOCK_REFERENCE_KEY: [host, pid]})

    def add_join_error(self, error: JoinError) -> None:
        self._set_meta({f"{JOIN_ERROR_PREFIX}{error.at:.6f}": error.problem})

    def save_exports(self, exports: Mapping[str, Mapping[str, Any]]) -> None:
        """How the collector's metrics exports went (`traceml.live.otlp`), by exporter."""
        self._set_meta({EXPORTS_KEY: exports})

    def save_launcher_lost(self, at: float, role: str) -> None:
        """The collector's own record that its launcher (``role``: or the training
        process, under traceml.init()) vanished before the run ended (``kill -9``, the
        OOM killer): the end it will never be told."""
        self._set_meta({LAUNCHER_LOST_KEY: at, LAUNCHER_LOST_ROLE_KEY: role})

    def add_steps(self, rows: Sequence[StepRow]) -> int:
        """Store the steps (each rank's in step order), a block per run of one rank's
        rows; returns how many were new (see :meth:`add_blocks`)."""
        return self.add_blocks([(prefix, [row[_NUM_IDENTITY:] for row in run])
                                for prefix, run in groupby(rows, key=_identity)])

    def add_relayed_blocks(self, blocks: Iterable[tuple[Prefix, Sequence[Any]]]) -> int:
        """A relay's finished blocks (`traceml.wire.relay.RelayBatch.step_blocks`: each a
        `step_block` made on the relay's node, its rows as JSON text), stored as they
        came, so node 0 neither regroups nor sums nor parses the rows; returns how many
        steps were new.  A block whose header is not what `step_block` makes is refused
        and counted (`num_bad_steps`, as many as it says it holds: `relayed_rows`).  One
        that reaches back to a step already stored (a resent batch) has its rows read
        and goes through `add_blocks`, refused unless they are as many rows of this
        version's columns as its header says.  The rows of the others are checked where
        the store is read, as every stored row's (rows that are not JSON: the reader
        skips and counts the block, the ``steps`` view leaves it out)."""
        params: list[tuple[Any, ...]] = []
        again: list[tuple[Prefix, Sequence[Sequence[Any]]]] = []
        for prefix, block in blocks:
            if not _relayed_block(block):
                self.num_bad_steps += relayed_rows(block)
            elif block[0] > self._last_step.get(prefix[:2], -1):
                params.append((*prefix, *block))
            elif (rows := _block_rows(block[-1], block[2])) is None:
                self.num_bad_steps += block[2]
            else:
                again.append((prefix, rows))
        self._executemany(STEP_BLOCK_SQL, params)
        self._last_step.update({(p[0], p[1]): p[4] for p in params})
        return int(sum(p[5] for p in params)) + (self.add_blocks(again) if again else 0)

    def add_blocks(self, runs: Iterable[tuple[Prefix, Sequence[Sequence[Any]]]]) -> int:
        """Store each run of one rank's steps (its `traceml.step_fields.measured`
        values) as one block row; returns how many steps were new.  A step at or before
        the last one stored of its rank's attempt is a duplicate and kept out (a
        resent batch): each attempt's blocks hold ascending steps that never overlap.
        A run whose step indexes are not integers a collector stores (out-of-order ones
        are sorted, repeats dropped), whose sums are not those of values it stores (a
        negative or unbounded time) or whose rows JSON cannot hold is refused and
        counted (`num_bad_steps`); each value is checked where the store is read."""
        params: list[tuple[Any, ...]] = []
        stored: dict[tuple[int, int], int] = {}
        for (rank, restart, node_rank), rows in runs:
            key = (rank, restart)
            last = stored.get(key, self._last_step.get(key, -1))
            try:
                block = step_block(rows, last)
            except ValueError:
                self.num_bad_steps += len(rows)
                continue
            if block is not None:
                stored[key] = block[1]  # its last step
                params.append((rank, restart, node_rank, *block))
        self._executemany(STEP_BLOCK_SQL, params)
        self._last_step.update(stored)
        return sum(p[5] for p in params)

    def add_flop_counts(self, sender: Sender, counts: Iterable[FlopCount]) -> None:
        prefix = (sender.rank, sender.restart, sender.node_rank)
        self._executemany(FLOP_COUNT_SQL, [
            (*prefix, *c.values()) for c in counts])

    def add_process(self, sender: Sender, samples: ProcessRows) -> None:
        """Process samples of a rank (the fields of `wire.rows.PROCESS_FIELDS` it sent)."""
        self.add_processes([(sender, samples)])

    def add_processes(self, samples: Iterable[tuple[Sender, ProcessRows]]) -> None:
        """Process samples of several ranks (a relay's batch), in one statement."""
        self._executemany(PROCESS_SQL, [
            (sender.rank, sender.restart, sender.node_rank, *values) for sender, rows in samples
            for values in _pick(rows.fields, PROCESS_FIELDS, rows.rows)])

    def add_system(self, sender: Sender, samples: SystemRows) -> None:
        """System samples of a node (the fields of `wire.rows.SYSTEM_FIELDS` it sent)."""
        gpus = SYSTEM_FIELDS.index("gpus")
        batch = []
        for values in _pick(samples.fields, SYSTEM_FIELDS, samples.rows):
            values[gpus] = orjson.dumps(values[gpus] or []).decode()
            batch.append((sender.node_rank, sender.host, *values))
        self._executemany(SYSTEM_SQL, batch)

    def add_incident(self, i: Incident) -> int:
        """A stall or crash; returns its row id (a stall's end is set later)."""
        with sqlite_errors():
            cursor = self.db.execute(INCIDENT_SQL, (
                i.what, i.rank, i.node_rank, i.host, i.pid, i.began_at, i.detected_at,
                i.cleared_at, i.step, i.phase, orjson.dumps(list(i.open_phases)).decode(),
                orjson.dumps(stacks.to_json(i.stack)).decode(), i.stack_source,
                orjson.dumps(dict(i.detail)).decode()))
        return int(cursor.lastrowid or 0)

    def add_capture_ask(self, c: Capture) -> None:
        """Node 0 asked a rank for a profiler capture (its report fills the row later)."""
        self._execute(CAPTURE_ASK_SQL, (c.capture_id, c.rank, c.role, c.trigger, c.label,
                                        c.phase, c.asked_at, c.start_after, c.steps_asked))

    def add_capture_report(self, rank: int, host: str, report: CaptureReport) -> bool:
        """A rank's report of its capture; False when no ask of that id is open for it."""
        with sqlite_errors():
            cursor = self.db.execute(CAPTURE_REPORT_SQL, (
                time.time(), report.num_steps, report.began_at, report.ended_at, host,
                report.path, report.trace_bytes, report.cut, report.error,
                orjson.dumps([o.values() for o in report.operators]).decode(),
                report.capture_id, rank))
        return cursor.rowcount > 0

    def clear_stall(self, row_id: int, cleared_at: float) -> None:
        """The stall stored as ``row_id`` ended: the rank's steps resumed."""
        self._execute("UPDATE incidents SET cleared_at = ? WHERE rowid = ?", (cleared_at, row_id))

    def save_sender(self, s: SenderState) -> None:
        self.save_senders((s,))

    def save_senders(self, states: Iterable[SenderState]) -> None:
        """Store these senders' states: at once a sender's first, its goodbye and every
        state of a node's own processes (relays, samplers: what the launchers' silence
        watches read); a rank's others are held and written by the first commit after
        SENDER_SAVE_S (thousands of ranks' states change every second; nothing reads
        them closer), or at close."""
        now = []
        for s in states:
            key = s.sender.sender_id
            if s.said_bye or s.sender.role != "rank" or key not in self._saved_states:
                now.append(s)
                self._held_states.pop(key, None)
                self._saved_states.add(key)
            else:
                self._held_states[key] = s
        self._write_states(now)

    def _write_held_states(self) -> None:
        self._write_states(self._held_states.values())
        self._held_states, self._states_saved_at = {}, time.monotonic()

    def _write_states(self, states: Iterable[SenderState]) -> None:
        self._executemany(SENDER_SQL, [(
            s.sender.sender_id, s.sender.role, s.sender.host, s.sender.pid, s.sender.node_rank,
            s.sender.rank, s.sender.local_rank, s.sender.world_size, s.sender.restart,
            *s.counters()) for s in states])

    def save_rejected(self, counts: Mapping[str, int]) -> None:
        self._executemany(REJECTED_SQL, list(counts.items()))

    def _set_meta(self, values: Mapping[str, Any]) -> None:
        self._executemany(META_SQL, [(k, orjson.dumps(v).decode()) for k, v in values.items()])

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        with sqlite_errors():
            self.db.execute(sql, params)

    def _executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        with sqlite_errors():
            self.db.executemany(sql, rows)


def step_block(rows: Sequence[Sequence[Any]], last: int = -1) -> tuple[Any, ...] | None:
    """A run of one rank's steps (their `traceml.step_fields.measured` values) as a block
    row after its identity: `BLOCK_HEADER`'s first and last step, row count and sums,
    then the rows after ``last`` as JSON bytes (None: no such rows).  ValueError for a
    run no block can hold: step indexes that are not integers in bounds, sums that no
    collector's values add up to, rows that are not this version's or that JSON cannot
    hold.  Node 0's writer makes them, and each node's relay for its own ranks
    (`add_relayed_blocks`)."""
    try:
        return _step_block(rows, last)
    except (TypeError, LookupError, OverflowError, orjson.JSONEncodeError) as exc:
        raise ValueError(f"a run no block can hold: {exc}") from None


def _step_block(rows: Sequence[Sequence[Any]], last: int) -> tuple[Any, ...] | None:
    steps = [r[_STEP] for r in rows]
    if set(map(type, steps)) != {int} or min(steps) < 0 or max(steps) > _MAX_STEP:
        raise ValueError("step indexes that are not integers in bounds")
    if steps[0] <= last or not all(map(operator.lt, steps, steps[1:])):
        rows = _ascending_after(rows, last)  # sorted, repeats and stored steps dropped
        if not rows:
            return None
        steps = [r[_STEP] for r in rows]
    columns = list(zip(*rows))
    n = len(rows)
    num_eval, peaks = columns[_NUM_EVAL], columns[_PEAK]
    times = [math.fsum(columns[i]) for i in _SUMMED]
    times.append(math.fsum(ms for ms, k in zip(columns[_EVAL_MS], num_eval) if k)
                 if any(num_eval) else 0.0)
    passes = sum(num_eval)
    if not (all(0.0 <= t <= n * step_fields.MAX_STEP_MS for t in times)
            and type(passes) is int and 0 <= passes <= step_fields.MAX_COUNT):
        raise ValueError("a sum that no collector's values add up to")
    return (steps[0], steps[-1], n, *times, passes, n - peaks.count(None),
            orjson.dumps(rows))


MAX_BLOCK_ROWS = 1 << 20
"""The most steps a relayed block holds (a relay sends a batch at 16 384 rows)."""
MAX_PASSES_PER_STEP = 1 << 20
"""Evaluation passes a relayed block may say ended per step, at most: its sums stay
far from SQLite's 64-bit integers when a rank's blocks are summed."""


def relayed_rows(block: Sequence[Any]) -> int:
    """How many steps a relayed block (after its sender index) says it holds, as a
    count of refused steps: its header's count when that is one, else 1."""
    n = block[2] if len(block) > 2 else None
    return n if type(n) is int and 1 <= n <= MAX_BLOCK_ROWS else 1


def _relayed_block(block: Sequence[Any]) -> bool:
    """Whether a relayed block's header is one `step_block` makes (its rows are JSON
    text): steps in bounds and ascending, as many rows as steps at most, sums that
    its rows' values can add up to, counts of its rows."""
    if len(block) != BLOCK_LENGTH or type(block[-1]) is not str:
        return False
    first, last, n, *sums = block[:-1]
    num_cuda, passes = sums.pop(), sums.pop()
    return (type(first) is int and type(last) is int and type(n) is int
            and 0 <= first <= last <= _MAX_STEP and 1 <= n <= min(last - first + 1,
                                                                   MAX_BLOCK_ROWS)
            and all(type(t) is float and 0.0 <= t <= n * step_fields.MAX_STEP_MS
                    for t in sums)
            and type(passes) is int and 0 <= passes <= n * MAX_PASSES_PER_STEP
            and type(num_cuda) is int and 0 <= num_cuda <= n)


def _block_rows(text: str, n: int) -> list[Any] | None:
    """A relayed block's rows, when they are ``n`` rows of this version's columns;
    None otherwise (not JSON, or not the rows its header says)."""
    try:
        rows = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if (type(rows) is not list or len(rows) != n
            or not all(type(r) is list and len(r) == len(_MEASURED) for r in rows)):
        return None
    return rows


def _ascending_after(rows: Sequence[Sequence[Any]], last: int) -> list[Sequence[Any]]:
    """The rows of steps after ``last``, ascending, the first row of each step."""
    first: dict[int, Sequence[Any]] = {}
    for r in rows:
        if r[_STEP] > last:
            first.setdefault(r[_STEP], r)
    return [first[step] for step in sorted(first)]
