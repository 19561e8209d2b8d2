"""The session's SQLite store, ``logs/<session>/telemetry.sqlite``, and every SQL
statement traceml runs (shared: the collector writes it; the launcher, offline
analysis and the live views read it).

WAL journal, batched transactions.  One table per kind of record; the steps
table has the columns of `traceml.step_fields` (among them one per phase of
`traceml.phases`); the meta table holds the launcher's `RunStart` and `RunEnd` (one
JSON value per field, keyed by the field's name) and the nodes whose options did not
match (``join_error/<t>``).
`StoreWriter` takes typed records; `StoreReader` gives back `RunData` and the
same records: every row, what a summary over its window reads (that window's
rows, the samples taken while it ran, and per-rank sums over the whole run in
SQL: `StoreReader.window_run`), or the rows added since a rowid (the live
views' tail).
Whatever SQLite raises comes out as `StoreError`.  A stored row whose values
no collector writes (a string for a time, NaN, a world of 10^12 ranks: the
file was edited or damaged) is skipped and counted with the rejections, so a
summary always builds from what is left.

Modules: ``schema`` (file name, schema version, tables, column lists, INSERT
statements, `StoreError`), ``records`` (the record types), ``writer``
(`StoreWriter`), ``reader`` (`StoreReader` and the bounded read), ``queries`` (its SQL
helpers),
``rows`` (stored rows checked and converted into samples; `run_data`).  Import
from here: the names below are the store's interface.
"""

from traceml.store.reader import StoreReader
from traceml.store.records import (
    JoinError,
    NewRows,
    RunRecords,
    SenderState,
)
from traceml.store.rows import paused_gc, run_data
from traceml.store.schema import (
    JOIN_ERROR_PREFIX,
    SCHEMA_VERSION,
    STORE_FILENAME,
    STORE_MODE,
    StoreError,
)
from traceml.store.writer import StoreWriter, relayed_rows, step_block

__all__ = [
    "JOIN_ERROR_PREFIX",
    "SCHEMA_VERSION",
    "STORE_FILENAME",
    "STORE_MODE",
    "JoinError",
    "NewRows",
    "RunRecords",
    "SenderState",
    "StoreError",
    "StoreReader",
    "StoreWriter",
    "paused_gc",
    "relayed_rows",
    "run_data",
    "step_block",
]
