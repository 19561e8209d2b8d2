"""The store: records written typed and read back typed, the on-disk format pinned
(an existing session folder must still be readable)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.rows import sent_by, step_record
from traceml import step_fields
from traceml.errors import UsageError
from traceml.report.session import load_run
from traceml.store import (
    SCHEMA_VERSION,
    JoinError,
    NewRows,
    SenderState,
    StoreError,
    StoreReader,
    StoreWriter,
    step_block,
)
from traceml.wire.identity import MAX_WORLD_SIZE, Sender
from traceml.wire.records import RunEnd, RunStart
from traceml.wire.rows import PROCESS_FIELDS, SYSTEM_FIELDS, ProcessRows, SystemRows

T0 = 1_700_000_000.0
START = RunStart(session_id="s1", command=("traceml", "run", "train.py"), started_at=T0,
                 traceml_version="9.9", torch_version="2.x", python_version="3.11.1",
                 summary_window_rows=50, mode="run", expected_world_size=2, expected_nodes=1)
END = RunEnd(ended_at=T0 + 30, exit_code=3)
RANK = Sender(role="rank", host="h", pid=10, node_rank=0, rank=0, local_rank=0, world_size=2)
NODE = Sender(role="system", host="h", pid=9, node_rank=0)


def _store(path: Path) -> None:
    writer = StoreWriter(str(path))
    writer.save_run(START)
    writer.add_join_error(JoinError(T0 + 2, "node on b has --nnodes '3'"))
    writer.add_join_error(JoinError(T0 + 1, "node on a has --nnodes '4'"))
    writer.save_sender(SenderState(RANK, T0, T0 + 5, num_messages=4, last_seq=3, num_sent=4,
                                   num_dropped=1, said_bye=True))
    writer.save_sender(SenderState(NODE, T0, T0 + 6, num_gaps=2))
    writer.save_rejected({"foreign session": 2})
    writer.add_steps(sent_by(RANK, [step_record(s, t_begin=T0 + s, total_ms=10.0, input_ms=1.0)
                            for s in range(3)]))
    writer.add_process(RANK, ProcessRows(PROCESS_FIELDS[:3], [[T0, 50.0, 1024]]))
    writer.add_system(NODE, SystemRows(SYSTEM_FIELDS, [[T0, 10.0, 20.0, 4096, [[0, 1.0, 2, 3, 4.0, 5.0]]]]))
    writer.add_system(Sender("system", "h", 8, -1), SystemRows(SYSTEM_FIELDS, [[T0, 1.0, 2.0, 3, []]]))
    writer.save_run(END)
    writer.close()


def test_what_is_written_reads_back_typed(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.sqlite"
    _store(db)
    with StoreReader(db) as reader:
        records = reader.records()
        run = reader.run(records)
        assert reader.join_errors() == (JoinError(T0 + 1, "node on a has --nnodes '4'"),
                                        JoinError(T0 + 2, "node on b has --nnodes '3'"))
        assert [s.sender for s in reader.senders(role="system")] == [NODE]
        assert reader.num_steps() == 3
        tail = reader.steps_after(0, 2)
        assert [(s.restart, s.step) for s in tail.rows] == [(0, 1), (0, 2)]
        assert reader.steps_after(tail.last_row_id, 2).rows == ()
    assert (records.start, records.end, dict(records.rejected)) == (
        START, END, {"foreign session": 2})
    assert records.senders[1] == SenderState(RANK, T0, T0 + 5, 4, 0, 3, 4, 1, True)
    assert (run.meta.session_id, run.meta.command, run.meta.exit_code) == (
        "s1", ["traceml", "run", "train.py"], 3)
    assert (run.meta.world_size, run.meta.missing_ranks, run.meta.partial) == (2, (1,), True)
    assert run.meta.transport == {"sent": 4, "dropped": 1, "gaps": 2, "rejected": 2}
    assert [r.phase_ms["input"] for r in run.steps] == [1.0, 1.0, 1.0]
    assert run.steps[2].t == T0 + 2 + 0.01
    assert (run.process[0].rss_bytes, run.process[0].device_total_bytes) == (1024, None)
    assert [s.node_rank for s in run.system] == [0]  # not the launcher without a node rank
    assert run.system[0].gpus[0].mem_total_bytes == 3


def test_the_meta_table_keeps_one_json_value_per_field(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.sqlite"
    _store(db)
    with sqlite3.connect(db) as raw:
        meta = dict(raw.execute("SELECT key, value FROM meta"))
    assert meta["session_id"] == '"s1"' and meta["command"] == '["traceml","run","train.py"]'
    assert (meta["started_at"], meta["summary_window_rows"], meta["mode"]) == (
        str(T0), "50", '"run"')
    assert (meta["ended_at"], meta["exit_code"], meta["store_schema_version"]) == (
        str(T0 + 30), "3", str(SCHEMA_VERSION))
    assert meta[f"join_error/{T0 + 1:.6f}"] == '"node on a has --nnodes \'4\'"'


def test_a_store_without_run_records_still_reads(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.sqlite"
    StoreWriter(str(db)).close()
    run, window_rows = load_run(tmp_path)
    assert (run.meta.session_id, run.meta.exit_code, run.meta.mode, window_rows) == (
        "", None, "run", 10000)


def test_what_is_not_a_store_is_a_store_error(tmp_path: Path) -> None:
    bad = tmp_path / "telemetry.sqlite"
    bad.write_bytes(b"not a database, not at all" * 100)
    with pytest.raises(StoreError):
        StoreReader(bad)
    with pytest.raises(UsageError, match="cannot read"):
        load_run(tmp_path)


def _value(name: str, value: str) -> str:
    """SQL that sets step 1's ``name`` (in its block's JSON) to the JSON ``value``."""
    at = [f.name for f in step_fields.measured()].index(name)
    return (f"UPDATE step_blocks SET rows = json_replace(CAST(rows AS TEXT), '$[1][{at}]', "
            f"json('{value}'))")


@pytest.mark.parametrize(("sql", "kept", "skipped"), [
    (_value("total_ms", '"abc"'), [0, 2], 1),
    (_value("input_ms", "1e300"), [0, 2], 1),  # beyond any step
    (_value("wait_ms", "-5"), [0, 2], 1),
    (_value("boundary", '"nowhere"'), [0, 2], 1),
    (_value("num_input", "1.5"), [0, 2], 1),
    # the block's own columns: its rows cannot be placed
    ("UPDATE step_blocks SET rank = 10000000000", [], 3),
    ("UPDATE step_blocks SET rows = CAST('[[1, 2' AS BLOB)", [], 3),
    # steps out of order in a block, a step that is not an integer
    ("UPDATE step_blocks SET rows = json_replace(CAST(rows AS TEXT), '$[1][0]', 7)", [], 3),
    ("UPDATE step_blocks SET rows = json_replace(CAST(rows AS TEXT), '$[0][0]', 'x')", [], 3),
])
def test_a_bad_stored_step_is_skipped_and_counted(tmp_path: Path, sql: str, kept: list[int],
                                                  skipped: int) -> None:
    from traceml.report.session import write_summary

    _store(tmp_path / "telemetry.sqlite")
    db = sqlite3.connect(tmp_path / "telemetry.sqlite")
    db.execute(sql)
    db.commit()
    db.close()
    files = write_summary(tmp_path)
    assert [r.step for r in files.run.steps] == kept
    assert files.summary["meta"]["rejected"] == {"foreign session": 2,
                                                 "stored step row with bad values": skipped}
    if kept:
        assert (f"Rejected: {2 + skipped} (foreign session 2, stored step row with bad values "
                f"{skipped})") in files.text


def test_steps_are_stored_in_blocks_once_each(tmp_path: Path) -> None:
    """A run of a rank's steps is one block row; a step at or before the last one stored
    of its attempt (a resent batch) is a duplicate, kept out; the steps view shows
    every stored step as a row, for SQL."""
    path = tmp_path / "telemetry.sqlite"
    writer = StoreWriter(str(path))
    other = dataclasses.replace(RANK, rank=1, pid=11)
    rows = [*sent_by(RANK, [step_record(s, total_ms=10.0 + s) for s in range(3)]),
            *sent_by(other, [step_record(s, total_ms=20.0) for s in range(2)])]
    assert writer.add_steps(rows) == 5
    assert writer.add_steps(sent_by(RANK, [step_record(s, total_ms=99.0) for s in (1, 2, 3)])) == 1
    assert writer.add_steps(sent_by(RANK, [step_record(s) for s in (5, 4, 4)])) == 2
    writer.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT rank, first_step, last_step, num_rows, sum_total_ms "
                      "FROM step_blocks ORDER BY rowid").fetchall() == [
        (0, 0, 2, 3, 33.0), (1, 0, 1, 2, 40.0), (0, 3, 3, 1, 99.0), (0, 4, 5, 2, 0.0)]
    assert db.execute("SELECT rank, step, total_ms FROM steps WHERE rank = 0 ORDER BY step"
                      ).fetchall() == [(0, 0, 10.0), (0, 1, 11.0), (0, 2, 12.0), (0, 3, 99.0),
                                       (0, 4, 0.0), (0, 5, 0.0)]
    db.close()
    with StoreReader(path) as reader:
        assert reader.num_steps() == 8
        assert [(r.rank, r.step) for r in reader.run(reader.records()).steps] == [
            (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (1, 1)]
        newest = reader.steps_after(0, 3)
        assert [(r.rank, r.step) for r in newest.rows] == [(0, 3), (0, 4), (0, 5)]
        assert reader.steps_after(newest.last_row_id, 10).rows == ()
        # each rank's newest 2 steps, in whole blocks, oldest block first
        per_rank = reader.newest_steps_after(0, 2, 100)
        assert [(r.rank, r.step) for r in per_rank.rows] == [
            (1, 0), (1, 1), (0, 4), (0, 5)]
        assert per_rank.last_row_id == newest.last_row_id == 4
        assert [(r.rank, r.step) for r in reader.newest_steps_after(1, 3, 100).rows] == [
            (1, 0), (1, 1), (0, 3), (0, 4), (0, 5)]
        assert reader.newest_steps_after(4, 2, 100) == NewRows((), 4)
        # chosen among the newest 2 blocks only: rank 1's is older
        bounded = reader.newest_steps_after(0, 3, 2)
        assert [(r.rank, r.step) for r in bounded.rows] == [(0, 3), (0, 4), (0, 5)]
        assert bounded.last_row_id == 4
        with pytest.raises(ValueError, match="at least one block"):
            reader.newest_steps_after(0, 3, 0)


def test_a_step_or_sum_no_block_can_hold_refuses_that_ranks_run_only() -> None:
    """A rank's run whose steps sum to a time no steps add up to, or carry a step index
    that is not one, or a value JSON cannot hold, makes no block (a relay counts it
    where it makes the block, node 0's writer where it does); a bad value that leaves
    the sums possible makes one (the reader skips its row)."""
    names = [f.name for f in step_fields.measured()]

    def run(column: str | None = None, at: int = 0, value: object = None) -> list[list[object]]:
        rows = [list(step_record(s, total_ms=10.0)[3:]) for s in range(4)]
        if column is not None:
            rows[at][names.index(column)] = value
        return rows

    nested: list[object] = []
    for _ in range(300):  # deeper than JSON can be written back
        nested = [nested]
    for bad in (("total_ms", 1, 5e13), ("step", 1, "9"), ("step", 0, -1),
                ("boundary", 1, nested)):
        with pytest.raises(ValueError):
            step_block(run(*bad))
    block = step_block(run("total_ms", 1, -1.0))  # sums to 29: possible
    assert block is not None and block[:3] == (0, 3, 4)
    assert step_block(run(), last=1)[:3] == (2, 3, 2)  # type: ignore[index]
    assert step_block(run(), last=3) is None


def test_node_0_stores_a_relays_blocks_as_they_came_and_refuses_a_forged_header(
        tmp_path: Path) -> None:
    """A relay's blocks are stored as they came; one whose header `step_block` would
    not make (a forged or corrupted batch) is refused and counted with its rows; one
    that reaches back to stored steps (a resent batch) keeps only the new ones."""
    writer = StoreWriter(str(tmp_path / "telemetry.sqlite"))

    def relayed(rank: int, steps: range, **edit: object) -> tuple[tuple[int, int, int], list]:
        rows = [list(step_record(s, total_ms=10.0)[3:]) for s in steps]
        block = step_block(rows)
        assert block is not None
        header = dict(zip(("first", "last", "n"), block[:3]))
        header.update(edit)  # type: ignore[arg-type]
        sums = list(block[3:-1])
        if edit.get("negative_sum"):
            sums[0] = -1.0
        return ((rank, 0, 0), [header["first"], header["last"], header["n"], *sums,
                               edit.get("rows", block[-1].decode())])

    good = [relayed(0, range(4)), relayed(1, range(2))]
    forged = [relayed(2, range(4), n=9), relayed(3, range(4), first=3, last=1),
              relayed(4, range(4), first=True), relayed(5, range(4), rows=[[1]]),
              relayed(6, range(4), negative_sum=True)]
    assert writer.add_relayed_blocks(good + forged) == 6
    assert writer.num_bad_steps == 9 + 4 + 4 + 4 + 4  # as many as each header says
    assert writer.add_relayed_blocks([relayed(0, range(2, 6))]) == 2  # steps 4 and 5 new
    writer.close()
    with StoreReader(tmp_path / "telemetry.sqlite") as reader:
        steps = reader.run(reader.records()).steps
    assert sorted((r.rank, r.step) for r in steps) == [
        *((0, s) for s in range(6)), (1, 0), (1, 1)]


def test_a_relayed_block_whose_rows_are_not_json_or_not_its_rows_is_refused(
        tmp_path: Path) -> None:
    """A resent block whose rows are not the rows its header says (not JSON, empty, too
    short, not a list) is refused and counted; a forged count counts as one step.  A
    new block's rows are not parsed on node 0: rows that are not JSON (or nest deeper
    than SQLite reads) are stored, and the reader skips and counts that block, while
    the ``steps`` view leaves it out instead of failing for every block."""
    writer = StoreWriter(str(tmp_path / "telemetry.sqlite"))

    def block(rank: int, steps: range, rows: str | None = None) -> tuple[tuple[int, int, int],
                                                                         list[object]]:
        made = step_block([list(step_record(s, total_ms=10.0)[3:]) for s in steps])
        assert made is not None
        return (rank, 0, 0), [*made[:-1], made[-1].decode() if rows is None else rows]

    deep = "[" * 2500 + "]" * 2500
    assert writer.add_relayed_blocks([block(0, range(2)), block(1, range(2), "[[1,"),
                                      block(2, range(2), deep), block(3, range(3))]) == 9
    for rows in ("[[]]", "[[50]]", "5", "null", "[[1,"):  # resent: rank 0's steps 0-1 again
        assert writer.add_relayed_blocks([block(0, range(2), rows)]) == 0
    assert writer.num_bad_steps == 5 * 2
    forged = block(4, range(2))
    forged[1][2] = 2**62
    assert writer.add_relayed_blocks([forged]) == 0 and writer.num_bad_steps == 10 + 1
    assert writer.add_relayed_blocks([block(3, range(1, 5))]) == 2  # resent, trimmed: 3, 4
    writer.commit()
    assert writer.db.execute("SELECT rank, COUNT(*) FROM steps GROUP BY rank").fetchall() == [
        (0, 2), (3, 5)]
    writer.close()
    with StoreReader(tmp_path / "telemetry.sqlite") as reader:
        steps = reader.run(reader.records()).steps
        assert sorted({r.rank for r in steps}) == [0, 3]
        assert reader.skipped == {"stored step row with bad values": 4}


def test_a_step_column_added_since_a_store_was_written_reads_as_its_default(
        tmp_path: Path) -> None:
    """A schema-6 store written before a column existed (here: without eval_ms and
    the hook phase's columns and sum): its rows are mapped by the columns its writer
    named, a column it lacks read as its default, a sum it lacks as 0."""
    path = tmp_path / "telemetry.sqlite"
    _store(path)
    gone = ("eval_ms", "hook_ms", "num_hook")
    names = [f.name for f in step_fields.measured()]
    kept = [i for i, n in enumerate(names) if n not in gone]
    db = sqlite3.connect(path)
    for row_id, blob in db.execute("SELECT rowid, rows FROM step_blocks").fetchall():
        rows = [[r[i] for i in kept] for r in json.loads(blob)]
        db.execute("UPDATE step_blocks SET rows = ? WHERE rowid = ?", (json.dumps(rows), row_id))
    db.execute("UPDATE meta SET value = ? WHERE key = 'step_block_columns'",
               (json.dumps([names[i] for i in kept]),))
    db.execute("ALTER TABLE step_blocks DROP COLUMN sum_hook_ms")
    db.commit()
    db.close()
    with StoreReader(path) as reader:
        steps = reader.run(reader.records()).steps
    assert [(r.step, r.total_ms, r.eval_ms, r.value("hook_ms")) for r in steps] == [
        (s, 10.0, 0.0, 0.0) for s in range(3)]
    run, _ = load_run(tmp_path)
    assert run.totals is not None and run.totals[0].sum_ms["hook"] == 0.0


def test_a_store_written_before_step_blocks_reads_the_same(tmp_path: Path) -> None:
    """A schema-5 store (a steps table, one row per step, the hook columns missing as
    in schema 4) is read through the same path, the missing columns as their defaults."""
    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir()
    old.mkdir()
    _store(new / "telemetry.sqlite")
    _store(old / "telemetry.sqlite")
    db = sqlite3.connect(old / "telemetry.sqlite")
    columns = [f for f in step_fields.STEP_FIELDS if f.name not in ("hook_ms", "num_hook")]
    db.executescript(
        "DROP VIEW steps; CREATE TABLE steps ("
        + ", ".join(f"{f.name} {f.sql_type}" for f in columns)
        + ", PRIMARY KEY (rank, restart, step)); INSERT INTO steps SELECT "
        + ", ".join(f"json_extract(r.value, '$[{[m.name for m in step_fields.measured()].index(f.name)}]')"
                    if not f.identity else f"b.{f.name}" for f in columns)
        + " FROM step_blocks AS b, json_each(CAST(b.rows AS TEXT)) AS r; DROP TABLE step_blocks;")
    db.close()
    with StoreReader(old / "telemetry.sqlite") as was, StoreReader(new / "telemetry.sqlite") as now:
        assert was.run(was.records()).steps == now.run(now.records()).steps
        assert was.num_steps() == 3
    assert load_run(old)[0].steps == load_run(new)[0].steps
    db = sqlite3.connect(old / "telemetry.sqlite")
    db.execute("UPDATE steps SET t_begin = 1733212345.123456789 WHERE step = 0")
    db.execute("UPDATE steps SET wait_ms = x'00' WHERE step = 1")  # a BLOB: that row only
    db.commit()
    db.close()
    with StoreReader(old / "telemetry.sqlite") as was:
        steps = was.run(was.records()).steps
        assert [r.step for r in steps] == [0, 2]
        assert steps[0].t_begin == 1733212345.123456789  # every digit, as SQLite holds it
        assert [r.step for r in was.newest_steps_after(0, 2, 10).rows] == [2]  # a block a step
    with pytest.raises(StoreError, match="older traceml"):
        StoreWriter(str(old / "telemetry.sqlite"))


def test_once_the_summary_json_is_there_its_text_is_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tools (and tests) wait for final_summary.json: it is written last, so whoever
    sees it finds the text of the same summary beside it."""
    from traceml.report import session, summary_files

    _store(tmp_path / "telemetry.sqlite")
    files = session.build_summary(tmp_path)
    renamed = os.replace
    seen: list[str] = []

    def watched(source: Path, target: Path) -> None:
        if Path(target) == files.json_path:
            seen.append(files.text_path.read_text() if files.text_path.exists() else "")
        renamed(source, target)

    monkeypatch.setattr(summary_files.os, "replace", watched)
    session.save_summary(files)
    assert seen == [files.text]


def test_bad_stored_records_leave_a_summary(tmp_path: Path) -> None:
    from traceml.report.session import write_summary

    _store(tmp_path / "telemetry.sqlite")
    db = sqlite3.connect(tmp_path / "telemetry.sqlite")
    db.execute("UPDATE senders SET world_size = 1000000000000 WHERE role = 'rank'")
    db.execute("UPDATE meta SET value = '1000000000000' WHERE key = 'expected_world_size'")
    db.execute("INSERT INTO meta VALUES ('junk', '{not json')")
    db.execute("UPDATE process SET cpu_pct = 'x'")
    db.execute("UPDATE system SET gpus = '[[\"a\"]]' WHERE node_rank = 0")
    db.commit()
    db.close()
    files = write_summary(tmp_path)
    assert files.run.meta.world_size == 1  # from the one rank's steps left
    assert files.summary["meta"]["rejected"] == {
        "foreign session": 2, "stored sender row with bad values": 1,
        "stored meta row with bad values": 1, "stored RunStart with bad values": 1,
        "stored process row with bad values": 1, "stored system row with bad values": 1}


def test_a_process_table_an_edit_left_without_a_column_still_reads(tmp_path: Path) -> None:
    """A store whose process table lost a column (an edited file) reads as before: a
    device column is taken as not measured, and the summary and the live tail go on."""
    from traceml.report.session import write_summary

    _store(tmp_path / "telemetry.sqlite")
    db = sqlite3.connect(tmp_path / "telemetry.sqlite")
    db.execute("ALTER TABLE process DROP COLUMN device_total_bytes")
    db.commit()
    db.close()
    files = write_summary(tmp_path)
    assert [(p.rank, p.cpu_pct, p.device_total_bytes) for p in files.run.process] == [
        (0, 50.0, None)]
    with StoreReader(tmp_path / "telemetry.sqlite") as reader:
        assert [p.rss_bytes for p in reader.process_after(0, 5).rows] == [1024]


def test_report_on_a_store_with_garbage_pages_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from traceml.cli import main

    _store(tmp_path / "telemetry.sqlite")
    data = bytearray((tmp_path / "telemetry.sqlite").read_bytes())
    page = 4096
    for offset in range(page, len(data), page):  # every page but the header's
        data[offset:offset + page] = os.urandom(page)
    (tmp_path / "telemetry.sqlite").write_bytes(bytes(data))
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read" in err[0] and "malformed" in err[0], err


def test_a_pause_ages_what_was_made_only_on_the_main_thread() -> None:
    """The summary (main thread) sends what it made to the oldest generation; a live
    view's poll on another thread (in the collector) leaves every thread's young
    objects young, so a young collection still frees the message loop's cycles."""
    import gc
    import threading
    import weakref

    from traceml.store import paused_gc

    class Node:
        def __init__(self) -> None:
            self.me = self

    def pause() -> None:
        with paused_gc():
            pass

    def paused_on(thread: str) -> bool:
        """Whether a cycle made before a pause on ``thread`` survives a young collection."""
        gc.collect()
        cycle = Node()
        alive = weakref.ref(cycle)
        if thread == "main":
            pause()
        else:
            worker = threading.Thread(target=pause)
            worker.start()
            worker.join()
        del cycle
        gc.collect(1)
        survived = alive() is not None
        gc.collect()
        assert alive() is None and gc.isenabled()
        return survived

    assert gc.isenabled()
    assert paused_on("main")
    assert not paused_on("another")


_ODD_SAMPLE_VALUES: tuple[Any, ...] = (
    None, 0, 1, -1, -2, 0.0, 2.5, -2.5, 2**62, 2**62 + 1, 10**30, float(2**62) * 2, math.inf,
    -math.inf, MAX_WORLD_SIZE - 1, MAX_WORLD_SIZE, "x", b"\x00")


def test_process_samples_are_checked_by_column_as_row_by_row() -> None:
    """A window's process samples are checked a column at a time (types, least and
    greatest values): on every mix of odd values SQLite can hold, the samples read and
    the rows skipped are those of the row-by-row conversion."""
    from traceml.store.rows import process_sample, process_samples

    names = ("row_id", "rank", "restart", "node_rank", "t", "cpu_pct", "rss_bytes",
             "host_ram_total_bytes", "num_cpus", "device_allocated_bytes",
             "device_reserved_bytes", "device_total_bytes")
    good = (1, 3, 0, 0, 1.7e9, 50.0, 2**30, 2**34, 8, None, None, None)
    rng = random.Random(7)
    for _ in range(3000):
        rows = []
        for i in range(rng.randint(0, 4)):
            row = list(good)
            row[0] = i
            for _ in range(rng.randint(0, 2)):
                row[rng.randrange(1, len(names))] = rng.choice(_ODD_SAMPLE_VALUES)
            rows.append(tuple(row))
        one_by_one = []
        for row in rows:
            try:
                one_by_one.append(process_sample(dict(zip(names, row))))
            except (TypeError, ValueError):
                pass
        assert process_samples(names, rows) == (one_by_one, len(rows) - len(one_by_one)), rows


def test_good_process_samples_take_the_column_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows a collector writes are converted by the column check alone (the point of it:
    no call per row), and a table an edit left without a column is read row by row: the
    rows missing a value that has no default are skipped, none is lost otherwise."""
    from traceml.store import rows

    names = ("rank", "node_rank", "t", "cpu_pct", "rss_bytes", "host_ram_total_bytes",
             "num_cpus", "device_allocated_bytes", "device_reserved_bytes", "device_total_bytes")
    good = [(r, 0, 1.7e9 + r, 50.0, 2**30, 2**34, 8, None, None, 0) for r in range(3)]
    expected = [rows.process_sample(dict(zip(names, r))) for r in good]

    def per_row(r: object) -> None:
        raise AssertionError("a row converted one at a time")

    with monkeypatch.context() as patched:
        patched.setattr(rows, "process_sample", per_row)
        assert rows.process_samples(names, good) == (expected, 0)
    no_device_total = [r[:-1] for r in good]
    assert rows.process_samples(names[:-1], no_device_total) == (
        [dataclasses.replace(e, device_total_bytes=None) for e in expected], 0)
    no_t = [r[:2] + r[3:] for r in good]
    assert rows.process_samples(names[:2] + names[3:], no_t) == ([], 3)
