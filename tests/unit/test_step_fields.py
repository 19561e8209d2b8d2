"""The step-field table (traceml/step_fields.py) is the one place a step column is
declared: every step type, the store, the relay, the intake checks and the summary
derive from it, and a column appended to it in a child process
(tests/unit/scripts/added_step_column.py) reaches the store through a node's relay,
the recorded-scenario JSON and the summary."""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from traceml import phases, step_fields
from traceml.collector.rank_steps import step_row
from traceml.collector.step_parts import StepTiming
from traceml.records import StepRow
from traceml.store import StoreWriter
from traceml.wire import events, relay

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_every_column_of_a_fresh_store_is_the_tables_in_order(tmp_path: Path) -> None:
    """The steps view (a row per stored step, out of the blocks) has the table's columns
    in order, each value of its column's SQL type."""
    writer = StoreWriter(str(tmp_path / "s.sqlite"))
    writer.add_steps([StepRow.of(step=3, t_begin=1.5, rss_bytes=7, boundary="forward",
                                 flops_counted=True)])
    writer.close()
    db = sqlite3.connect(tmp_path / "s.sqlite")
    assert [r[1] for r in db.execute("PRAGMA table_info(steps)")] == list(step_fields.names())
    types = db.execute("SELECT " + ", ".join(f"typeof({n})" for n in step_fields.names())
                       + " FROM steps").fetchone()
    sql_types = {"INTEGER": "integer", "REAL": "real", "TEXT": "text"}
    assert list(types) == ["null" if f.optional and f.name not in ("t_begin", "rss_bytes")
                           else sql_types[f.sql_type] for f in step_fields.STEP_FIELDS]


def test_who_ran_a_step_comes_first_and_a_relay_forwards_the_rest() -> None:
    identity = [f.name for f in step_fields.STEP_FIELDS if f.identity]
    assert step_fields.names()[:len(identity)] == tuple(identity) == ("rank", "restart",
                                                                      "node_rank")
    assert relay.BLOCK_COLUMNS == list(step_fields.names()[len(identity):])


def test_every_typed_view_of_a_row_is_a_column_of_its_type() -> None:
    hints = typing.get_type_hints(StepRow)
    assert len(hints) >= 15
    for name, hint in hints.items():
        f = step_fields.field(name)
        kinds = {k for k in typing.get_args(hint) if k is not type(None)} or {hint}
        assert kinds == {f.kind}, name
        assert (type(None) in typing.get_args(hint)) == f.optional, name


def test_every_field_the_tracker_measures_is_a_column() -> None:
    """A StepTiming field is stored under its own name (``_s`` as ``_ms``): one the
    table lacks fails here, not silently in a run."""
    for name in StepTiming._fields:
        if name in ("phase_s", "counts", "marks") or name.startswith("phase_"):
            continue  # a column per phase (below); the device columns
        step_fields.field(name[:-2] + "_ms" if name.endswith("_s") else name)
    for phase in phases.PHASES:
        for name in (phase.column, phase.count_column, *phase.place_columns):
            step_fields.field(name)
    for name in events.DEVICE_MARK_FIELDS:
        step_fields.field(name)


def test_a_tracked_step_lands_in_its_columns() -> None:
    n = len(phases.PHASES)
    timing = StepTiming(7, 2.0, 0.5, tuple(0.01 * (i + 1) for i in range(n)),
                        tuple(range(1, n + 1)), 1, ((10, 20, 1.0, 2.0, 3.0, 0.5, 2.0),), 4096, 0.25,
                        32, 512, 1e9, True, "backward", 1.5, 2,
                        phase_at_s=(0.0, 0.1, None, 0.3, None, None),
                        phase_end_s=(0.1, 0.2, None, 0.4, None, None),
                        phase_last_at_s=(None, 0.25, None, None, None, None),
                        phase_last_end_s=(None, 0.3, None, None, None, None),
                        collective_spans_s=((0.1, 0.1234567), (0.2, 10.0)))
    row = step_row(timing, 1000.0, {"rank": 3, "restart": 1, "node_rank": 2})
    assert row.value("collective_spans_ms") == "100-123.457,200-10000"
    assert [row.value(p.place_columns[0]) for p in phases.PHASES] == [
        0.0, 100.0, None, pytest.approx(300.0), None, None]
    assert row.value("optimizer_end_ms") == pytest.approx(400.0)
    assert row.value("forward_last_end_ms") == pytest.approx(300.0)
    assert row.value("input_last_at_ms") is None
    assert (row.rank, row.restart, row.node_rank, row.step, row.t_begin) == (3, 1, 2, 7, 1002.0)
    assert row.ms("total") == 500.0 and row.ms("forward") == pytest.approx(20.0)
    assert row.counts == tuple(range(1, n + 1)) and row.num_skipped == 1
    # GPU compute is forward + backward + optimizer; the wait on collectives is apart.
    assert (row.peak_allocated_bytes, row.peak_reserved_bytes, row.gpu_ms) == (10, 20, 6.0)
    assert row.value("gpu_communication_ms") == 0.5
    assert row.value("gpu_collective_ms") == 2.0
    assert (row.rss_bytes, row.collective_ms, row.samples, row.tokens) == (4096, 250.0, 32, 512)
    assert (row.flops, row.flops_counted, row.boundary) == (1e9, True, "backward")
    assert (row.eval_ms, row.num_eval) == (1500.0, 2)
    assert all(map(step_fields.admits, step_fields.STEP_FIELDS, row))


@pytest.fixture(scope="module")
def added(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("added_step_column")
    done = subprocess.run([sys.executable, str(SCRIPTS / "added_step_column.py"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_an_added_column_reaches_the_store_through_a_relay(added: Path) -> None:
    db = sqlite3.connect(added / "dummy" / "telemetry.sqlite")
    rows = db.execute("SELECT rank, total_ms, dummy_ms FROM steps ORDER BY rank, step").fetchall()
    assert len(rows) == 60
    assert all(dummy == pytest.approx(total / 10) for _, total, dummy in rows)
    assert json.loads((added / "rejected.json").read_text()) == {}


def test_an_added_column_is_in_the_run_json_and_the_summary(added: Path) -> None:
    steps = json.loads((added / "run.json").read_text())["steps"]
    at = steps["fields"].index("dummy_ms")
    assert {1.0, 1.4} <= {round(r[at], 6) for r in steps["rows"]}
    doc = json.loads((added / "dummy" / "final_summary.json").read_text())
    ranks = doc["step_time"]["ranks"]
    assert [r["dummy_ms"]["p50"] for r in ranks] == pytest.approx([1.0, 1.4])
    assert doc["step_time"]["stats"]["dummy_ms"]["worst_rank"] == 1
    # The summary's schema (closed objects) derives its rank rows from the table too.
    assert (added / "schema_problems.txt").read_text() == ""


def test_a_text_column_longer_than_its_bound_is_refused() -> None:
    spans = step_fields.field("collective_spans_ms")
    longest = ",".join(["123456789.123-123456789.124"] * step_fields.MAX_SPANS)
    assert step_fields.admits(spans, longest)
    assert step_fields.admits_column(spans, [None, longest])
    assert not step_fields.admits(spans, longest + "0" * int(spans.high))
    assert not step_fields.admits_column(spans, [longest, "1-2," * 1000])


def test_spans_too_long_to_store_leave_the_step_without_spans_not_refused() -> None:
    n = len(phases.PHASES)
    timing = StepTiming(0, 0.0, 0.5, (0.0,) * n, (0,) * n, 0, collective_s=1.0,
                        collective_spans_s=tuple((1e16 + i, 1e16 + i + 0.5)
                                                 for i in range(step_fields.MAX_SPANS)))
    row = step_row(timing, 1000.0, {"rank": 0, "restart": 0, "node_rank": 0})
    assert row.value("collective_spans_ms") is None and row.collective_ms == 1000.0


_ODD_VALUES: tuple[typing.Any, ...] = (
    None, 0, 1, -1, 2, True, False, 0.0, 0.5, -0.5, 1e11, 1e11 + 1, step_fields.MAX_STEP_MS,
    step_fields.MAX_STEP_MS * 1.01, 2**62, 2**62 + 1, 2**70, 10**400, float(2**62), "backward",
    "forward", "x", "1-2", "a" * 400, [1], {}, [])


@pytest.mark.parametrize("f", step_fields.STEP_FIELDS, ids=lambda f: f.name)
def test_a_column_is_admitted_exactly_when_each_of_its_values_is(f: step_fields.StepField) -> None:
    """The summary checks its window a column at a time (sums, counts, least and greatest
    values): on every mix of wrong types, bounds and Nones it decides as the row check."""
    rng = random.Random(f.name)
    for _ in range(2000):
        column = [rng.choice(_ODD_VALUES) for _ in range(rng.randint(0, 5))]
        if rng.random() < 0.5:  # mostly the column's default, then the odd values
            column = [f.default] * rng.randint(1, 3) + column
        assert step_fields.admits_column(f, column) == all(
            step_fields.admits(f, v) for v in column), column
