"""The store's file name, schema version and schema: the tables (DDL; the steps table's
columns are `traceml.step_fields.STEP_FIELDS`), their column lists and INSERT
statements, and `StoreError`, what SQLite's exceptions become (shared: the
collector's writer and every reader use them)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence

from traceml import step_fields
from traceml.records import TOTALED
from traceml.wire.rows import PROCESS_FIELDS, SYSTEM_FIELDS

STORE_FILENAME = "telemetry.sqlite"
SCHEMA_VERSION = 8  # 2: a column per phase (communication), collective_ms
# 3: samples, tokens, flops, flops_counted, boundary, eval_ms, num_eval per step; the
# flop_counts and incidents tables
# 4: indexes on process(t) and system(t), for the summary's bounded read (a store
# without them reads the same, scanning those tables)
# 5: the hook phase's columns (hook_ms, num_hook); a store without them reads 0
# 6: steps stored in blocks (step_blocks: a rank's consecutive steps as one row, their
# values as JSON, their sums beside them); `steps` is a view of their rows (a store
# with a steps table is read through the same view's shape)
# 7: the captures table (profiler captures: the ask, then the rank's report)
# 8: the clock_exchanges table (each node's clock against node 0's, `traceml.clocks`)
JOIN_ERROR_PREFIX = "join_error/"
CLOCK_REFERENCE_KEY = "clock_reference"  # meta: [host, pid] of the launcher on the
# collector's node, which every other node's clock is set against (`traceml.clocks`)
EXPORTS_KEY = "exports"  # meta: exporter -> how its pushes went (sent, failed, endpoint, error)
LAUNCHER_LOST_KEY = "launcher_lost_at"  # meta: when the collector saw its launcher vanish
LAUNCHER_LOST_ROLE_KEY = "launcher_lost_role"  # ...which: "launcher", or "process" (init())
STORE_MODE = 0o600
"""The store's file mode (the summaries written beside it take the store's): owner only,
as they hold command lines and host names; the umask can only take bits away."""


class StoreError(Exception):
    """The store cannot be read or written (missing, not a store, busy, malformed)."""


FLOP_COUNT_COLUMNS = ("t", "flops", "dtype", "dtype_share", "device_name", "sm_count",
                      "reason", "ran")

_SENDER_COLUMNS = ("sender_id", "role", "host", "pid", "node_rank", "rank", "local_rank",
                   "world_size", "restart", "first_seen", "last_seen", "num_messages",
                   "num_gaps", "last_seq", "num_sent", "num_dropped", "said_bye")

BLOCK_COLUMNS_KEY = "step_block_columns"
"""meta: the columns of a block's JSON rows, in order, as this store's writer had them
(a reader maps them onto its own: a column added since reads as its default)."""

BLOCK_SUMMED = tuple(p.column for p in TOTALED)
"""The step columns a block's row carries the sums of (``sum_<column>``)."""

BLOCK_HEADER: tuple[tuple[str, str], ...] = (
    ("rank", "INTEGER"), ("restart", "INTEGER"), ("node_rank", "INTEGER"),
    ("first_step", "INTEGER"), ("last_step", "INTEGER"), ("num_rows", "INTEGER"),
    *((f"sum_{c}", "REAL") for c in BLOCK_SUMMED),
    ("sum_eval_ms", "REAL"),  # of the steps with evaluation passes (num_eval > 0)
    ("sum_num_eval", "INTEGER"), ("num_cuda", "INTEGER"))  # steps with CUDA peaks
"""A step block's columns before its rows: who ran the steps, which steps, and the
sums a summary's whole-run totals add up in SQL without opening the rows.  ``rows``
(JSON, one array per step of `traceml.step_fields.measured` values in table order,
ascending steps) follows them."""

DDL = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS senders (
        sender_id TEXT PRIMARY KEY, role TEXT NOT NULL, host TEXT NOT NULL,
        pid INTEGER NOT NULL, node_rank INTEGER NOT NULL, rank INTEGER,
        local_rank INTEGER, world_size INTEGER, restart INTEGER NOT NULL,
        first_seen REAL NOT NULL, last_seen REAL NOT NULL,
        num_messages INTEGER NOT NULL DEFAULT 0, num_gaps INTEGER NOT NULL DEFAULT 0,
        last_seq INTEGER NOT NULL DEFAULT -1, num_sent INTEGER NOT NULL DEFAULT 0,
        num_dropped INTEGER NOT NULL DEFAULT 0, said_bye INTEGER NOT NULL DEFAULT 0)""",
    "CREATE TABLE IF NOT EXISTS step_blocks ("
    + ", ".join(f"{c} {t} NOT NULL" for c, t in BLOCK_HEADER) + ", rows BLOB NOT NULL)",
    # The window's read: the blocks that end after a step (the run's tail).
    "CREATE INDEX IF NOT EXISTS step_blocks_last ON step_blocks (last_step)",
    "CREATE VIEW IF NOT EXISTS steps AS SELECT b.rank AS rank, b.restart AS restart, "
    "b.node_rank AS node_rank, "
    + ", ".join(f"json_extract(r.value, '$[{i}]') AS {f.name}"
                for i, f in enumerate(step_fields.measured()))
    # A block whose rows are not JSON (a forged relay batch, an edited file) has no
    # steps here rather than breaking the view for every block; the reader counts it.
    + " FROM step_blocks AS b, json_each(CASE WHEN json_valid(CAST(b.rows AS TEXT)) "
    "THEN CAST(b.rows AS TEXT) ELSE '[]' END) AS r",
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
    "CREATE TABLE IF NOT EXISTS captures (capture_id TEXT NOT NULL, rank INTEGER NOT NULL, "
    "role TEXT NOT NULL, trigger TEXT NOT NULL, label TEXT NOT NULL, phase TEXT, "
    "asked_at REAL NOT NULL, start_after INTEGER NOT NULL, steps_asked INTEGER NOT NULL, "
    "reported_at REAL, num_steps INTEGER NOT NULL DEFAULT 0, began_at REAL, ended_at REAL, "
    "host TEXT, path TEXT, trace_bytes INTEGER NOT NULL DEFAULT 0, cut TEXT, error TEXT, "
    "operators TEXT NOT NULL DEFAULT '[]', PRIMARY KEY (capture_id, rank))",
    # A node's launcher (host and pid: it may not know its node rank yet) against node
    # 0's clock: the best exchange of each burst (`traceml.clocks`).
    "CREATE TABLE IF NOT EXISTS clock_exchanges (host TEXT NOT NULL, pid INTEGER NOT NULL, "
    "t1 REAL NOT NULL, t2 REAL NOT NULL, t3 REAL NOT NULL, t4 REAL NOT NULL)",
]

_INCIDENT_COLUMNS = ("what", "rank", "node_rank", "host", "pid", "began_at", "detected_at",
                     "cleared_at", "step", "phase", "open_phases", "stack", "stack_source",
                     "detail")


def _insert(table: str, columns: Sequence[str], verb: str = "INSERT") -> str:
    return (f"{verb} INTO {table} ({', '.join(columns)}) "
            f"VALUES ({', '.join('?' * len(columns))})")


STEP_BLOCK_SQL = _insert("step_blocks", (*(c for c, _ in BLOCK_HEADER), "rows"))
PROCESS_SQL = _insert("process", ("rank", "restart", "node_rank", *PROCESS_FIELDS))
FLOP_COUNT_SQL = _insert("flop_counts", ("rank", "restart", "node_rank", *FLOP_COUNT_COLUMNS))
SYSTEM_SQL = _insert("system", ("node_rank", "host", *SYSTEM_FIELDS))
# A sender's state is updated in place (a replace would delete and insert its row).
SENDER_SQL = (_insert("senders", _SENDER_COLUMNS) + " ON CONFLICT(sender_id) DO UPDATE SET "
              + ", ".join(f"{c} = excluded.{c}" for c in _SENDER_COLUMNS[1:]))
REJECTED_SQL = _insert("rejected", ("reason", "count"), "INSERT OR REPLACE")
INCIDENT_SQL = _insert("incidents", _INCIDENT_COLUMNS)
CAPTURE_ASK_SQL = _insert("captures", ("capture_id", "rank", "role", "trigger", "label", "phase",
                                       "asked_at", "start_after", "steps_asked"),
                          "INSERT OR IGNORE")
CAPTURE_REPORT_SQL = ("UPDATE captures SET reported_at = ?, num_steps = ?, began_at = ?, "
                      "ended_at = ?, host = ?, path = ?, trace_bytes = ?, cut = ?, error = ?, "
                      "operators = ? WHERE capture_id = ? AND rank = ? AND reported_at IS NULL")
CLOCK_EXCHANGE_SQL = _insert("clock_exchanges", ("host", "pid", "t1", "t2", "t3", "t4"))
META_SQL = ("INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value")


@contextlib.contextmanager
def sqlite_errors() -> Iterator[None]:
    """SQLite's exceptions as StoreError."""
    try:
        yield
    except sqlite3.Error as exc:
        raise StoreError(str(exc)) from exc
