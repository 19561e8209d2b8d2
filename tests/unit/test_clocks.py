"""Clock offsets between nodes (`traceml.clocks`): the estimate from hand-built exchanges
with uneven delays (the least round trip wins, and bounds the truth), the drift over
bursts, exchanges a stepped clock spoiled, the test-only skew; stored exchanges reach
the summary's nodes by their launcher."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_store import END, NODE, START, T0
from traceml import clocks
from traceml.clocks import Exchange, estimate
from traceml.environment import CLOCK_SKEW_VAR, clock_skew_for_tests_s
from traceml.records_json import from_jsonable, to_jsonable
from traceml.report import build_report, validate_summary
from traceml.report.json_codec import report_to_json
from traceml.report.text import render_text
from traceml.store import SenderState, StoreReader, StoreWriter
from traceml.wire.identity import Sender


def exchange(at: float, offset: float, out_s: float, back_s: float,
             answer_s: float = 0.0001) -> Exchange:
    """An exchange at node 0's time ``at`` with a node whose clock reads ``offset`` ahead
    of node 0's: ``out_s`` on the way to node 0, ``back_s`` on the way back."""
    t2 = at
    t3 = at + answer_s
    return Exchange(t2 - out_s + offset, t2, t3, t3 + back_s + offset)


def test_the_least_round_trip_wins_and_bounds_the_truth() -> None:
    truth = 0.25
    burst = [exchange(T0, truth, 0.004, 0.0005), exchange(T0 + 0.01, truth, 0.0002, 0.0003),
             exchange(T0 + 0.02, truth, 0.0001, 0.009)]
    clock = estimate(burst)
    assert clock is not None
    assert clock.offset_ms == pytest.approx(250.0 - (0.0002 - 0.0003) / 2 * 1e3, abs=1e-3)
    assert clock.uncertainty_ms == pytest.approx(0.25, abs=1e-3)  # half of 0.2 + 0.3 ms
    assert abs(clock.offset_ms - truth * 1e3) <= clock.uncertainty_ms
    assert (clock.num_bursts, clock.drift_ppm) == (3, None)  # within a second: no drift


def test_every_exchange_bounds_the_offset_whatever_its_delays() -> None:
    for out_s, back_s in [(0.0, 0.05), (0.05, 0.0), (0.01, 0.03)]:
        e = exchange(T0, -1.5, out_s, back_s)
        assert abs(e.offset_s - -1.5) <= e.round_trip_s / 2 + 1e-12


def test_the_drift_is_fitted_over_bursts_a_minute_apart_or_more() -> None:
    ppm = 20.0  # the node's clock gains 20 µs a second
    bursts = [exchange(T0 + t, 0.1 + t * ppm * 1e-6, 0.0002, 0.0002) for t in (0, 30, 90, 210)]
    clock = estimate(bursts)
    assert clock is not None and clock.drift_ppm == pytest.approx(ppm, rel=1e-3)
    assert clock.offset_ms == pytest.approx(100.0, abs=1e-3)  # all alike: the first of equals
    assert estimate(bursts[:2]) is not None and estimate(bursts[:2]).drift_ppm is None  # type: ignore[union-attr]
    # a burst whose answer was queued 10 ms is left out of the fit, not read as drift
    queued = [exchange(T0, 0.1, 0.0102, 0.0002), *bursts[1:]]
    clock = estimate(queued)
    assert clock is not None and clock.drift_ppm == pytest.approx(ppm, rel=1e-3)
    assert estimate(queued[:3]).drift_ppm is None  # type: ignore[union-attr]  # 2 bursts left


def test_an_exchange_a_stepped_clock_spoiled_is_left_out() -> None:
    good = exchange(T0, 0.0, 0.001, 0.001)
    backwards = Exchange(T0 + 5, T0, T0, T0 + 4)  # t4 before t1
    negative = Exchange(T0, T0, T0 + 1.0, T0 + 0.5)  # answered in longer than the round trip
    assert not backwards.whole() and not negative.whole()
    assert estimate([backwards, negative]) is None
    clock = estimate([backwards, good, negative])
    assert clock is not None and clock.num_bursts == 1
    assert clock.uncertainty_ms == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(("value", "skew"), [("0.25", 0.25), ("-3", -3.0), ("", 0.0),
                                             ("soon", 0.0), ("nan", 0.0), ("7200", 0.0)])
def test_the_test_only_skew_shifts_the_wall_clock(value: str, skew: float) -> None:
    assert clock_skew_for_tests_s({CLOCK_SKEW_VAR: value}) == skew
    assert clock_skew_for_tests_s({}) == 0.0
    plain = clocks.wall_offset_s()
    assert clocks.wall_offset_s(skew) - plain == pytest.approx(skew, abs=0.01)


def test_stored_exchanges_reach_their_node_in_the_summary(tmp_path: Path) -> None:
    """Node 1's launcher (found by its system sampler's host and pid) measured its clock
    against node 0's, the collector's (the reference: 0); a launcher no node is known
    for is not shown."""
    db = tmp_path / "telemetry.sqlite"
    writer = StoreWriter(str(db))
    writer.save_run(START)
    writer.save_clock_reference("h", 9)  # NODE's launcher
    node1 = Sender(role="system", host="h1", pid=77, node_rank=1)
    for who in (NODE, node1):
        writer.save_sender(SenderState(who, T0, T0 + 6))
    writer.add_clock_exchange("h1", 77, exchange(T0 + 1, 0.25, 0.0003, 0.0001))
    writer.add_clock_exchange("h1", 77, exchange(T0 + 31, 0.25, 0.0001, 0.0001))
    writer.add_clock_exchange("h9", 5, exchange(T0 + 2, 9.0, 0.0001, 0.0001))  # no such node
    writer.add_clock_exchange("h", 9, exchange(T0 + 2, 1.0, 0.0001, 0.0001))  # the reference's
    writer.save_run(END)
    writer.close()
    with StoreReader(db) as reader:
        records = reader.records()
        run = reader.run(records)
    assert len(records.clock_exchanges) == 4
    nodes = {n.node_rank: n.clock for n in run.meta.nodes}
    assert nodes[0] == clocks.REFERENCE
    clock = nodes[1]
    assert clock is not None and clock.num_bursts == 2
    assert clock.offset_ms == pytest.approx(250.0, abs=1e-3)
    assert clock.uncertainty_ms == pytest.approx(0.1, abs=1e-3)
    report = build_report(run, 50)
    doc = report_to_json(report)
    assert doc["meta"]["nodes"][1]["clock"] == {  # type: ignore[index,call-overload]
        "offset_ms": pytest.approx(250.0, abs=1e-3), "uncertainty_ms": pytest.approx(0.1, abs=1e-3),
        "measured_at": "2023-11-14T22:13:51.000+00:00", "num_bursts": 2, "drift_ppm": None}
    assert doc["meta"]["nodes"][0]["clock"] == {  # type: ignore[index,call-overload]
        "offset_ms": 0.0, "uncertainty_ms": 0.0, "measured_at": None, "num_bursts": 0,
        "drift_ppm": None}
    assert validate_summary(doc) == []
    assert "Clocks against node 0's: node 1 +250.00 ms +/- 0.10." in render_text(report)
    # a recorded scenario keeps them
    assert from_jsonable(to_jsonable(run)).meta.nodes == run.meta.nodes


def test_a_store_without_its_reference_sets_clocks_against_node_0(tmp_path: Path) -> None:
    """A store written before the reference was recorded: node 0's is the reference."""
    db = tmp_path / "telemetry.sqlite"
    writer = StoreWriter(str(db))
    writer.save_run(START)
    node1 = Sender(role="system", host="h1", pid=77, node_rank=1)
    for who in (NODE, node1):
        writer.save_sender(SenderState(who, T0, T0 + 6))
    writer.add_clock_exchange("h1", 77, exchange(T0 + 1, 0.25, 0.0001, 0.0001))
    writer.close()
    with StoreReader(db) as reader:
        run = reader.run(reader.records())
    clock = {n.node_rank: n.clock for n in run.meta.nodes}
    assert clock[0] == clocks.REFERENCE and clock[1] is not None
