"""The step tracker's communication phase and collectives in flight, on
hand-built event logs with a fake clock."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_steps import Script
from traceml import phases
from traceml.collector.rank_steps import step_row
from traceml.collector.step_parts import MAX_DEPTH, InFlight
from traceml.records import in_flight_spans
from traceml.step_fields import MAX_SPANS
from traceml.wire.events import (
    BACKWARD,
    CLOSE,
    END,
    FORWARD,
    INPUT,
    NOGRAD_FORWARD,
    OPTIMIZER,
    OPTIMIZER_END,
    SPAN,
)

COMM = phases.code("communication")


class CommScript(Script):
    """A Script that also logs collectives: spans at their completion."""

    def span(self, launch: float, done: float) -> None:
        self.events.append((SPAN, (launch, done)))
        if self.replay_each:
            self.tr.replay(self.events)
            self.events.clear()

    def ddp_iter(self, exposed: float = 2.0) -> None:
        """fetch 1, forward 2, backward 3 (compute) + ``exposed`` of DDP's wait at
        its end, optimizer 1; two buckets in flight during backward."""
        self.phase(INPUT, 1)
        self.phase(FORWARD, 2)
        start = self.t
        self.log(BACKWARD)
        self.gap(3)
        self.log(COMM)  # backward's compute is done; the reducer waits from here
        self.gap(exposed)
        self.span(start + 1, start + 2)  # bucket 0, hidden behind compute
        self.span(start + 2.5, self.t)  # the last bucket, exposed at the end
        self.log(END)  # the wait ends
        self.log(END)  # backward ends
        self.phase(OPTIMIZER, 1)


def test_exposed_communication_is_its_own_phase_nested_in_backward() -> None:
    s = CommScript()
    for _ in range(3):
        s.ddp_iter()
    s.log(CLOSE)
    first = s.steps[0]
    assert first.phase_s == (1, 2, 3, 1, 2, 0)  # backward is compute only
    assert first.counts == (1, 1, 1, 1, 1, 0)
    assert first.wait_s == pytest.approx(0.0)
    # In flight: bucket 0 (1 s) and the last bucket (2.5 s), disjoint.
    assert first.collective_s == pytest.approx(3.5)


def test_no_collective_means_in_flight_not_measured() -> None:
    s = CommScript()
    for _ in range(2):
        s.train_iter()
    s.log(CLOSE)
    assert all(t.collective_s is None and t.collective_at_s is None for t in s.steps)


def test_the_arrival_at_the_first_collective_is_its_launch_after_the_step_begins() -> None:
    s = CommScript()
    for _ in range(3):
        s.ddp_iter()
    s.log(CLOSE)
    # fetch 1 + forward 2, then bucket 0 launched 1 s into backward
    assert [t.collective_at_s for t in s.steps] == [pytest.approx(4.0)] * 3
    assert s.steps[1].t_begin + s.steps[1].collective_at_s == pytest.approx(
        s.steps[0].t_begin + s.steps[0].total_s + 4.0)


def test_accumulated_backwards_arrive_at_the_first_ones_collective() -> None:
    s = CommScript()  # before any optimizer step, backwards end steps, held (then merged)
    for _ in range(2):  # two micro-batches with DDP syncing each, one optimizer step
        s.phase(INPUT, 1)
        s.phase(FORWARD, 2)
        start = s.t
        s.phase(BACKWARD, 3)
        s.span(start + 1, start + 2)
    s.phase(OPTIMIZER, 1)
    s.ddp_iter()
    s.log(CLOSE)
    merged = s.steps[0]
    assert merged.counts[phases.code("backward")] == 2
    assert merged.collective_at_s == pytest.approx(4.0)  # the first micro-batch's bucket


def test_a_pending_collective_arrives_at_its_steps_begin() -> None:
    s = CommScript()
    s.ddp_iter()
    s.phase(INPUT, 1)
    s.phase(COMM, 0.5)  # launched after the fetch: pending until the forward
    s.span(s.t - 0.5, s.t)
    s.phase(FORWARD, 2)
    s.phase(BACKWARD, 3)
    s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    assert s.steps[1].collective_at_s == pytest.approx(1.0)  # its fetch, then the gather


def test_a_collective_between_steps_stays_in_the_step_and_begins_none() -> None:
    s = CommScript()
    s.ddp_iter()
    s.phase(COMM, 0.5)  # all_reduce of the loss for logging, after the optimizer step
    s.span(s.t - 0.5, s.t)
    s.ddp_iter()
    s.log(CLOSE)
    assert len(s.steps) == 2
    assert s.steps[0].phase_s[COMM] == pytest.approx(2.5)
    assert s.steps[0].counts[COMM] == 2
    assert s.steps[0].collective_s == pytest.approx(4.0)


def test_a_collective_after_the_fetch_belongs_to_the_iteration_it_starts() -> None:
    s = CommScript()
    s.ddp_iter()
    s.phase(INPUT, 1)
    s.phase(COMM, 0.5)  # a gather of the batch sizes before the first forward
    s.span(s.t - 0.5, s.t)
    s.phase(FORWARD, 2)
    s.phase(BACKWARD, 3)
    s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    first, second = s.steps
    assert first.total_s == pytest.approx(9.0)  # fetch to fetch
    assert sum(first.phase_s) <= first.total_s
    assert second.phase_s == (1, 2, 3, 1, 0.5, 0)
    assert second.collective_s == pytest.approx(0.5)


def test_collectives_of_an_evaluation_pass_are_left_out() -> None:
    s = CommScript()
    s.ddp_iter()
    for _ in range(3):  # evaluation: fetch, no-grad forward, gather the metrics
        s.phase(INPUT, 4)
        s.log(NOGRAD_FORWARD)
        s.gap(5)
        s.phase(COMM, 1)
        s.span(s.t - 1, s.t)
    s.ddp_iter()
    s.log(CLOSE)
    first = s.steps[0]
    assert first.phase_s[COMM] == pytest.approx(2.0)  # its own DDP wait only
    assert first.collective_s == pytest.approx(3.5)
    assert first.total_s == pytest.approx(9.0)  # ends where the evaluation began


@pytest.mark.parametrize(("spans", "total"), [
    ([], None),
    ([(0, 1)], 1.0),
    ([(0, 1), (2, 3)], 2.0),  # disjoint
    ([(0, 2), (1, 3)], 3.0),  # overlapping
    ([(1, 2), (0, 3)], 3.0),  # a long one launched first, done last
    ([(0, 1), (2, 3), (0.5, 4)], 4.0),  # one late span covering two blocks
])
def test_in_flight_is_the_union_of_the_spans(spans: list[tuple[float, float]],
                                             total: float | None) -> None:
    flight = InFlight()
    for launch, done in sorted(spans, key=lambda s: s[1]):  # in order of completion
        flight.add(launch, done)
    assert flight.total_s() == (None if total is None else pytest.approx(total))


def test_a_span_arriving_late_never_shrinks_the_union() -> None:
    flight = InFlight()
    flight.add(0, 10)
    flight.add(2, 5)  # completed earlier, logged after (another thread's clock read)
    assert flight.total_s() == pytest.approx(10.0)


@pytest.mark.parametrize(("late", "union"), [
    ((0, 1), ((0, 1), (2, 3), (4, 5))),  # before them all
    ((2.5, 3.5), ((2, 3.5), (4, 5))),  # overlapping the middle one
    ((3.2, 3.8), ((2, 3), (3.2, 3.8), (4, 5))),  # in the gap
    ((1, 4.5), ((1, 5),)),  # spanning both
])
def test_a_span_logged_late_lands_where_it_ran(late: tuple[float, float],
                                               union: tuple[tuple[float, float], ...]) -> None:
    flight = InFlight()
    flight.add(2, 3)
    flight.add(4, 5)
    flight.add(*late)
    assert flight.total_s() == pytest.approx(sum(e - b for b, e in union))
    assert flight.gapped(0.0) == (None if len(union) == 1 else union)


def test_a_collective_launched_in_the_step_before_counts_from_this_steps_begin() -> None:
    s = CommScript()
    s.ddp_iter()
    begin = s.t
    s.ddp_iter()  # its backward also waits for an async all_reduce launched 5 s earlier
    s.span(begin - 5.0, begin + 1.0)
    s.ddp_iter()
    s.log(CLOSE)
    second = s.steps[1]
    # logged after the step's own two (4-5, 5.5-8), it ran from the step's begin to 1
    assert second.collective_s == pytest.approx(4.5)
    assert second.collective_spans_s == tuple(
        (pytest.approx(b), pytest.approx(e)) for b, e in ((0, 1), (4, 5), (5.5, 8)))


def test_many_disjoint_collectives_are_all_counted() -> None:
    flight = InFlight()
    for i in range(1000):
        flight.add(2 * i, 2 * i + 1.0)
    assert flight.total_s() == pytest.approx(1000.0)




def _placed(step: Any) -> dict[str, tuple[Any, ...] | None]:
    """Where each phase's first call ran in ``step`` by name (seconds from its begin), and
    its last call's after it when it ran more than once."""
    out: dict[str, tuple[Any, ...] | None] = {}
    for i, p in enumerate(phases.PHASES):
        at, end = step.phase_at_s[i], step.phase_end_s[i]
        last = (step.phase_last_at_s[i], step.phase_last_end_s[i])
        out[p.name] = (None if at is None else (pytest.approx(at), pytest.approx(end))
                       + (() if last == (None, None) else tuple(map(pytest.approx, last))))
    return out


def test_each_phase_is_placed_where_it_ran_communication_inside_backward() -> None:
    s = CommScript()
    for _ in range(3):
        s.ddp_iter()
    s.log(CLOSE)
    for step in s.steps:  # fetch 1, forward 2, backward 3 + 2 of exposed wait, optimizer 1
        assert _placed(step) == {"input": (0, 1), "forward": (1, 3), "backward": (3, 8),
                                 "optimizer": (8, 9), "communication": (6, 8), "hook": None}
        assert step.phase_end_s[phases.code("optimizer")] <= step.total_s
        # in flight from bucket 0's launch to the last bucket's completion, 3.5 s of 4:
        # bucket 0 alone 4-5, then a gap, the last bucket 5.5-8
        assert (step.collective_at_s, step.collective_end_s, step.collective_s) == (
            pytest.approx(4.0), pytest.approx(8.0), pytest.approx(3.5))
        assert step.collective_spans_s == ((pytest.approx(4.0), pytest.approx(5.0)),
                                           (pytest.approx(5.5), pytest.approx(8.0)))


def test_accumulated_micro_batches_place_a_phases_first_and_last_calls() -> None:
    s = CommScript()
    for _ in range(3):  # three optimizer steps of two micro-batches each
        s.micro_batch()
        s.micro_batch()
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    # fetch 0-1, forward 1-3, backward 3-6, fetch 6-7, forward 7-9, backward 9-12, opt 12-13;
    # the first step's micro-batches were held as steps of their own, then merged
    for step in s.steps:
        assert step.counts[phases.code("forward")] == 2
        assert _placed(step) == {"input": (0, 1, 6, 7), "forward": (1, 3, 7, 9),
                                 "backward": (3, 6, 9, 12), "optimizer": (12, 13),
                                 "communication": None, "hook": None}


def test_a_loop_without_a_dataloader_places_its_input_in_the_gap_before_forward() -> None:
    s = CommScript()
    for _ in range(3):
        s.gap(1.5)  # the batch is made in Python, untimed
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    step = s.steps[1]
    assert step.phase_s[phases.code("input")] == pytest.approx(1.5)
    assert _placed(step)["input"] == (0, 1.5) and _placed(step)["forward"] == (1.5, 3.5)


def test_a_phase_nested_in_itself_is_placed_as_its_outer_call() -> None:
    s = CommScript()
    for _ in range(3):
        s.phase(INPUT, 1)
        s.log(FORWARD)  # a model whose forward calls another module's patched forward
        s.gap(0.5)
        s.phase(FORWARD, 1)
        s.gap(0.5)
        s.log(END)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    # both calls counted; the outer one (1 to 3) is the first and the last to end
    assert _placed(s.steps[1])["forward"] == (1, 3)


def test_more_calls_than_two_place_the_first_and_the_last() -> None:
    s = CommScript()
    for _ in range(3):
        s.phase(INPUT, 1)
        s.phase(FORWARD, 2)
        for _ in range(3):  # three collectives before backward (metrics)
            s.phase(COMM, 0.5)
            s.gap(0.25)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    step = s.steps[1]
    assert step.counts[COMM] == 3
    assert _placed(step)["communication"] == (3, 3.5, 4.5, 5)


def test_a_pending_call_of_no_time_is_dropped_with_the_rest_not_placed_in_later_steps() -> None:
    s = CommScript()
    for i in range(4):  # a loop without a DataLoader
        s.gap(1)  # the batch is made
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
        if i == 0:
            s.phase(COMM, 0.0)  # a collective after the step's optimizer, of no time
    s.log(CLOSE)
    assert [_placed(t)["communication"] for t in s.steps[1:]] == [(0, 0), None, None]


@pytest.mark.parametrize(("spans", "kept"), [
    ([(0, 2), (1, 3)], None),  # one span without a gap: the first launch and last end say it
    ([(0, 1), (2, 3)], ((0, 1), (2, 3))),
    ([(0, 1), (2, 3), (0.5, 2.5)], None),  # a late one closes the gap
    ([(2 * i, 2 * i + 1.0) for i in range(MAX_SPANS)],
     tuple((2.0 * i, 2 * i + 1.0) for i in range(MAX_SPANS))),
    ([(2 * i, 2 * i + 1.0) for i in range(MAX_SPANS + 1)], None),  # more than a row keeps
])
def test_spans_with_gaps_are_kept_up_to_a_rows_worth(
        spans: list[tuple[float, float]], kept: tuple[tuple[float, float], ...] | None) -> None:
    flight = InFlight()
    for launch, done in spans:
        flight.add(10.0 + launch, 10.0 + done)
    assert flight.gapped(10.0) == kept


def test_a_step_merged_from_parts_keeps_no_spans_but_its_total() -> None:
    flight = InFlight()
    flight.add_total(1.0)  # an earlier micro-batch's collectives, folded into a total
    flight.add(0, 1)
    flight.add(2, 3)
    assert flight.gapped(0.0) is None and flight.total_s() == pytest.approx(3.0)


def _backward_with_spans(s: CommScript, spans: list[tuple[float, float]]) -> None:
    """A backward of 3 whose collectives ran at ``spans`` after its begin."""
    start = s.t
    s.log(BACKWARD)
    s.gap(3)
    for launch, done in spans:
        s.span(start + launch, start + done)
    s.log(END)


def test_accumulation_whose_earlier_micro_batches_ran_no_collective_keeps_its_spans() -> None:
    s = CommScript()
    for _ in range(3):  # under no_sync: the first micro-batch's backward all-reduces nothing
        s.micro_batch()
        s.phase(INPUT, 1)
        s.phase(FORWARD, 2)
        _backward_with_spans(s, [(1, 2), (2.5, 3)])
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    for step in s.steps:  # the second backward begins 6 + 3 after the merged step's begin
        assert step.counts[phases.code("backward")] == 2
        assert step.collective_spans_s == ((pytest.approx(10), pytest.approx(11)),
                                           (pytest.approx(11.5), pytest.approx(12)))


def test_microsecond_spans_are_drawn_from_the_stored_row() -> None:
    """Spans of tens of µs, stored to the µs at each end, still add up to the step's
    unrounded time in flight, so the export draws them (not two instants)."""
    s = CommScript()
    for _ in range(3):
        s.phase(INPUT, 1e-3)
        s.phase(FORWARD, 2e-3)
        _backward_with_spans(s, [(1.0004e-3, 1.0496e-3), (2.0004e-3, 2.0996e-3)])
        s.phase(OPTIMIZER, 1e-3)
    s.log(CLOSE)
    for step in s.steps:
        row = step_row(step, 0.0, {"rank": 0, "restart": 0, "node_rank": 0})
        assert row.value("collective_spans_ms") == "4-4.05,5-5.1"
        assert row.collective_ms == pytest.approx(0.1484)
        assert in_flight_spans(row) == ((4.0, 4.05), (5.0, 5.1))


def _fetch_and_broadcasting_forward(s: CommScript) -> None:
    """A fetch of 1, then a forward of 2 that begins with DDP's broadcast of BatchNorm's
    statistics (0.5 in flight)."""
    s.phase(INPUT, 1)
    start = s.t
    s.phase(FORWARD, 2)
    s.span(start, start + 0.5)


def test_backwards_arrival_is_its_first_bucket_not_a_broadcast_before_forward() -> None:
    s = CommScript()
    for _ in range(3):
        _fetch_and_broadcasting_forward(s)
        _backward_with_spans(s, [(1, 2), (2.5, 3)])
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    for step in s.steps:  # fetch 1, forward 2, then bucket 0 1 s into backward
        assert step.collective_at_s == pytest.approx(1.0)  # the broadcast
        assert step.gradient_at_s == pytest.approx(4.0)


def test_accumulation_arrives_at_the_last_backwards_collective() -> None:
    """no_sync micro-batches, each forward broadcasting BatchNorm's statistics, the
    gradients all-reduced in the last backward only: backward's arrival is there."""
    s = CommScript()
    for _ in range(3):
        for last in (False, True):
            _fetch_and_broadcasting_forward(s)
            _backward_with_spans(s, [(1, 2), (2.5, 3)] if last else [])
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    for step in s.steps:  # the second micro-batch begins 6 s in; its backward 3 s later
        assert step.collective_at_s == pytest.approx(1.0)
        assert step.gradient_at_s == pytest.approx(10.0)


def test_a_closure_optimizer_arrives_at_its_last_backwards_collective() -> None:
    """LBFGS: optimizer.step(closure) runs forward and backward twice, each backward
    all-reducing; the step's backward arrival is the last one's."""
    s = CommScript()
    for _ in range(3):
        s.phase(INPUT, 1)
        s.log(OPTIMIZER)
        for _ in range(2):
            s.phase(FORWARD, 2)
            _backward_with_spans(s, [(1, 2)])
        s.log(OPTIMIZER_END)
    s.log(CLOSE)
    for step in s.steps:  # fetch 1, forward 2 + backward 3, forward 2, bucket 1 s in
        assert step.collective_at_s == pytest.approx(4.0)
        assert step.gradient_at_s == pytest.approx(9.0)


def test_no_backward_or_no_collective_after_it_arrives_nowhere() -> None:
    s = CommScript()
    for _ in range(3):
        _fetch_and_broadcasting_forward(s)  # a collective in forward only
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    assert [(t.collective_at_s, t.gradient_at_s) for t in s.steps] == [
        (pytest.approx(1.0), None)] * 3


def test_backwards_arrival_is_not_guessed_once_its_launch_is_no_longer_kept() -> None:
    """More collectives in a step than the tracker keeps launches of (FSDP on a deep
    model): when backward's first may be among those dropped, none is given."""
    flight = InFlight()
    flight.add(0.5, 0.6)  # in forward
    for i in range(MAX_DEPTH + 44):  # backward's, from 1.0
        flight.add(1.0 + i * 1e-3, 1.0005 + i * 1e-3)
    assert flight.first_launch_from(0.9) is None
    assert flight.first_launch_from(1.2) == pytest.approx(1.2)  # still kept: exact


def test_backwards_arrival_reaches_its_column() -> None:
    s = CommScript()
    for _ in range(3):
        s.ddp_iter()
    s.log(CLOSE)
    row = step_row(s.steps[1], 0.0, {"rank": 0, "restart": 0, "node_rank": 0})
    assert row.value("gradient_at_ms") == pytest.approx(4000.0)
