"""The timeline export (`traceml.report.timeline`) on hand-built 1-, 2- and 8-rank runs:
phases where they ran and nested, what cannot be drawn said rather than drawn wrong,
collectives in flight, incidents and counters, nodes' clocks taken off, the steps chosen."""

from __future__ import annotations

from typing import Any

import pytest

from tests.rows import row_of
from tests.trace_events import check, load, self_times
from traceml import phases
from traceml.clocks import REFERENCE, NodeClock
from traceml.records import Incident, NodeInfo, ProcessSample, RunData, RunMeta, StepRow
from traceml.report.timeline import (
    MAX_RANK_STEPS,
    StepRange,
    choose_steps,
    placed_phases,
    trace,
    write_trace,
)

T0 = 1_700_000_000.0


def ddp_row(rank: int, step: int, node: int = 0, t0: float = T0, **changes: Any) -> StepRow:
    """A 10 ms DDP step beginning at ``t0 + step * 10 ms``: fetch 0-1, forward 1-3,
    backward 3-8 with the all-reduce wait 6-8 in it, optimizer 8-9; buckets in flight
    from 4 to 8 without a gap."""
    placed = {"input": (0.0, 1.0), "forward": (1.0, 3.0), "backward": (3.0, 8.0),
              "communication": (6.0, 8.0), "optimizer": (8.0, 9.0)}
    columns: dict[str, Any] = {}
    for p in phases.PHASES:
        if p.name in placed:
            columns[p.count_column] = 1
            columns[p.place_columns[0]], columns[p.place_columns[1]] = placed[p.name]
    columns |= {"collective_at_ms": 4.0, "collective_end_ms": 8.0, "collective_ms": 4.0,
                "node_rank": node}
    row = row_of(rank, step, {"input": 1.0, "forward": 2.0, "backward": 3.0,
                              "communication": 2.0, "optimizer": 1.0}, 10.0, 1.0,
                 t=t0 + step * 0.01 + 0.01, **columns)
    return row.replace(**changes)


def run_of(rows: list[StepRow], nodes: tuple[NodeInfo, ...] | None = None,
           **extra: Any) -> RunData:
    ranks = sorted({r.rank for r in rows})
    nodes = nodes or (NodeInfo(0, "h0", tuple(ranks), REFERENCE),)
    meta = RunMeta(session_id="s", command=["train.py"], started_at=T0, ended_at=T0 + 10,
                   exit_code=0, partial=False, world_size=len(ranks), missing_ranks=(),
                   nodes=nodes, device="cpu", versions={}, transport={})
    return RunData(meta, tuple(rows), extra.pop("process", ()), (), **extra)


def events_of(document: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    return [e for e in document["traceEvents"] if all(e.get(k) == v for k, v in match.items())]


def test_a_ddp_step_nests_its_phases_where_they_ran_and_draws_the_buckets_in_flight() -> None:
    document = trace(run_of([ddp_row(0, s) for s in range(3)]))
    check(document["traceEvents"])
    step = events_of(document, cat="step", name="step 1")[0]
    begin = step["ts"]
    origin = document["otherData"]["ts_origin_unix_s"]
    assert begin == pytest.approx((T0 + 0.01 - origin) * 1e6)
    assert step["dur"] == pytest.approx(10_000, abs=0.01)
    drawn = {e["name"]: (round(e["ts"] - begin), round(e["dur"]))  # µs, to float rounding
             for e in events_of(document, cat="phase") if e["args"]["step"] == 1}
    assert drawn == {"input": (0, 1000), "forward": (1000, 2000), "backward": (3000, 5000),
                     "communication": (6000, 2000), "optimizer": (8000, 1000)}
    assert "not_drawn" not in step["args"]
    flight = [e for e in events_of(document, cat="collective") if e["args"]["step"] == 1]
    assert [(e["ph"], e["name"], round(e["ts"] - begin), round(e["dur"])) for e in flight] == [
        ("X", "collectives in flight", 4000, 4000)]
    assert flight[0]["tid"] != step["tid"]  # a track of its own
    # Each phase's self time is its exclusive time; with the wait they make the step.
    own = {e["name"]: us for e, us in self_times(document["traceEvents"], 1, step["tid"])
           if e["args"]["step"] == 1}
    assert own["backward"] == pytest.approx(3000) and own["communication"] == pytest.approx(2000)
    assert own["step 1"] == pytest.approx(step["args"]["wait_ms"] * 1e3, abs=0.01)


def test_a_call_that_overlaps_another_without_nesting_is_said_not_drawn() -> None:
    row = ddp_row(0, 0, optimizer_at_ms=7.5)  # the optimizer from 7.5 ms: across backward's end
    drawn, left_out, missing = placed_phases(row)
    assert [p.name for _, _, p in drawn] == ["input", "forward", "backward", "communication"]
    assert left_out == ["optimizer: a call overlaps communication without nesting in it"]
    assert missing == {"optimizer": 1.0}
    document = trace(run_of([row]))
    check(document["traceEvents"])
    args = events_of(document, cat="step")[0]["args"]
    assert args["not_drawn"] == left_out and args["not_drawn_ms"] == {"optimizer": 1.0}


def test_a_phase_called_many_times_draws_its_first_and_last_calls_and_says_the_rest() -> None:
    row = ddp_row(0, 0, num_communication=3, communication_at_ms=6.0,
                  communication_end_ms=6.5, communication_last_at_ms=7.5,
                  communication_last_end_ms=8.0)
    row = row.replace(communication_ms=1.5)  # 0.5 ms a call
    drawn, left_out, missing = placed_phases(row)
    assert [(a, b) for a, b, p in drawn if p.name == "communication"] == [(6.0, 6.5), (7.5, 8.0)]
    assert missing == {"communication": 0.5}
    assert left_out == ["communication: 0.500 ms of its calls not placed (those between its "
                        "first and last, or nested ones)"]


def test_time_of_uncounted_calls_not_drawn_is_said_whatever_the_counts() -> None:
    # Two micro-batches, each with a loss module's forward (logged uncounted) and a copy
    # outside every phase (input, uncounted): counts 2, but four calls' time, two drawn.
    row = ddp_row(0, 0, num_input=2, num_forward=2, input_ms=2.4, forward_ms=5.0,
                  input_at_ms=0.0, input_end_ms=0.6, input_last_at_ms=4.0,
                  input_last_end_ms=4.6, forward_at_ms=1.0, forward_end_ms=2.25,
                  forward_last_at_ms=4.6, forward_last_end_ms=5.85,
                  backward_at_ms=6.0, backward_end_ms=8.0, communication_at_ms=7.0,
                  communication_end_ms=8.0, backward_ms=1.0, communication_ms=1.0,
                  optimizer_at_ms=8.5, optimizer_end_ms=9.5, total_ms=10.0, wait_ms=0.0)
    drawn, left_out, missing = placed_phases(row)
    assert missing == {"input": 1.2, "forward": 2.5}
    assert [line.split(":")[0] for line in left_out] == ["input", "forward"]


def test_a_store_without_phase_positions_draws_the_steps_and_says_why_not_the_phases() -> None:
    old = ddp_row(0, 0).replace(**{c: None for p in phases.PHASES for c in p.place_columns})
    document = trace(run_of([old]))
    check(document["traceEvents"])
    assert events_of(document, cat="phase") == []
    assert events_of(document, cat="step")[0]["args"]["not_drawn"][0] == (
        "input: not placed (stored before phases were)")


def test_buckets_with_a_gap_between_are_a_slice_each() -> None:
    # 2.5 of the 4 ms: 4-5 and 6.5-8
    row = ddp_row(0, 0, collective_ms=2.5, collective_spans_ms="4-5,6.5-8")
    document = trace(run_of([row]))
    check(document["traceEvents"])
    flight = events_of(document, cat="collective")
    begin = events_of(document, cat="step")[0]["ts"]
    assert [(e["ph"], e["ts"] - begin, e["dur"]) for e in flight] == [
        ("X", pytest.approx(4000.0), pytest.approx(1000.0)),
        ("X", pytest.approx(6500.0), pytest.approx(1500.0))]
    assert all(e["args"] == {"in_flight_ms": 2.5, "step": 0, "spans": 2} for e in flight)


@pytest.mark.parametrize("spans", [
    None,  # not kept (more than a row holds, a merged step, a store before them)
    "4-5,6-8",  # 3 ms: not the step's 2.5 in flight
    "4-5,4.5-6",  # overlapping
    "4-5,5-6.5",  # touching: one span, not two
    "3-4,6.5-8.5",  # not from the first launch (4) to the last completion (8)
    "4-4.5,5-5.5,6-6.5,7-7.5,7.6-7.7,7.8-7.9,7.92-7.94,7.96-7.98,7.99-8",  # more than 8
    "4-5", "4-5,6.5-nan", "4-5;6.5-8", "4-5,6.5-8-9", "",  # not the column's form
])
def test_buckets_with_a_gap_whose_spans_do_not_tell_are_two_instants(spans: str | None) -> None:
    document = trace(run_of([ddp_row(0, 0, collective_ms=2.5, collective_spans_ms=spans)]))
    flight = events_of(document, cat="collective")
    assert [(e["ph"], e["name"]) for e in flight] == [
        ("i", "first collective launched"), ("i", "last collective completed")]
    assert flight[0]["args"]["in_flight_ms"] == 2.5


def test_each_nodes_clock_is_taken_off_its_times_and_an_unmeasured_one_is_said() -> None:
    ahead = 0.25  # node 1's clock reads 250 ms ahead of node 0's
    rows = [ddp_row(0, s) for s in range(3)] + [ddp_row(1, s, node=1, t0=T0 + ahead)
                                                for s in range(3)]
    measured = NodeClock(250.0, 0.05, T0, 2, 0.0)
    nodes = (NodeInfo(0, "h0", (0,), REFERENCE), NodeInfo(1, "h1", (1,), measured))
    document = trace(run_of(rows, nodes))
    check(document["traceEvents"])
    begins = {(e["pid"], e["name"]): e["ts"] for e in events_of(document, cat="step")}
    assert begins[2, "step 2"] - begins[1, "step 2"] == pytest.approx(0.0, abs=1.0)  # µs
    assert document["otherData"]["clocks"]["1"]["offset_ms"] == 250.0
    assert document["otherData"]["not_aligned_nodes"] == []
    unmeasured = (nodes[0], NodeInfo(1, "h1", (1,), None))
    document = trace(run_of(rows, unmeasured))
    begins = {(e["pid"], e["name"]): e["ts"] for e in events_of(document, cat="step")}
    assert begins[2, "step 2"] - begins[1, "step 2"] == pytest.approx(ahead * 1e6, abs=1.0)
    assert document["otherData"]["not_aligned_nodes"] == [1]
    assert "clock not measured" in events_of(document, name="process_name", pid=2)[0][
        "args"]["name"]


def test_eight_ranks_two_tracks_each_incidents_outliers_and_counters() -> None:
    rows = [ddp_row(r, s, node=r // 4) for r in range(8) for s in range(20)]
    rows[8 * 20 - 1 - 5] = rows[8 * 20 - 1 - 5].replace(total_ms=60.0)  # r7 step 14: 6x
    stall = Incident(what="stall", rank=3, node_rank=0, host="h0", pid=9, began_at=T0 + 0.05,
                     detected_at=T0 + 0.1, cleared_at=T0 + 0.15, step=5, phase="backward")
    sample = ProcessSample(rank=2, node_rank=0, t=T0 + 0.1, cpu_pct=99.0, rss_bytes=3 << 20,
                           host_ram_total_bytes=1 << 30, num_cpus=2)
    nodes = (NodeInfo(0, "h0", (0, 1, 2, 3), REFERENCE),
             NodeInfo(1, "h1", (4, 5, 6, 7), NodeClock(0.0, 0.01, T0, 1, None)))
    document = trace(run_of(rows, nodes, incidents=(stall,), process=(sample,)))
    check(document["traceEvents"])
    names = {e["args"]["name"] for e in events_of(document, name="thread_name")}
    assert names == {f"r{r} {what}" for r in range(8)
                     for what in ("steps", "collectives in flight")}
    assert [e["pid"] for e in events_of(document, name="thread_name")
            if e["args"]["name"] == "r5 steps"] == [2]
    instants = [(e["name"], e["tid"]) for e in events_of(document, cat="incident")]
    assert ("stall", 7) in instants and ("resume", 7) in instants  # r3's steps track
    # A crash after the last step is drawn when the steps run to the end, not otherwise.
    crash = Incident(what="exception", rank=6, node_rank=1, host="h1", pid=8,
                     began_at=T0 + 5.0, detected_at=T0 + 5.0)
    run = run_of(rows, nodes, incidents=(stall, crash), process=(sample,))
    assert [e["pid"] for e in events_of(trace(run), name="crash")] == [2]
    assert events_of(trace(run, StepRange(0, 19), to_the_end=False), name="crash") == []
    assert ("outlier step 14", 15) in instants
    counters = {e["name"]: e["args"] for e in events_of(document, ph="C")}
    assert counters == {"r2 memory MiB": {"rss": 3.0}, "r2 CPU %": {"cpu": 99.0}}


def test_one_rank_without_collectives_has_steps_and_phases_only() -> None:
    rows = [ddp_row(0, s, collective_at_ms=None, collective_end_ms=None, collective_ms=None)
            for s in range(5)]
    document = trace(run_of(rows))
    check(document["traceEvents"])
    assert events_of(document, cat="collective") == []
    assert len(events_of(document, cat="step")) == 5


def test_the_steps_are_the_window_cut_to_the_cap_or_those_asked() -> None:
    last = {0: 500, 1: 498}
    assert choose_steps(last, 100, None, None) == StepRange(399, 498)  # both reached 498
    assert choose_steps(last, 1000, None, None) == StepRange(0, 498)
    assert choose_steps(last, 100, (10, 20), None) == StepRange(10, 20)
    assert choose_steps(last, 100, (10, None), None) == StepRange(10, 500)
    assert choose_steps(last, 100, (490, 10**6), None) == StepRange(490, 500)  # none beyond
    assert choose_steps(last, 100, (600, None), None) is None
    assert choose_steps(last, 100, None, {0}) == StepRange(401, 500)
    assert choose_steps(last, 100, None, {7}) is None
    wide = {r: 10_000 for r in range(8192)}
    cut = choose_steps(wide, 100, None, None)
    assert cut == StepRange(9999, 10_000, capped=True)
    assert cut.num_steps * len(wide) <= MAX_RANK_STEPS or cut.num_steps == 1
    assert choose_steps(wide, 100, None, {0, 1}) == StepRange(9901, 10_000)
    assert choose_steps(wide, 100, (0, 10**6), None) == StepRange(9999, 10_000, capped=True)


def test_a_step_the_next_one_began_inside_is_cut_there_and_says_so() -> None:
    rows = [ddp_row(0, s) for s in range(3)]
    rows[1] = rows[1].replace(total_ms=12.5)  # step 2 began 2.5 ms before step 1 ended
    document = trace(run_of(rows))
    check(document["traceEvents"])
    step = events_of(document, name="step 1")[0]
    assert step["dur"] == pytest.approx(10_000, abs=0.01)
    assert step["args"]["cut_ms"] == pytest.approx(2.5)


def test_the_file_is_written_whole_gzip_when_asked(tmp_path: Any) -> None:
    document = trace(run_of([ddp_row(0, s) for s in range(3)]))
    size = write_trace(document, tmp_path / "t.json.gz")
    assert (tmp_path / "t.json.gz").stat().st_size == size
    assert load(tmp_path / "t.json.gz") == load_plain(tmp_path, document)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.json.gz"]


def load_plain(tmp_path: Any, document: dict[str, Any]) -> dict[str, Any]:
    write_trace(document, tmp_path / "t.json")
    return load(tmp_path / "t.json")
