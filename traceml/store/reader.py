"""`StoreReader`: the store read back, read-only, as `RunData` and the store's records:
every row, the bounded read a summary over its window takes (`StoreReader.window_run`:
the window's steps, the samples taken while it ran, per-rank sums in SQL), or the rows
added since a rowid (shared: the launcher, offline analysis and the live views read)."""

from __future__ import annotations

import dataclasses
import math
import operator
import sqlite3
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

import orjson

from traceml import phases, step_fields
from traceml.clocks import Exchange
from traceml.errors import ProtocolError
from traceml.records import (
    Capture,
    FlopCount,
    Incident,
    ProcessSample,
    RankTotals,
    RunData,
    StepRow,
    SystemSample,
    totals_of,
)
from traceml.store.queries import SPANS_PER_QUERY, StepSpan, merged_spans
from traceml.store.records import JoinError, NewRows, RunRecords, SenderState
from traceml.store.rows import (
    capture_from_row,
    checked_integer,
    checked_record,
    checked_step,
    checked_text,
    clock_exchange,
    group_totals,
    incident_from_row,
    merged_totals,
    process_samples,
    run_data,
    sender_state,
    system_sample,
)
from traceml.store.schema import (
    BLOCK_COLUMNS_KEY,
    BLOCK_SUMMED,
    CLOCK_REFERENCE_KEY,
    EXPORTS_KEY,
    FLOP_COUNT_COLUMNS,
    JOIN_ERROR_PREFIX,
    LAUNCHER_LOST_KEY,
    LAUNCHER_LOST_ROLE_KEY,
    StoreError,
    sqlite_errors,
)
from traceml.wire.identity import MAX_WORLD_SIZE
from traceml.wire.records import RunEnd, RunStart, record_from_json

_T = TypeVar("_T")
_Block = tuple[Any, Any, Any, "tuple[int, int] | None", "list[StepRow]"]
"""A decoded step block: rank, restart, row count, its first and last step (None: its
rows are bad) and its steps read (`StoreReader._decoded`)."""
_Table = tuple[tuple[str, ...], list[tuple[Any, ...]]]  # column names, rows


def _dicts(table: _Table) -> list[dict[str, Any]]:
    """A table's rows as dicts by column name."""
    names, rows = table
    return [dict(zip(names, r)) for r in rows]


_Run = TypeVar("_Run", RunStart, RunEnd)


class WindowPolicy(Protocol):
    """Which rows a summary over a window of steps reads: the analysis decides
    (`traceml.diagnosis.window.ANALYSIS_WINDOW`); the bounded read only follows it."""

    def steps_per_rank(self, window_rows: int, num_ranks: int) -> int:
        """The steps per rank the window keeps."""

    def depth(self, steps_per_rank: int) -> int:
        """How many steps back from the last one every rank reached to read first."""

    def tail_decides(self, steps: Sequence[StepRow], ranks: Sequence[int],
                     steps_per_rank: int) -> bool:
        """Whether ``steps``, the tail read, give the window that every step would."""

    def time_span(self, steps: Sequence[StepRow], window_rows: int) -> tuple[float, float] | None:
        """Unix seconds the window's steps ran (None: steps without end times)."""

    def crash_spans(self, incidents: Sequence[Incident]) -> list[tuple[float, float]]:
        """Spans around the crashes whose host samples the ending reads."""


def checked_exports(value: Any) -> dict[str, dict[str, Any]]:
    """The exports record as the collector writes it; anything else (an edited store)
    reads as no record."""
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(value, dict):
        return out
    for name, tally in value.items():
        if (isinstance(tally, dict) and isinstance(tally.get("endpoint"), str)
                and all(type(tally.get(k)) is int and tally[k] >= 0 for k in ("sent", "failed"))
                and (tally.get("error") is None or isinstance(tally.get("error"), str))):
            out[str(name)] = {k: tally.get(k) for k in ("endpoint", "sent", "failed", "error")}
    return out


class StoreReader:
    """Read-only access to a store (no torch needed), as a ``with`` block or closed by
    the caller; StoreError from any method when the store cannot be read."""

    def __init__(self, path: str | Path, timeout_s: float = 5.0) -> None:
        self.skipped: dict[str, int] = {}  # stored rows not read back, by reason
        self._blocks: _Layout | None = None  # how the step blocks are read (`_layout`)
        with sqlite_errors():
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
        lost = meta.get(LAUNCHER_LOST_KEY)
        lost_at = float(lost) if isinstance(lost, (int, float)) and math.isfinite(lost) else None
        role = "process" if meta.get(LAUNCHER_LOST_ROLE_KEY) == "process" else "launcher"
        exchanges = self.clock_exchanges()
        reference = meta.get(CLOCK_REFERENCE_KEY)
        if not (type(reference) is list and len(reference) == 2 and type(reference[0]) is str
                and type(reference[1]) is int):
            reference = None
        return RunRecords(start, end, senders, {**rejected, **self.skipped}, lost_at, role,
                          checked_exports(meta.get(EXPORTS_KEY)), exchanges,
                          None if reference is None else (reference[0], reference[1]))

    def clock_exchanges(self) -> tuple[tuple[str, int, Exchange], ...]:
        """Each node launcher's best exchange per burst against node 0's clock, as
        (host, pid, exchange), oldest first (none in a store written before clocks were
        measured, or of one node)."""
        if not self._has_table("clock_exchanges"):
            return ()
        rows = self._rows("SELECT * FROM clock_exchanges ORDER BY rowid LIMIT ?",
                          (MAX_CLOCK_EXCHANGES,))
        return tuple(self._read(rows, clock_exchange, "clock exchange"))

    def senders(self, role: str | None = None) -> tuple[SenderState, ...]:
        """Every sender that spoke (of one role: ``"system"`` is each node's launcher)."""
        where, params = ("WHERE role = ?", (role,)) if role is not None else ("", ())
        rows = self._rows(f"SELECT * FROM senders {where} ORDER BY node_rank, rank", params)
        return tuple(self._read(rows, sender_state, "sender"))

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
            return checked_record(record_from_json(cls, meta))
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
        steps = self._steps_in("1", ())
        process = self._process(self._table("SELECT * FROM process ORDER BY t, rowid"))
        # A c10d launcher samples before it learns its node rank (-1): not a node yet.
        system = tuple(self._read(self._rows(
            f"SELECT * FROM system WHERE {_NODE_SAMPLE} ORDER BY t, rowid"), system_sample,
            "system"))
        return self._run_data(records, steps, process, system, totals_of(steps))

    def window_run(self, records: RunRecords, window_rows: int, policy: WindowPolicy) -> RunData:
        """What a summary over the last ``window_rows`` aligned steps per rank reads, as
        ``policy`` places that window: each rank's steps from a little before it to its
        end (enough to place it and its warm-up exactly), the process and system samples
        taken while it ran, and each rank's whole-run totals summed in SQL.  Only the
        stored rows the reader loads are checked one by one (see the module
        docstring)."""
        totals, spans = self._step_totals()
        steps = self._window_steps(spans, policy.steps_per_rank(window_rows, len(totals)), policy)
        span = policy.time_span(steps, window_rows)
        num_ranks = max(len(totals), len({s.sender.rank for s in records.senders}))
        process = self._process(self._samples_near("process", "rank", "1", span, num_ranks))
        incidents = self.incidents()
        num_nodes = len({s.sender.node_rank for s in records.senders})
        system = tuple(self._read(_dicts(self._samples_near(
            "system", "node_rank", _NODE_SAMPLE, span, num_nodes, policy.crash_spans(incidents))),
            system_sample, "system"))
        return self._run_data(records, steps, process, system, totals, incidents)

    def last_steps(self) -> dict[int, int]:
        """Each rank's highest stored step (rank -> step), from the blocks' bounds."""
        layout = self._layout()
        rows = self._rows(f"SELECT rank, MAX(last_step) AS last FROM {layout.source} "
                          f"WHERE {_READABLE_RANK} GROUP BY rank")
        return {r["rank"]: r["last"] for r in rows if type(r["last"]) is int}

    def steps_run(self, records: RunRecords, first: int, last: int,
                  ranks: Collection[int] | None = None) -> RunData:
        """Steps ``first`` to ``last`` (inclusive) of ``ranks`` (default: every rank),
        with the process and system samples and the incidents of the time they ran."""
        steps = tuple(s for s in self._steps_in(
            f"last_step >= ? AND first_step <= ? AND {_READABLE_RANK}", (first, last),
            first - 1, last) if ranks is None or s.rank in ranks)
        begins = [s.t_begin for s in steps if s.t_begin is not None]
        span = (min(begins), max(s.t for s in steps if s.t is not None)) if begins else None
        process: tuple[ProcessSample, ...] = ()
        system: tuple[SystemSample, ...] = ()
        if span is not None:
            process = tuple(p for p in self._process(self._table(
                "SELECT * FROM process WHERE t >= ? AND t <= ? ORDER BY t, rowid", span))
                if ranks is None or p.rank in ranks)
            system = tuple(self._read(self._rows(
                f"SELECT * FROM system WHERE {_NODE_SAMPLE} AND t >= ? AND t <= ? "
                "ORDER BY t, rowid", span), system_sample, "system"))
        return self._run_data(records, steps, process, system, totals_of(steps))

    def _run_data(self, records: RunRecords, steps: tuple[StepRow, ...],
                  process: tuple[ProcessSample, ...], system: tuple[SystemSample, ...],
                  totals: tuple[RankTotals, ...],
                  incidents: tuple[Incident, ...] | None = None) -> RunData:
        rejected = {**records.rejected, **self.skipped}
        return dataclasses.replace(
            run_data(dataclasses.replace(records, rejected=rejected),
                     steps, process, system,
                     self.incidents() if incidents is None else incidents, totals),
            flop_counts=self.flop_counts(), captures=self.captures())

    def _step_totals(self) -> tuple[tuple[RankTotals, ...], list[StepSpan]]:
        """Per rank, its stored steps summed in SQL from the blocks' sums (one pass
        over the blocks, not their rows), and per attempt of a rank its first and last
        step.  A rank whose sums are not what a collector writes (the file was edited)
        is summed row by row instead."""
        layout = self._layout()
        sums = ", ".join(f"SUM(sum_{c}) AS {c}" if f"sum_{c}" in layout.columns else f"0.0 AS {c}"
                         for c in BLOCK_SUMMED)
        groups = self._rows(
            "SELECT rank, restart, SUM(num_rows) AS num_rows, MIN(first_step) AS first_step, "
            f"MAX(last_step) AS last_step, {sums}, SUM(sum_eval_ms) AS eval_ms, "
            f"SUM(sum_num_eval) AS num_eval, SUM(num_cuda) AS num_cuda FROM {layout.source} "
            "GROUP BY rank, restart")
        parts: dict[int, list[RankTotals]] = {}
        spans = []
        for g in groups:
            try:
                rank = checked_integer(g["rank"], 0, MAX_WORLD_SIZE - 1)
            except ValueError:  # none of its rows can be read
                self._skip("stored step row with bad values", _count(g["num_rows"]))
                continue
            try:
                first, part = checked_integer(g["first_step"], 0), group_totals(rank, g)
            except (TypeError, ValueError):
                rows = self._steps_in("rank = ? AND restart = ?", (g["rank"], g["restart"]),
                                      count=False)  # counted where the window reads them
                if not rows:
                    continue
                first, part = min(r.step for r in rows), totals_of(rows)[0]
            parts.setdefault(rank, []).append(part)
            spans.append(StepSpan(rank, g["restart"], first, part.last_step))
        return tuple(merged_totals(parts[r]) for r in sorted(parts)), spans

    def _window_steps(self, spans: Sequence[StepSpan], window_rows: int,
                      policy: WindowPolicy) -> tuple[StepRow, ...]:
        """Each rank's steps up to the last one every rank reached, from far enough
        back that the window and its warm-up are what all of them would give."""
        if not spans:
            return ()
        last: dict[int, int] = {}
        for s in spans:
            last[s.rank] = max(last.get(s.rank, s.last), s.last)
        upper = min(last.values())
        first = min(s.first for s in spans)
        depth = policy.depth(window_rows)
        ranks = sorted(last)
        while True:
            low = upper - depth
            if low < first:  # every step up to there: read in one pass
                return self._steps_in(f"first_step <= ? AND {_READABLE_RANK}", (upper,),
                                      upper=upper)
            steps = self._steps_in(f"last_step > ? AND first_step <= ? AND {_READABLE_RANK}",
                                   (low, upper), low, upper)
            if policy.tail_decides(steps, ranks, window_rows):
                return steps
            depth *= 4  # steps missing in some rank (dropped): look further back

    def _steps_in(self, where: str, params: Sequence[Any], low: int = -1,
                  upper: float = math.inf, count: bool = True) -> tuple[StepRow, ...]:
        """The stored steps after ``low`` and up to ``upper`` of the blocks ``where``
        says (SQL on the blocks' columns), by rank, attempt and step; a row that will
        not convert is skipped (and counted, with ``count``).  SQL orders the blocks'
        ids, not the blocks: sorting the rows themselves would copy every block read
        into a temporary tree first (a third of the read of a wide job's window)."""
        layout = self._layout()
        with sqlite_errors():
            cursor = self._db.cursor()
            cursor.row_factory = None  # tuples: a dict per block costs more than the block
            cursor.execute("BEGIN")  # both reads see the store as it was at the first
            try:
                order = [i for (i,) in cursor.execute(
                    f"SELECT row_id FROM {layout.source} WHERE {where} "
                    "ORDER BY rank, restart, first_step", params)]
                decoded = {b[0]: self._decoded(layout.block(b[1:]), low, upper)
                           for b in cursor.execute(f"SELECT row_id, {layout.read} FROM "
                                                   f"{layout.source} WHERE {where}", params)}
            finally:
                self._db.rollback()  # a read-only transaction: nothing to keep
        return self._block_steps(map(decoded.__getitem__, order), count)

    def _decoded(self, block: tuple[Any, ...], low: int = -1,
                 upper: float = math.inf) -> _Block:
        """One block (rank, restart, node rank, row count and its rows: JSON, or already
        a list) as its rank, restart, row count, first and last step and its steps after
        ``low`` and up to ``upper`` (not checked yet); None for those when its rows are
        not arrays of the store's measured columns with integer steps, ascending (a store
        whose file was edited may hold anything)."""
        rank, restart, node_rank, num_rows, blob = block
        layout = self._layout()
        try:
            rows = blob if type(blob) is list else orjson.loads(blob)
            if type(rows) is not list or not rows or set(map(len, rows)) != {layout.width}:
                raise ValueError("not a block of rows")
            if layout.mapped is not None:
                rows = list(map(layout.mapped, rows))
            steps = [r[0] for r in rows]
            if set(map(type, steps)) != {int} or not all(map(operator.lt, steps, steps[1:])):
                raise ValueError("not a block of ascending steps")
        except (orjson.JSONDecodeError, TypeError, ValueError, KeyError, IndexError):
            return rank, restart, num_rows, None, []
        if not (low < steps[0] and steps[-1] <= upper):
            rows = [r for r, step in zip(rows, steps) if low < step <= upper]
        return (rank, restart, num_rows, (steps[0], steps[-1]),
                [StepRow((rank, restart, node_rank, *r)) for r in rows])

    def _block_steps(self, blocks: Iterable[_Block], count: bool = True) -> tuple[StepRow, ...]:
        """The steps of these decoded blocks (`_decoded`).  A block is read whole or not
        at all: its rows decoded, its steps after those of its attempt's block before.
        The values are checked a column at a time (`step_fields.admits_column`), row by
        row only where a column fails."""
        out: list[StepRow] = []
        previous: tuple[Any, Any, Any] = (None, None, -1)  # rank, restart, its last step
        for rank, restart, num_rows, first_last, rows in blocks:
            if first_last is None or ((rank, restart) == previous[:2]
                                      and first_last[0] <= previous[2]):
                if count:
                    self._skip("stored step row with bad values", _count(num_rows))
                continue
            previous = (rank, restart, first_last[1])
            out += rows
        return self._checked_steps(out, count)

    def _checked_steps(self, rows: list[StepRow], count: bool) -> tuple[StepRow, ...]:
        """``rows`` (every step column's value, in table order, not checked yet), a
        chunk's columns checked at once; a chunk with a bad value is checked row by row
        and its bad rows skipped (and counted, with ``count``)."""
        out: list[StepRow] = []
        for at in range(0, len(rows), _CHECKED_ROWS):
            chunk = rows[at:at + _CHECKED_ROWS]
            if all(map(step_fields.admits_column, step_fields.STEP_FIELDS, zip(*chunk))):
                out += chunk
                continue
            for row in chunk:
                try:
                    out.append(checked_step(row))
                except (TypeError, ValueError):
                    if count:
                        self._skip("stored step row with bad values")
        return tuple(out)

    def _layout(self) -> _Layout:
        """How this store's step blocks are read (see `_Layout`)."""
        if self._blocks is None:
            kind = self._rows("SELECT type FROM sqlite_master WHERE name = 'steps'")
            if kind and kind[0]["type"] == "table":  # schema 5 and older
                have = {r["name"] for r in self._rows("PRAGMA table_info(steps)")}
                self._blocks = _legacy_layout(have)
            else:
                stored = self._meta_value(BLOCK_COLUMNS_KEY)
                names = (tuple(stored) if type(stored) is list
                         and all(type(n) is str for n in stored) else _MEASURED_NAMES)
                have = {r["name"] for r in self._rows("PRAGMA table_info(step_blocks)")}
                self._blocks = _Layout(_BLOCKS, _BLOCK_READ, frozenset(have), len(names),
                                       _mapping(names))
        return self._blocks

    def _samples_near(self, table: str, source: str, where: str,
                      span: tuple[float, float] | None, num_sources: int,
                      extra: Sequence[tuple[float, float]] = ()) -> _Table:
        """The samples of ``table`` taken within ``span``; of a ``source`` with none in
        it (a window shorter than the sample interval), its samples nearest the span,
        and with no span (no step window: ``traceml watch``) its latest ones, at most
        :data:`SAMPLES_PER_SOURCE` shared out (so all of them in a short run, as
        `traceml.diagnosis.window.in_span` takes); and those within the ``extra``
        spans (merged where they overlap, asked in chunks).  Oldest first."""
        cap = max(MIN_SAMPLES_PER_SOURCE, SAMPLES_PER_SOURCE // max(1, num_sources))
        columns = f"rowid AS row_id, *, {source} AS _source"
        if span is None:
            names, rows = self._table(
                f"SELECT * FROM (SELECT {columns}, ROW_NUMBER() OVER (PARTITION BY {source} "
                f"ORDER BY t DESC) AS nearness FROM {table} WHERE {where}) WHERE nearness <= ?",
                (cap,))
        else:
            start, end = span
            inside = f"{where} AND t >= ? AND t <= ?"
            names, rows = self._table(
                f"SELECT * FROM (SELECT {columns}, ROW_NUMBER() OVER (PARTITION BY {source} "
                f"ORDER BY ABS(t - ?)) AS nearness FROM {table} WHERE {where} AND {source} "
                f"NOT IN (SELECT {source} FROM {table} WHERE {inside})) WHERE nearness <= ? "
                f"UNION ALL SELECT {columns}, 0 AS nearness FROM {table} WHERE {inside}",
                ((start + end) / 2, start, end, cap, start, end))
        spans = merged_spans(extra)
        for i in range(0, len(spans), SPANS_PER_QUERY):
            chunk = spans[i:i + SPANS_PER_QUERY]
            rows += self._table(
                f"SELECT {columns}, 0 AS nearness FROM {table} WHERE {where} AND ("
                + " OR ".join(["(t >= ? AND t <= ?)"] * len(chunk)) + ")",
                [bound for low_high in chunk for bound in low_high])[1]
        t_at = names.index("t")  # row_id is first
        rows.sort(key=lambda r: (r[t_at] if isinstance(r[t_at], (int, float)) else math.inf, r[0]))
        return names, list({r[0]: r for r in rows}.values())  # a sample in two spans once

    def incidents(self) -> tuple[Incident, ...]:
        """Every stall and crash, in the order they were reported (none in a store
        written before they were kept)."""
        if not self._has_table("incidents"):
            return ()
        return tuple(self._read(self._rows("SELECT * FROM incidents ORDER BY rowid"),
                                incident_from_row, "incident"))

    def captures(self) -> tuple[Capture, ...]:
        """Every profiler capture's asks and reports, in the order asked (none in a store
        written before captures were kept)."""
        if not self._has_table("captures"):
            return ()
        rows = tuple(self._read(self._rows("SELECT * FROM captures ORDER BY asked_at, rowid"),
                                capture_from_row, "capture"))
        return tuple(self._with_step_ms(c) for c in rows)

    def _with_step_ms(self, c: Capture) -> Capture:
        """A capture with the phase times of the steps it profiled, as traceml timed them:
        the rank's first ``num_steps`` steps that ran while the capture did."""
        if c.began_at is None or c.ended_at is None or not c.num_steps:
            return c
        low, high = c.start_after - CAPTURE_STEP_SLACK, c.start_after + c.steps_asked + CAPTURE_STEP_SLACK
        rows = self._steps_in(f"rank = ? AND last_step >= ? AND first_step <= ? AND {_READABLE_RANK}",
                              (c.rank, low, high), low - 1, high, count=False)
        began, ended = c.began_at, c.ended_at
        ran = sorted((r for r in rows if r.t_begin is not None and r.t_begin < ended
                      and r.t_begin + r.total_ms / 1e3 > began), key=lambda r: r.step)
        profiled = ran[:c.num_steps]
        if not profiled:
            return c
        names = (*(p.name for p in phases.PHASES), "compute", "total")
        return dataclasses.replace(c, step_ms=tuple(
            (name, sum(r.ms(name) for r in profiled) / len(profiled)) for name in names))

    def flop_counts(self) -> tuple[FlopCount, ...]:
        """Every rank's FLOP counts, oldest first per rank (none in a store written
        before FLOPs were counted)."""
        if not self._has_table("flop_counts"):
            return ()
        return tuple(
            FlopCount(**{k: r[k] for k in FLOP_COUNT_COLUMNS[:-1]}, ran=bool(r["ran"]),
                      rank=r["rank"])
            for r in self._rows("SELECT * FROM flop_counts ORDER BY rank, t"))

    def _has_table(self, name: str) -> bool:
        return bool(self._rows("SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?",
                               (name,)))

    def num_steps(self) -> int:
        return int(self._rows(
            f"SELECT COALESCE(SUM(num_rows), 0) AS n FROM {self._layout().source}")[0]["n"])

    def steps_after(self, row_id: int, limit: int) -> NewRows[StepRow]:
        """The newest ``limit`` steps stored after block ``row_id`` (the last block's
        row id with them)."""
        layout = self._layout()
        with sqlite_errors():
            cursor = self._db.cursor()
            cursor.row_factory = None
            newest, num_rows = [], 0
            for block in cursor.execute(
                    f"SELECT row_id, {layout.read} FROM {layout.source} WHERE row_id > ? "
                    "ORDER BY row_id DESC", (row_id,)):
                if num_rows >= limit:
                    break
                newest.append(block)
                num_rows += _count(block[4])
        steps = self._block_steps(self._decoded(layout.block(b[1:])) for b in reversed(newest))
        return NewRows(steps[max(0, len(steps) - limit):],
                       int(newest[0][0]) if newest else row_id)

    def newest_steps_after(self, row_id: int, per_rank: int,
                           most_blocks: int) -> NewRows[StepRow]:
        """Of the newest ``most_blocks`` (at least 1) blocks stored after block
        ``row_id``, those that hold one of the ``per_rank`` highest step indexes of
        their rank's attempt there, oldest block first (whole: a block may reach further
        back), and the last stored block's row id.  What a live view keeps, read
        without the rest of a backlog (a wide job's first poll, or one after a long
        build): only the blocks' headers are read to choose them (an edited header
        that lies about its last step chooses wrongly, until newer blocks come), and
        only as many as ``most_blocks`` (a poll late in a long run)."""
        if most_blocks < 1:
            raise ValueError("newest_steps_after reads at least one block")
        layout = self._layout()
        with sqlite_errors():
            cursor = self._db.cursor()
            cursor.row_factory = None
            cursor.execute("BEGIN")  # the blocks and the last row id of one moment
            try:
                (last,) = cursor.execute(f"SELECT MAX(row_id) FROM {layout.source} "
                                         "WHERE row_id > ?", (row_id,)).fetchone()
                older = cursor.execute(f"SELECT row_id FROM {layout.source} WHERE row_id > ? "
                                       "ORDER BY row_id DESC LIMIT 1 OFFSET ?",
                                       (row_id, most_blocks)).fetchone()
                after = row_id if older is None else older[0]
                blocks = cursor.execute(
                    f"SELECT {layout.read} FROM {layout.source} WHERE row_id IN ("
                    "SELECT row_id FROM (SELECT row_id, last_step, MAX(last_step) OVER "
                    f"(PARTITION BY rank, restart) AS newest FROM {layout.source} "
                    "WHERE row_id > ?) WHERE last_step > newest - ?) ORDER BY row_id",
                    (after, per_rank)).fetchall()
            finally:
                self._db.rollback()
        steps = self._block_steps(self._decoded(layout.block(b)) for b in blocks)
        return NewRows(steps, row_id if last is None else int(last))

    def process_after(self, row_id: int, limit: int) -> NewRows[ProcessSample]:
        table, last = self._after("process", row_id, limit)
        return NewRows(self._process(table), last)

    def system_after(self, row_id: int, limit: int) -> NewRows[SystemSample]:
        table, last = self._after("system", row_id, limit)
        return NewRows(tuple(self._read(_dicts(table), system_sample, "system")), last)

    def _after(self, table: str, row_id: int, limit: int) -> tuple[_Table, int]:
        """The newest ``limit`` rows of ``table`` after ``row_id`` (``row_id`` first),
        oldest first, and the last one's row id."""
        names, rows = self._table(
            f"SELECT * FROM (SELECT rowid AS row_id, * FROM {table} WHERE rowid > ? "
            "ORDER BY rowid DESC LIMIT ?) ORDER BY row_id", (row_id, limit))
        return (names, rows), (int(rows[-1][0]) if rows else row_id)

    def _meta_value(self, key: str) -> Any:
        """One meta value (None: absent or not JSON; not counted, `records` counts it)."""
        rows = self._rows("SELECT value FROM meta WHERE key = ?", (key,))
        try:
            return orjson.loads(rows[0]["value"]) if rows else None
        except (orjson.JSONDecodeError, TypeError):
            return None

    def _meta(self) -> dict[str, Any]:
        pairs = self._read(self._rows("SELECT * FROM meta"),
                           lambda r: (checked_text(r["key"]), orjson.loads(r["value"])), "meta")
        return dict(pairs)

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with sqlite_errors():
            return [dict(r) for r in self._db.execute(sql, params)]

    def _table(self, sql: str, params: Sequence[Any] = ()) -> _Table:
        """The column names and the rows as tuples (a dict per row costs more than
        its row on a wide job's samples)."""
        with sqlite_errors():
            cursor = self._db.cursor()
            cursor.row_factory = None
            rows: list[tuple[Any, ...]] = cursor.execute(sql, params).fetchall()
            return tuple(d[0] for d in cursor.description or ()), rows

    def _process(self, table: _Table) -> tuple[ProcessSample, ...]:
        """Stored process rows as samples; a row that will not convert is skipped and
        counted."""
        samples, bad = process_samples(*table)
        if bad:
            self._skip("stored process row with bad values", bad)
        return tuple(samples)


# -- the bounded read's SQL and sums --------------------------------------------------------

_MEASURED = step_fields.measured()
_MEASURED_NAMES = tuple(f.name for f in _MEASURED)
_BLOCKS = "(SELECT rowid AS row_id, * FROM step_blocks)"
CAPTURE_STEP_SLACK = 16  # steps around a capture's asked ones searched for what it profiled
_BLOCK_READ = "rank, restart, node_rank, num_rows, rows"  # what `_block_steps` reads
_CHECKED_ROWS = 4096  # step rows whose columns are checked at once


def _count(num_rows: Any) -> int:
    """A block's stored row count, for counting what was skipped (1 when it is not one)."""
    return num_rows if type(num_rows) is int and 0 < num_rows <= 1 << 31 else 1


def _literal(value: step_fields.Value) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(float(value) if type(value) is float else int(value))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a store's step blocks are read: from where (SQL), which columns of each
    block, the SQL columns there are (a sum added since reads as 0), the width of its
    rows and how one maps onto this version's measured columns (None: as it is)."""

    source: str
    read: str
    columns: frozenset[str]
    width: int
    mapped: Callable[[list[Any]], list[Any]] | None
    legacy: bool = False  # schema 5: a steps table's rows, as blocks of one

    def block(self, selected: tuple[Any, ...]) -> tuple[Any, ...]:
        """One selected block as `StoreReader._block_steps` takes it."""
        return (*selected[:4], [list(selected[4:])]) if self.legacy else selected


def _mapping(names: Sequence[str]) -> Callable[[list[Any]], list[Any]] | None:
    """A stored row of the measured columns ``names`` as this version's, each column
    it lacks as its default; None when the columns are this version's."""
    if tuple(names) == _MEASURED_NAMES:
        return None
    at = {n: i for i, n in enumerate(names)}
    defaults = [f.default for f in _MEASURED]
    pick = operator.itemgetter(*(at.get(f.name, len(names) + i) for i, f in enumerate(_MEASURED)))
    return lambda row: list(pick(row + defaults))


def _legacy_layout(have: set[str]) -> _Layout:
    """A schema-5 store's steps table read as blocks of one step each, every value
    as SQLite holds it (each column it lacks as its default)."""
    def column(name: str) -> str:
        return name if name in have else _literal(step_fields.field(name).default)

    sums = ", ".join(f"{column(c)} AS sum_{c}" for c in BLOCK_SUMMED)
    eval_ms, num_eval = column("eval_ms"), column("num_eval")
    values = ", ".join(f"{column(f.name)} AS {f.name}" for f in _MEASURED)
    source = (f"(SELECT rowid AS row_id, rank, restart, node_rank, step AS first_step, "
              f"step AS last_step, 1 AS num_rows, {sums}, "
              f"CASE WHEN {num_eval} != 0 THEN {eval_ms} ELSE 0.0 END AS sum_eval_ms, "
              f"{num_eval} AS sum_num_eval, {column('peak_allocated_bytes')} IS NOT NULL "
              f"AS num_cuda, {values} FROM steps)")
    read = "rank, restart, node_rank, num_rows, " + ", ".join(_MEASURED_NAMES)
    return _Layout(source, read, frozenset(f"sum_{c}" for c in BLOCK_SUMMED),
                   len(_MEASURED), None, legacy=True)


_NODE_SAMPLE = "node_rank >= 0"  # a c10d launcher samples before it learns its node rank
_READABLE_RANK = f"typeof(rank) = 'integer' AND rank BETWEEN 0 AND {MAX_WORLD_SIZE - 1}"
SAMPLES_PER_SOURCE = 200_000
"""Process (or system) samples a bounded read takes, shared out over the ranks (nodes),
of the sources with none taken while the window ran."""
MIN_SAMPLES_PER_SOURCE = 60

MAX_CLOCK_EXCHANGES = 200_000
"""The clock exchanges a summary reads, the oldest first (a burst's best each; a node's
bursts space out to 10 minutes: about 150 a day, so a day of 1024 nodes)."""
