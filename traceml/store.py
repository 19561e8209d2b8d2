"""The session's SQLite store: ``logs/<session>/telemetry.sqlite`` (shared: the
collector writes it; the launcher, offline analysis and the live views read it).

WAL journal, batched transactions.  One table per kind of record; the steps
table has one column per phase of `traceml.phases`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from traceml import phases
from traceml.protocol import PROCESS_FIELDS, SYSTEM_FIELDS, Sender

STORE_FILENAME = "telemetry.sqlite"
SCHEMA_VERSION = 1


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

    def values(self) -> tuple[Any, ...]:
        """The record in :data:`STEP_COLUMNS` order."""
        gpu = self.gpu_ms or (None,) * len(phases.gpu_timed())
        return (self.step, self.t_begin, self.total_ms, self.wait_ms, *self.phase_ms,
                *self.counts, self.num_skipped, self.rss_bytes, self.peak_allocated_bytes,
                self.peak_reserved_bytes, *gpu)

    def columns(self) -> dict[str, Any]:
        """The record by :data:`STEP_COLUMNS` name."""
        return dict(zip(STEP_COLUMNS, self.values()))


STEP_COLUMNS: tuple[str, ...] = (
    "step", "t_begin", "total_ms", "wait_ms",
    *(p.column for p in phases.PHASES), *(p.count_column for p in phases.PHASES),
    "num_skipped", "rss_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
    *(p.gpu_column for p in phases.gpu_timed()),
)
"""The steps table's columns after (rank, restart, node_rank), from the phase table."""

_STEP_INT = {"step", "num_skipped", "rss_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
             *(p.count_column for p in phases.PHASES)}

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
    + ", ".join(f"{c} {'INTEGER' if c in _STEP_INT else 'REAL'}" for c in STEP_COLUMNS)
    + ", PRIMARY KEY (rank, restart, step))",
    "CREATE TABLE IF NOT EXISTS rejected (reason TEXT PRIMARY KEY, count INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS process (rank INTEGER NOT NULL, restart INTEGER NOT NULL, "
    "node_rank INTEGER NOT NULL, t REAL NOT NULL, cpu_pct REAL, rss_bytes INTEGER, "
    "host_ram_total_bytes INTEGER, num_cpus INTEGER, device_allocated_bytes INTEGER, "
    "device_reserved_bytes INTEGER, device_total_bytes INTEGER)",
    "CREATE TABLE IF NOT EXISTS system (node_rank INTEGER NOT NULL, host TEXT NOT NULL, "
    "t REAL NOT NULL, cpu_pct REAL, ram_pct REAL, ram_total_bytes INTEGER, gpus TEXT)",
]


@dataclass
class SenderState:
    """What the collector keeps per sender between messages."""

    sender: Sender
    first_seen: float
    last_seen: float
    num_messages: int = 0
    num_gaps: int = 0
    last_seq: int = -1
    num_sent: int = 0
    num_dropped: int = 0
    said_bye: bool = False


class StoreWriter:
    """Appends to the store; the caller decides when to commit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        for ddl in _DDL:
            self.db.execute(ddl)
        self.set_meta({"store_schema_version": SCHEMA_VERSION})
        self.db.execute("BEGIN")

    def commit(self) -> None:
        self.db.execute("COMMIT")
        self.db.execute("BEGIN")

    def close(self) -> None:
        self.db.execute("COMMIT")
        self.db.close()

    def set_meta(self, values: dict[str, Any]) -> None:
        self.db.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            [(k, orjson.dumps(v).decode()) for k, v in values.items()],
        )

    def add_steps(self, sender: Sender, records: Iterable[StepRecord]) -> int:
        cols = ("rank", "restart", "node_rank", *STEP_COLUMNS)
        sql = (f"INSERT OR REPLACE INTO steps ({', '.join(cols)}) "
               f"VALUES ({', '.join('?' * len(cols))})")
        prefix = (sender.rank, sender.restart, sender.node_rank)
        batch = [prefix + record.values() for record in records]
        self.db.executemany(sql, batch)
        return len(batch)

    def add_process(self, sender: Sender, fields: Sequence[str],
                    rows: Iterable[Sequence[Any]]) -> None:
        index = [fields.index(f) if f in fields else None for f in PROCESS_FIELDS]
        batch = [(sender.rank, sender.restart, sender.node_rank,
                  *(row[i] if i is not None else None for i in index)) for row in rows]
        self.db.executemany(f"INSERT INTO process VALUES ({', '.join('?' * 11)})", batch)

    def add_system(self, sender: Sender, fields: Sequence[str],
                   rows: Iterable[Sequence[Any]]) -> None:
        index = {f: fields.index(f) for f in SYSTEM_FIELDS if f in fields}

        def get(row: Sequence[Any], name: str) -> Any:
            return row[index[name]] if name in index else None

        batch = [(sender.node_rank, sender.host, get(r, "t"), get(r, "cpu_pct"),
                  get(r, "ram_pct"), get(r, "ram_total_bytes"),
                  orjson.dumps(get(r, "gpus") or []).decode()) for r in rows]
        self.db.executemany("INSERT INTO system VALUES (?,?,?,?,?,?,?)", batch)

    def save_sender(self, s: SenderState) -> None:
        p = s.sender
        self.db.execute(
            "INSERT OR REPLACE INTO senders VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (p.sender_id, p.role, p.host, p.pid, p.node_rank, p.rank, p.local_rank,
             p.world_size, p.restart, s.first_seen, s.last_seen, s.num_messages, s.num_gaps,
             s.last_seq, s.num_sent, s.num_dropped, int(s.said_bye)),
        )

    def save_rejected(self, counts: dict[str, int]) -> None:
        self.db.executemany("INSERT OR REPLACE INTO rejected VALUES (?, ?)", list(counts.items()))


class StoreReader:
    """Read-only access for reports (no torch needed)."""

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        self.db.row_factory = sqlite3.Row

    def close(self) -> None:
        self.db.close()

    def meta(self) -> dict[str, Any]:
        return {r["key"]: orjson.loads(r["value"]) for r in self.db.execute("SELECT * FROM meta")}

    def steps(self) -> list[sqlite3.Row]:
        return list(self.db.execute("SELECT * FROM steps ORDER BY rank, restart, step"))

    def process(self) -> list[sqlite3.Row]:
        return list(self.db.execute("SELECT * FROM process ORDER BY t"))

    def system(self) -> list[sqlite3.Row]:
        return list(self.db.execute("SELECT * FROM system ORDER BY t"))

    def senders(self) -> list[sqlite3.Row]:
        return list(self.db.execute("SELECT * FROM senders ORDER BY node_rank, rank"))

    def rejected(self) -> dict[str, int]:
        return {r["reason"]: r["count"] for r in self.db.execute("SELECT * FROM rejected")}
