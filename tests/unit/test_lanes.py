"""Swimlanes (`traceml.report.page.lanes`) on hand-built 1-, 2- and 64-rank runs: the
typical and the slowest step, each rank's lane placed on the reference clock, at many
ranks the named and extreme ranks with a density band of all of them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_timeline import T0, ddp_row, run_of
from traceml import phases
from traceml.clocks import REFERENCE, NodeClock
from traceml.records import NodeInfo, StepRow
from traceml.report import build_report
from traceml.report.page.lanes import (
    DENSITY_BUCKETS,
    MAX_LANES,
    _step_lanes,
    build_lanes,
    lanes_to_json,
)
from traceml.report.page.snapshot import build_snapshot, report_window, snapshot_to_json
from traceml.report.timeline import NodeClocks

STEPS = 30


def lanes_of(rows: list[StepRow], **run: Any) -> Any:
    data = run_of(rows, **run)
    report = build_report(data, 10_000)
    return build_lanes(data, report, report_window(data, report))


def test_two_ranks_the_typical_and_the_slowest_step_with_a_late_rank() -> None:
    rows = []
    for s in range(STEPS):
        for r in range(2):
            late = 0.002 if r == 1 else 0.0  # r1 begins each step 2 ms after r0
            row = ddp_row(r, s, t0=T0 + late + s * 0.005)
            if s == 20:  # one slow step: both ranks' backward takes 30 ms more
                row = row.replace(total_ms=40.0, backward_end_ms=38.0, communication_at_ms=36.0,
                                  communication_end_ms=38.0, optimizer_at_ms=38.0,
                                  optimizer_end_ms=39.0, wait_ms=31.0)
            rows.append(row)
    typical, slowest = lanes_of(rows)
    assert slowest.label == "slowest step 20" and slowest.step == 20
    assert typical.label.startswith("typical step ") and typical.step != 20
    assert [(lane.rank, lane.begin_ms) for lane in typical.lanes] == [
        (0, pytest.approx(0.0, abs=1e-3)), (1, pytest.approx(2.0, abs=1e-3))]
    lane = typical.lanes[1]
    assert lane.phases == (("input", 0.0, 1.0), ("forward", 1.0, 3.0), ("backward", 3.0, 8.0),
                           ("communication", 6.0, 8.0), ("optimizer", 8.0, 9.0))
    assert lane.in_flight == ((4.0, 8.0),) and lane.not_drawn_ms == {}
    assert typical.span_ms == pytest.approx(12.0, abs=1e-3) and typical.density is None
    assert slowest.lanes[0].phases[2] == ("backward", 3.0, 38.0)


def test_buckets_in_flight_with_a_gap_are_drawn_span_by_span() -> None:
    rows = [ddp_row(0, s, collective_ms=2.5, collective_spans_ms="4-5,6.5-8")
            for s in range(STEPS)]
    (only,) = lanes_of(rows)
    assert only.lanes[0].in_flight == ((4.0, 5.0), (6.5, 8.0))
    assert lanes_to_json([only])[0]["lanes"][0]["in_flight"] == [[4.0, 5.0], [6.5, 8.0]]
    (unknown,) = lanes_of([r.replace(collective_spans_ms=None) for r in rows])
    assert unknown.lanes[0].in_flight == ()  # a gap somewhere: not drawn by guess


def test_one_rank_one_lane_and_one_step_when_every_step_is_alike() -> None:
    (only,) = lanes_of([ddp_row(0, s) for s in range(STEPS)])
    assert [lane.rank for lane in only.lanes] == [0] and only.num_ranks == 1


def test_a_store_without_phase_positions_draws_no_lanes() -> None:
    blank = {c: None for p in phases.PHASES for c in p.place_columns}
    assert lanes_of([ddp_row(0, s).replace(**blank) for s in range(STEPS)]) == ()


def test_a_node_whose_clock_is_ahead_is_drawn_where_it_began_on_the_reference() -> None:
    rows = [ddp_row(r, s, node=r, t0=T0 + 0.25 * r) for s in range(STEPS) for r in range(2)]
    nodes = (NodeInfo(0, "h0", (0,), REFERENCE),
             NodeInfo(1, "h1", (1,), NodeClock(250.0, 0.05, T0, 2, 0.0)))
    (step,) = lanes_of(rows, nodes=nodes)
    assert [lane.begin_ms for lane in step.lanes] == [pytest.approx(0.0, abs=1e-3)] * 2


def test_sixty_four_ranks_the_named_and_extreme_ranks_and_the_density_of_all() -> None:
    rows = []
    for s in range(STEPS):
        for r in range(64):
            row = ddp_row(r, s, t0=T0 + s * 0.012)
            if r == 37:  # a slow loader: input 1 ms -> 3 ms, the rest 2 ms later
                shifted = {c: row.value(c) + 2.0 for p in phases.PHASES[1:]
                           for c in p.place_columns[:2] if row.value(c) is not None}
                row = row.replace(input_ms=3.0, input_end_ms=3.0, total_ms=12.0,
                                  collective_at_ms=6.0, collective_end_ms=10.0, **shifted)
            rows.append(row)
    typical = lanes_of(rows)[0]
    assert typical.num_ranks == 64 and len(typical.lanes) <= MAX_LANES
    shown = [lane.rank for lane in typical.lanes]
    assert shown == [0, 32, 37]  # named (and slowest), the fastest, the median
    density = typical.density
    assert density is not None and set(density) == {"input", "forward", "backward",
                                                    "communication", "optimizer"}
    assert all(len(c) == DENSITY_BUCKETS for c in density.values())
    per_bucket = [sum(c[i] for c in density.values()) for i in range(DENSITY_BUCKETS)]
    assert max(per_bucket) <= 64
    # 2 ms into the step (bucket 2/12 of 200: 33), 63 ranks are in forward, r37 in input.
    assert (density["forward"][33], density["input"][33]) == (63, 1)
    # In the all-reduce's wait the innermost phase counts, not backward around it (r37,
    # 2 ms behind, is still computing its backward).
    assert density["communication"][116] == 63 and density["backward"][116] == 1
    document = lanes_to_json([typical])[0]
    assert document["num_ranks"] == 64 and len(document["density"]["forward"]) == DENSITY_BUCKETS


def test_the_extremes_are_always_drawn_and_the_singled_out_ranks_fill_the_rest() -> None:
    rows = [ddp_row(r, 0, total_ms=10.0 + r * 0.01) for r in range(64)]  # r63 slowest
    clocks = NodeClocks({0: REFERENCE}, True)
    one = _step_lanes("typical step 0", 0, rows, clocks, named=[5])
    assert [lane.rank for lane in one.lanes] == [0, 5, 32, 63]
    many = _step_lanes("typical step 0", 0, rows, clocks, named=list(range(1, 30)))
    shown = [lane.rank for lane in many.lanes]
    assert len(shown) == MAX_LANES and {0, 32, 63} <= set(shown)
    assert shown == sorted({0, 32, 63, *range(1, MAX_LANES - 2)})


def test_the_snapshot_carries_the_lanes() -> None:
    data = run_of([ddp_row(r, s) for s in range(STEPS) for r in range(2)])
    report = build_report(data, 10_000)
    document = snapshot_to_json(build_snapshot(data, report, ended=True), live=False)
    assert [s["label"].split()[0] for s in document["lanes"]] == ["typical"]
    assert document["lanes"][0]["lanes"][1]["phases"][0] == ["input", 0.0, 1.0]
