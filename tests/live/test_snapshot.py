"""Snapshot, series and the store tail: what every live view and the HTML page draw."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tests.live.conftest import GIB, T0, comm_run, fixed_run
from tests.rows import run_start, sent_by, step_record, step_row
from traceml.live.tail import StoreTail
from traceml.records import RunData, StepRow
from traceml.report import build_report, report_to_json
from traceml.report.page.series import build_series, series_to_json
from traceml.report.page.snapshot import (
    LIVE_WINDOW_STEPS,
    build_snapshot,
    live_snapshot,
    live_window_steps,
    snapshot_to_json,
)
from traceml.store import SenderState, StoreWriter
from traceml.wire.identity import Sender
from traceml.wire.rows import PROCESS_FIELDS, SYSTEM_FIELDS, ProcessRows, SystemRows


def row(rank: int, step: int, total_ms: float = 10.0) -> StepRow:
    return step_row(rank, step, 1.0, 2.0, 3.0, 1.0, total_ms, total_ms - 7.0, None, None, GIB)


def test_series_keeps_every_step_when_short() -> None:
    series = build_series([row(0, s, 10.0 + s) for s in range(5)] + [row(1, 2)])
    assert series.bucket_steps == 1
    assert [r.rank for r in series.ranks] == [0, 1]
    assert series.ranks[0].steps == (0, 1, 2, 3, 4)
    assert series.ranks[0].columns["total_ms"] == (10.0, 11.0, 12.0, 13.0, 14.0)
    assert series.ranks[1].columns["peak_reserved_bytes"] == (None,)


def test_series_buckets_long_runs_alike_on_every_rank() -> None:
    rows = [row(r, s, float(s)) for r in (0, 1) for s in range(10)]
    series = build_series(rows, max_points=4)
    assert series.bucket_steps == 3
    for rank_series in series.ranks:
        assert rank_series.steps == (0, 3, 6, 9)
        assert rank_series.columns["total_ms"] == (1.0, 4.0, 7.0, 9.0)
        assert rank_series.columns["rss_bytes"] == (GIB, GIB, GIB, GIB)
    encoded = series_to_json(series)
    assert encoded["ranks"][0]["step"] == [0, 3, 6, 9]  # type: ignore[index, call-overload]


def test_live_snapshot_reports_the_recent_window() -> None:
    run = fixed_run(num_steps=LIVE_WINDOW_STEPS + 50)
    snap = live_snapshot(run, window_rows=10000, now=T0 + 30)
    assert snap.report.step_time.scope.num_steps == LIVE_WINDOW_STEPS
    assert snap.elapsed_s == 30 and not snap.ended
    assert [(p.rank, p.last_step) for p in snap.phases] == [(0, 149), (1, 149)]
    assert snap.worst_ranks["input_ms"] == 1
    assert snap.phases[1].median_ms["input_ms"] == 41.0
    assert snap.phases[1].worst_ms["input_ms"] == 42.0


def test_the_page_document_holds_the_report_unchanged() -> None:
    run = fixed_run()
    report = build_report(run, 10000)
    doc = snapshot_to_json(build_snapshot(run, report, ended=True), live=False)
    assert doc["summary"] == report_to_json(report)
    assert doc["ended"] is True and doc["live"] is False
    assert [n["name"] for n in doc["nodes"]] == ["n0 gpu-box", "n0 gpu0"]  # type: ignore[union-attr, index]


def test_a_rank_without_window_steps_still_has_a_row() -> None:
    run = fixed_run()
    odd = dataclasses.replace(run, steps=run.steps + (row(2, 50),),
                              meta=dataclasses.replace(run.meta, world_size=3))
    snap = live_snapshot(odd, 10000, now=T0)
    assert [(p.rank, p.last_step, p.num_steps) for p in snap.phases] == [
        (0, 11, 0), (1, 11, 0), (2, 50, 0)]
    assert snap.phases[2].median_ms == {} and snap.worst_ranks == {}


def _sender(rank: int, restart: int = 0) -> Sender:
    return Sender(role="agent", host="h", pid=100 + rank, node_rank=0, rank=rank, local_rank=rank,
                  world_size=2, restart=restart)


def _steps(writer: StoreWriter, rank: int, steps: range, restart: int = 0) -> None:
    values = {"t_begin": T0, "input_ms": 1.0, "forward_ms": 2.0, "backward_ms": 3.0,
              "optimizer_ms": 1.0, "total_ms": 10.0, "wait_ms": 3.0, "rss_bytes": GIB}
    writer.add_steps(sent_by(_sender(rank, restart), [step_record(s, **values) for s in steps]))


def test_tail_reads_only_new_rows_and_keeps_a_bounded_history(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.sqlite"
    writer = StoreWriter(str(db))
    writer.save_run(run_start("s", T0, summary_window_rows=50))
    for rank in (0, 1):
        writer.save_sender(SenderState(_sender(rank), T0, T0))
        _steps(writer, rank, range(8))
        writer.add_process(_sender(rank), ProcessRows(PROCESS_FIELDS,
                           [[T0 + i, 50.0, GIB, 64 * GIB, 8, None, None, None] for i in range(5)]))
    writer.add_system(_sender(0), SystemRows(SYSTEM_FIELDS, [[T0, 10.0, 20.0, 64 * GIB, []]]))
    writer.commit()
    tail = StoreTail(db, steps_kept=5, samples_kept=3)
    run, window_rows = tail.poll()
    assert window_rows == 50 and run.meta.session_id == "s"
    assert [(r.rank, r.step) for r in run.steps] == [(r, s) for r in (0, 1) for s in range(3, 8)]
    assert len(run.process) == 6 and len(run.system) == 1
    _steps(writer, 0, range(8, 10))
    _steps(writer, 1, range(2), restart=1)  # rank 1 restarted: its steps count from 0
    writer.commit()
    run, _ = tail.poll()
    assert [(r.rank, r.step) for r in run.steps] == [(0, s) for s in range(5, 10)] + [(1, 0), (1, 1)]
    _steps(writer, 0, range(10, 1000))  # a long pause: only what can be kept is read
    writer.commit()
    run, _ = tail.poll()
    assert [r.step for r in run.steps if r.rank == 0] == list(range(995, 1000))
    writer.close()


def test_a_late_poll_keeps_the_newest_steps_of_a_rank_behind_the_others(tmp_path: Path) -> None:
    """A backlog is read per rank: a rank behind the others (its newest steps stored
    before many of theirs) keeps its newest steps, as the others keep theirs.  (They
    are chosen among the newest blocks, as many as twice the steps every sender could
    keep: a rank that stopped long before a late first poll is not in it.)"""
    db = tmp_path / "telemetry.sqlite"
    writer = StoreWriter(str(db))
    writer.save_run(run_start("s", T0, summary_window_rows=50))
    for rank in (0, 1):
        writer.save_sender(SenderState(_sender(rank), T0, T0))
    _steps(writer, 1, range(20))
    writer.commit()
    for at in range(0, 600, 60):  # rank 0 ran on: 600 steps stored after rank 1's last
        _steps(writer, 0, range(at, at + 60))
        writer.commit()
    run, _ = StoreTail(db, steps_kept=5).poll()
    assert [(r.rank, r.step) for r in run.steps] == [
        *((0, s) for s in range(595, 600)), *((1, s) for s in range(15, 20))]
    writer.close()


def test_a_poll_and_a_live_build_make_their_rows_without_collections(tmp_path: Path) -> None:
    """The cycle collector waits while a poll reads and a live report is built (each
    collection would walk every row made so far), and runs again after."""
    import gc

    db = tmp_path / "telemetry.sqlite"
    writer = StoreWriter(str(db))
    writer.save_run(run_start("s", T0, summary_window_rows=50))
    for rank in range(8):
        writer.save_sender(SenderState(_sender(rank), T0, T0))
        _steps(writer, rank, range(300))
    writer.commit()
    writer.close()
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        assert gc.isenabled()
        run, window_rows = StoreTail(db).poll()
        live_snapshot(run, window_rows, now=T0)
        assert collections == [] and len(run.steps) == 2400
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)


def test_step_time_alone_is_the_live_reports_step_time() -> None:
    """The capture planner builds Step Time alone (every trigger is one of its
    findings): the same section the live report holds, on a straggler, a
    communication-bound and a wide run."""
    from tests.live.conftest import wide_run
    from traceml.report.page.snapshot import live_report, live_step_time

    for run in (fixed_run(60), comm_run(), wide_run(512, 30, slow_rank=77)):
        alone = live_step_time(run, 10000)
        whole = live_report(run, 10000).step_time
        assert alone.findings and [f.kind for f in alone.findings] == [
            f.kind for f in whole.findings]
        assert alone == dataclasses.replace(whole, findings=alone.findings)
        assert [(f.kind, f.ranks, f.severity, f.why) for f in alone.findings] == [
            (f.kind, f.ranks, f.severity, f.why) for f in whole.findings]


def test_at_thousands_of_ranks_the_live_window_and_the_tail_shrink() -> None:
    from tests.live.conftest import wide_run
    from traceml.live.tail import LIVE_ROWS_KEPT

    tail = StoreTail(Path("unused.sqlite"))
    assert [tail.kept_steps(n) for n in (2, 64, 1024, 8192)] == [300, 300, 50, 40]
    assert 1024 * tail.kept_steps(1024) <= 3 * LIVE_ROWS_KEPT
    snap = live_snapshot(wide_run(1024, 60, slow_rank=677), 10000, now=T0 + 60)
    assert snap.report.step_time.scope.num_steps == 25  # 25 600 rows: about 100 steps of 256 ranks
    assert snap.report.primary.finding.ranks == (677,)


def test_the_tail_keeps_twice_the_live_window_per_rank_whatever_the_nodes(
        tmp_path: Path) -> None:
    """Kept steps follow the number of ranks, not of senders (each node's sampler
    speaks too): 1024 ranks on 128 nodes keep 2 x 25 steps a rank."""
    db = tmp_path / "telemetry.sqlite"
    writer = StoreWriter(str(db))
    writer.save_run(run_start("s", T0, summary_window_rows=50))
    for node in range(128):
        writer.save_sender(SenderState(Sender("system", f"h{node}", 9, node), T0, T0))
    for rank in range(1024):
        writer.save_sender(SenderState(_sender(rank), T0, T0))
        _steps(writer, rank, range(60))
    writer.commit()
    run, _ = StoreTail(db).poll()
    per_rank = {r.rank: 0 for r in run.steps}
    for r in run.steps:
        per_rank[r.rank] += 1
    assert set(per_rank.values()) == {2 * live_window_steps(1024)} == {50}
    writer.close()


def test_a_job_wide_stall_at_1024_ranks_keeps_the_page_document_small() -> None:
    """Every rank's stall is in final_summary.json; the page's document keeps the ranks
    the findings name (it shows the findings, not the incidents)."""
    import json

    from tests.live.conftest import wide_run
    from traceml.records import Incident
    from traceml.stacks import Frame

    user = (Frame("/home/me/train.py", 42, "load"),)
    collective = (Frame("/home/me/train.py", 90, "main"),
                  Frame("/venv/lib/python3.11/site-packages/torch/_tensor.py", 623, "backward"))
    stalls = [Incident("stall", r, r // 8, f"node{r // 8}", 1000 + r, T0 + 5.5, T0 + 9.0, None,
                       59, *(("input", ("input",), user) if r == 677 else
                             ("communication", ("backward", "communication"), collective)),
                       "python") for r in range(1024)]
    run = dataclasses.replace(wide_run(1024, 60, slow_rank=677), incidents=tuple(stalls))
    report = build_report(run, 10000)
    assert report.primary.finding.label == "STALLED" and report.ending.culprits == (677,)
    assert len(report_to_json(report)["ending"]["incidents"]) == 1024
    doc = snapshot_to_json(build_snapshot(run, report, ended=True), live=False)
    assert [i["rank"] for i in doc["summary"]["ending"]["incidents"]] == [677]
    assert doc["summary"]["ending"]["findings"][0]["why"] == report.primary.finding.why
    assert len(json.dumps(doc["summary"]["ending"])) < 10_000  # 0.7 MB with every incident


def _scenario(name: str) -> RunData:
    import json

    from traceml.records_json import from_jsonable
    path = Path(__file__).parents[1] / "fixtures" / "scenarios" / name / "run.json"
    return from_jsonable(json.loads(path.read_text()))


def test_blamed_cells_are_the_findings_not_each_columns_highest() -> None:
    """The demo's straggler: r1's input is blamed; r0 has the most communication (it
    waits) and nothing blamed."""
    snap = live_snapshot(comm_run(), 10000, now=T0 + 5)
    assert snap.blamed == {1: {"input_ms": "INPUT STRAGGLER"}}
    assert snap.worst_ranks == {"input_ms": 1, "communication_ms": 0}
    assert snapshot_to_json(snap, live=True)["blamed"] == {"1": {"input_ms": "INPUT STRAGGLER"}}


def test_a_compute_straggler_is_blamed_for_its_slowest_compute_phase() -> None:
    run = _scenario("compute_straggler_8r")
    snap = build_snapshot(run, build_report(run, 10000), ended=True)
    [finding] = [f for f in snap.report.step_time.findings if f.kind == "COMPUTE_STRAGGLER"]
    [rank] = finding.ranks
    assert list(snap.blamed) == [rank]
    assert set(snap.blamed[rank]) <= {"forward_ms", "backward_ms", "optimizer_ms"}
    assert all(snap.worst_ranks[column] == rank for column in snap.blamed[rank])


def test_a_healthy_or_borderline_run_has_nothing_blamed() -> None:
    for name in ("healthy", "input_bound"):
        run = _scenario(name)
        snap = build_snapshot(run, build_report(run, 10000), ended=True)
        actionable = [f for f in snap.report.step_time.findings
                      if f.severity != "info" and f.ranks]
        assert bool(snap.blamed) == bool(actionable), name
    # A finding said at info (borderline) names no cell.
    report = build_report(comm_run(), 10000)
    step_time = report.section("step_time")
    quiet = dataclasses.replace(step_time, findings=tuple(
        dataclasses.replace(f, severity="info") for f in step_time.findings))
    quiet_report = dataclasses.replace(report, step_time=quiet)
    snap = build_snapshot(comm_run(), quiet_report, ended=True)
    assert snap.blamed == {}
