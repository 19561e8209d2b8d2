"""The collector's step tracker on hand-built event logs with a fake clock,
and RankSteps on hand-built event batches."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from tests.raw_wire import empty_times
from traceml.collector.rank_steps import RankSteps, merge_device_marks
from traceml.collector.step_parts import StepTiming
from traceml.collector.steps import HOLD_BACKWARD_STEPS, StepTracker
from traceml.errors import ProtocolError
from traceml.wire.events import (
    BACKWARD,
    CLOSE,
    COPY,
    END,
    END_EXHAUSTED,
    END_UNCOUNTED,
    EVAL_FORWARD,
    FORWARD,
    INPUT,
    MANUAL_ENTER,
    MANUAL_EXIT,
    MARK,
    NOGRAD_FORWARD,
    OPTIMIZER,
    OPTIMIZER_END,
    OPTIMIZER_SKIPPED,
    RSS,
    EventBatch,
)


class Script:
    """Logs events at fake times, as the patches do, and replays them at once
    (the replay is incremental: state carries over between replays)."""

    def __init__(self, replay_each: bool = True) -> None:
        self.t = 0.0
        self.steps: list[StepTiming] = []
        self.tr = StepTracker(self.steps.append)
        self.events: deque[tuple[int, Any]] = deque()
        self.replay_each = replay_each

    def log(self, code: int) -> None:
        self.events.append((code, self.t))
        if self.replay_each:
            self.tr.replay(self.events)
            self.events.clear()

    def phase(self, phase: int, dur: float, count: bool = True) -> None:
        self.log(phase)
        self.t += dur
        self.log(OPTIMIZER_END if phase == OPTIMIZER else END if count else END_UNCOUNTED)

    def gap(self, dur: float) -> None:
        self.t += dur

    def train_iter(self, fetch: float = 1, fwd: float = 2, bwd: float = 3, opt: float = 1,
                   tail: float = 0.5) -> None:
        if fetch:
            self.phase(INPUT, fetch)
        self.phase(FORWARD, fwd)
        self.phase(BACKWARD, bwd)
        self.phase(OPTIMIZER, opt)
        self.gap(tail)

    def micro_batch(self, fetch: float = 1, fwd: float = 2, bwd: float = 3) -> None:
        """A fetch (none when 0), a forward and a backward."""
        if fetch:
            self.phase(INPUT, fetch)
        self.phase(FORWARD, fwd)
        self.phase(BACKWARD, bwd)

    def eval_pass(self, batches: int, fetch: float = 4, fwd: float = 5) -> None:
        for _ in range(batches):
            self.phase(INPUT, fetch)
            self.log(NOGRAD_FORWARD)
            self.gap(fwd)


def test_plain_loop_steps_add_up() -> None:
    s = Script()
    for _ in range(4):
        s.train_iter()
    s.log(CLOSE)
    assert [t.step for t in s.steps] == [0, 1, 2, 3]
    for t in s.steps[:3]:
        assert t.phase_s == (1, 2, 3, 1, 0, 0)
        assert t.total_s == pytest.approx(7.5)  # boundary (fetch) to boundary
        assert t.wait_s == pytest.approx(0.5)
        assert t.counts == (1, 1, 1, 1, 0, 0)
    assert s.steps[3].total_s == pytest.approx(7.0)  # last one ends at its optimizer


def test_gradient_accumulation_is_one_step() -> None:
    s = Script()
    for _ in range(3):
        for _ in range(4):
            s.phase(INPUT, 1)
            s.phase(FORWARD, 2)
            s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    assert len(s.steps) == 3
    assert all(t.counts == (4, 4, 4, 1, 0, 0) for t in s.steps)
    assert s.steps[0].phase_s == (4, 8, 12, 1, 0, 0)


def test_two_optimizers_with_dataloader_is_one_step() -> None:
    s = Script()
    for _ in range(3):
        s.phase(INPUT, 1)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    assert len(s.steps) == 3
    assert s.steps[0].counts == (1, 2, 2, 2, 0, 0)
    assert s.steps[0].total_s == pytest.approx(13)


def test_without_dataloader_the_time_before_the_forward_is_input() -> None:
    # get_batch() after the optimizer step: the next step's input.
    s = Script()
    for _ in range(3):
        s.train_iter(fetch=0, tail=2)
    s.log(CLOSE)
    assert len(s.steps) == 3
    assert s.steps[0].total_s == pytest.approx(6)  # the first step begins at its forward
    assert s.steps[0].phase_s == (0, 2, 3, 1, 0, 0)
    assert s.steps[1].total_s == pytest.approx(8)
    assert s.steps[1].phase_s == (2, 2, 3, 1, 0, 0)
    assert s.steps[1].counts == (0, 1, 1, 1, 0, 0)  # no fetch
    assert [t.boundary for t in s.steps] == ["optimizer"] * 3


def test_closure_optimizer_time_is_exclusive() -> None:
    s = Script()
    for _ in range(2):
        s.phase(INPUT, 1)
        s.log(OPTIMIZER)
        s.gap(0.5)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.gap(0.25)
        s.log(OPTIMIZER_END)
    s.log(CLOSE)
    assert len(s.steps) == 2
    assert s.steps[0].phase_s == pytest.approx((1, 2, 3, 0.75, 0, 0))
    assert s.steps[0].counts == (1, 1, 1, 1, 0, 0)


def test_eval_loop_is_kept_out_of_steps() -> None:
    s = Script()
    s.train_iter()
    s.eval_pass(3)  # 27 s of evaluation
    s.train_iter()
    s.train_iter()
    s.log(CLOSE)
    assert len(s.steps) == 3
    first, second = s.steps[0], s.steps[1]
    assert first.total_s == pytest.approx(7.5)  # closed where evaluation began
    assert second.phase_s == (1, 2, 3, 1, 0, 0)
    assert second.counts == (1, 1, 1, 1, 0, 0)
    assert second.total_s == pytest.approx(7.5)


def test_nograd_forward_inside_a_step_is_not_evaluation() -> None:
    # Distillation: a frozen teacher runs without grad after the fetch.
    s = Script()
    for _ in range(3):
        s.phase(INPUT, 1)
        s.log(NOGRAD_FORWARD)
        s.gap(4)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    assert len(s.steps) == 3
    assert s.steps[0].phase_s == (1, 2, 3, 1, 0, 0)
    assert s.steps[0].total_s == pytest.approx(11)
    assert s.steps[0].wait_s == pytest.approx(4)


def test_skipped_scaler_step_still_ends_iteration() -> None:
    s = Script()
    for i in range(3):
        s.phase(INPUT, 1)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.log(OPTIMIZER)
        s.gap(0.5)
        s.log(OPTIMIZER_SKIPPED if i == 1 else OPTIMIZER_END)
    s.log(CLOSE)
    assert len(s.steps) == 3
    assert [t.num_skipped for t in s.steps] == [0, 1, 0]


def test_manual_boundaries_replace_detection() -> None:
    s = Script()
    s.train_iter()  # automatic step, open when trace_step first enters
    for _ in range(2):
        s.phase(INPUT, 1)  # the seed README fetches outside the context
        s.log(MANUAL_ENTER)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
        s.phase(FORWARD, 2)  # a second optimizer inside the same context
        s.phase(OPTIMIZER, 1)
        s.log(MANUAL_EXIT)
        s.gap(5)  # outside any step
    s.log(CLOSE)
    assert len(s.steps) == 3
    assert s.steps[1].phase_s == (1, 4, 3, 2, 0, 0)
    assert s.steps[1].total_s == pytest.approx(10)
    assert s.steps[2].total_s == pytest.approx(10)


def test_incomplete_last_step_is_dropped() -> None:
    s = Script()
    s.train_iter()
    s.phase(INPUT, 1)
    s.phase(FORWARD, 2)  # crashed before backward/optimizer
    s.log(CLOSE)
    assert len(s.steps) == 1


def test_work_after_an_eval_loop_stays_out_of_the_next_step() -> None:
    # A plain DataLoader ends the evaluation loop with a fetch that raises
    # StopIteration; then come metrics, logging, a checkpoint (300 s here).
    s = Script()
    s.train_iter()
    s.eval_pass(2)
    s.log(INPUT)
    s.t += 0.25
    s.log(END_EXHAUSTED)
    s.gap(300)
    s.train_iter()
    s.train_iter()
    s.log(CLOSE)
    assert len(s.steps) == 3
    assert s.steps[0].total_s == pytest.approx(7.5)
    assert s.steps[1].total_s == pytest.approx(7.5) and s.steps[1].counts == (1, 1, 1, 1, 0, 0)


def test_a_training_loader_running_out_still_begins_the_last_step() -> None:
    # Accelerate's loaders fetch one batch ahead: the last step's only fetch is
    # the one that raises StopIteration.
    s = Script()
    s.train_iter()
    s.log(INPUT)
    s.t += 0.25
    s.log(END_EXHAUSTED)
    s.phase(FORWARD, 2)
    s.phase(BACKWARD, 3)
    s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    assert len(s.steps) == 2 and s.steps[1].counts == (1, 1, 1, 1, 0, 0)


def test_marks_belong_to_the_step_they_were_logged_in() -> None:
    s = Script()
    for i in range(3):
        s.phase(INPUT, 1)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
        s.events.append((MARK, f"opt1-{i}"))  # logged at each optimizer's end, as on CUDA
        s.phase(OPTIMIZER, 1)  # a second optimizer in the same iteration
        s.events.append((MARK, f"opt2-{i}"))
        s.gap(0.5)
    s.log(CLOSE)
    assert [t.marks for t in s.steps] == [("opt1-0", "opt2-0"), ("opt1-1", "opt2-1"),
                                          ("opt1-2", "opt2-2")]


def test_one_batch_replay_equals_event_by_event() -> None:
    """The collector replays a whole batch (many steps) at once."""
    one, batch = Script(), Script(replay_each=False)
    for s in (one, batch):
        for i in range(6):
            s.train_iter()
            if i == 2:
                s.eval_pass(3)
        s.log(CLOSE)
    assert batch.steps == []
    assert len(batch.events) == 6 * 8 + 3 * 3 + 1
    batch.tr.replay(batch.events)
    assert len(one.steps) == 6
    assert batch.steps == one.steps


def test_manual_step_keeps_the_mark_logged_at_its_exit() -> None:
    s = Script()
    for i in range(2):
        s.log(MANUAL_ENTER)
        s.phase(FORWARD, 2)  # no optimizer: an inference loop under trace_step
        s.events.append((MARK, f"device-{i}"))  # step_exit logs it before MANUAL_EXIT
        s.log(MANUAL_EXIT)
        s.gap(1)
    s.log(CLOSE)
    assert [t.marks for t in s.steps] == [("device-0",), ("device-1",)]


@pytest.mark.parametrize("resync", [True, False])
def test_a_cut_log_resynchronises_at_the_next_boundary(resync: bool) -> None:
    s = Script()
    s.train_iter()
    s.phase(INPUT, 1)
    s.log(OPTIMIZER)  # ... its end was dropped when the log overflowed
    if resync:
        s.tr.resync()
    for _ in range(3):
        s.train_iter()
    s.log(CLOSE)
    if resync:  # the interrupted step is dropped and detection goes on
        assert [t.phase_s for t in s.steps] == [(1, 2, 3, 1, 0, 0)] * 4
    else:  # the orphan optimizer phase swallows every later iteration into one step
        assert len(s.steps) == 2
        assert s.steps[1].counts[FORWARD] == 3


def test_rss_events_stamp_the_steps_that_finish_after_them() -> None:
    s = Script()
    s.events.append((RSS, 100))
    s.train_iter()
    s.train_iter()  # step 0 finishes here, at the next fetch
    s.events.append((RSS, 200))
    s.train_iter()
    s.log(CLOSE)
    assert [t.rss_bytes for t in s.steps] == [100, 200, 200]


def _batch(n: int, events: list[list[Any]], offset: float = 1000.0) -> dict[str, Any]:
    """The wire form of a timeline: times per code; a mark or RSS reading is
    stamped with the time of the event before it, as the rank stamps them."""
    times: list[list[Any]] = empty_times()
    marks: list[Any] = []
    rss: list[Any] = []
    last = 0.0
    for code, value in events:
        if code == MARK:
            marks.append([last, value])
        elif code == RSS:
            rss.append([last, value])
        elif isinstance(code, int) and 0 <= code < len(times):
            times[code].append(value)
            last = value if isinstance(value, float) else last
        else:
            times.append([code, value])  # malformed on purpose
    return EventBatch(n, offset, times, marks, rss).payload()


def _iteration(t: float, mark: list[Any] | None = None) -> list[list[Any]]:
    events = [[INPUT, t], [END, t + 1], [FORWARD, t + 1], [END, t + 3],
              [BACKWARD, t + 3], [END, t + 6], [OPTIMIZER, t + 6], [OPTIMIZER_END, t + 7]]
    return events + ([[MARK, mark]] if mark is not None else [])


def test_rank_steps_turn_batches_into_step_rows() -> None:
    steps = RankSteps()
    first = steps.feed(_batch(0, [[RSS, 4096], *_iteration(0.0, [10, 20, 1.5, None, 0.5,
                                                                   None, None])]))
    assert first == []  # step 0 stays open until the next iteration begins
    rows = steps.feed(_batch(1, [*_iteration(8.0, [30, 15, 2.0, None, 0.25, 0.5, 2.0]),
                                 [MARK, [5, 40, 1.0, None, 0.25, 0.75, 3.0]], [CLOSE, 16.0]]))
    row = [r.columns() for r in rows]
    assert [r["step"] for r in row] == [0, 1]
    assert row[0]["t_begin"] == 1000.0 and row[1]["t_begin"] == 1008.0
    assert (row[0]["input_ms"], row[0]["forward_ms"], row[0]["backward_ms"],
            row[0]["optimizer_ms"], row[0]["total_ms"]) == (1e3, 2e3, 3e3, 1e3, 8e3)
    assert row[0]["rss_bytes"] == 4096
    # Two marks in one step (two optimizers): the highest peaks, the GPU times summed.
    assert (row[1]["peak_allocated_bytes"], row[1]["peak_reserved_bytes"]) == (30, 40)
    assert (row[1]["gpu_forward_ms"], row[1]["gpu_backward_ms"],
            row[1]["gpu_optimizer_ms"], row[1]["gpu_communication_ms"]) == (3.0, None, 0.5, 1.25)
    assert row[1]["gpu_collective_ms"] == 5.0  # in flight on the GPU, summed like the waits
    assert row[0]["gpu_communication_ms"] is None  # no DDP wait timed: not measured
    assert row[0]["gpu_collective_ms"] is None


def test_rank_steps_resynchronise_after_a_lost_batch() -> None:
    steps = RankSteps()
    steps.feed(_batch(0, _iteration(0.0)))
    cut = _iteration(8.0)
    # Batch 1 (the end of this iteration, the start of the next) never arrived.
    rows = steps.feed(_batch(2, cut[5:] + _iteration(16.0) + _iteration(24.0)))
    counts = [r.counts for r in rows]
    # The iteration cut in two went: from the gap on, only its optimizer step
    # was seen, a step of its own.  The iterations after it are whole.
    assert counts == [(0, 0, 0, 1, 0, 0), (1, 1, 1, 1, 0, 0)]


@pytest.mark.parametrize("events", [
    [[99, 1.0]],  # a code past the last
    [[END, "soon"]],  # no time
    [[MARK, [1, 2]]],  # a short device mark
    [[MARK, [1, 2, "x", None, None]]],
    [[RSS, "big"]],
])
def test_rank_steps_reject_a_malformed_batch_whole(events: list[list[Any]]) -> None:
    steps = RankSteps()
    with pytest.raises(ProtocolError):
        steps.feed(_batch(0, _iteration(0.0) + events + _iteration(8.0)))
    assert steps.feed(_batch(1, _iteration(16.0) + [[CLOSE, 24.0]]))[0].step == 0


def test_rank_steps_reject_values_that_would_only_fail_later() -> None:
    """A time where a mark belongs, or an int SQLite cannot store: rejected up
    front, and the batch after it is replayed as if the bad one never came."""
    steps = RankSteps()
    bad = _batch(0, _iteration(0.0))
    bad["times"][MARK] = [1.0]
    with pytest.raises(ProtocolError):
        steps.feed(bad)
    huge = _batch(0, [[RSS, 2**64], *_iteration(0.0)])
    with pytest.raises(ProtocolError):
        steps.feed(huge)
    rows = steps.feed(_batch(0, _iteration(8.0) + _iteration(16.0) + [[CLOSE, 24.0]]))
    assert [r.step for r in rows] == [0, 1]


def test_a_log_of_begins_without_ends_is_dropped_not_kept() -> None:
    steps = RankSteps()
    opened = [[FORWARD, float(i)] for i in range(10_000)]
    steps.feed(_batch(0, opened))
    assert len(steps.tracker._stack) < 300


def test_a_step_with_an_untimed_device_mark_has_no_gpu_times() -> None:
    """The agent times a sample of step ends: a step of two optimizer steps of
    which one was timed keeps its highest peaks but no GPU times (not half)."""
    timed = [100, 200, 2.0, 3.0, 1.0, 0.5, 2.5]
    untimed = [None] * 7
    assert merge_device_marks((timed, untimed)) == (100, 200, None, None, None, None, None)
    assert merge_device_marks((timed, [50, 300, 2.0, 3.0, 1.0, 0.5, 2.5])) == (
        100, 300, 4.0, 6.0, 2.0, 1.0, 5.0)
    assert merge_device_marks((untimed,)) == (None,) * 7
def test_manual_parameter_updates_end_steps_at_backward() -> None:
    # No torch.optim: forward, backward, then the loop updates p.data itself.
    s = Script()
    for _ in range(5):
        s.micro_batch(fetch=0)
        s.gap(1)  # the update
    s.log(CLOSE)
    assert len(s.steps) == 5
    assert [t.boundary for t in s.steps] == ["backward"] * 5
    assert s.steps[1].total_s == pytest.approx(6)  # the update is the step's (wait)
    assert s.steps[1].phase_s == (0, 2, 3, 0, 0, 0) and s.steps[1].wait_s == pytest.approx(1)
    assert [t.step for t in s.steps] == list(range(5))


def test_two_backwards_without_optimizer_are_one_step() -> None:
    s = Script()
    for _ in range(3):
        s.micro_batch(fetch=0)
        s.phase(BACKWARD, 1)  # a second loss, retain_graph
        s.gap(1)
    s.log(CLOSE)
    assert len(s.steps) == 3 and s.steps[0].counts == (0, 1, 2, 0, 0, 0)


def test_accumulation_before_the_first_optimizer_step_is_one_step() -> None:
    # The backward passes before the first optimizer step looked like steps of
    # their own until it came: held back, they merge.
    s = Script()
    for _ in range(3):
        for _ in range(4):
            s.micro_batch()
        s.phase(OPTIMIZER, 1)
        s.gap(0.5)
    s.log(CLOSE)
    assert len(s.steps) == 3
    assert s.steps[0].counts == (4, 4, 4, 1, 0, 0)
    assert s.steps[0].total_s == pytest.approx(25.5)
    assert [t.boundary for t in s.steps] == ["optimizer"] * 3
    assert [t.step for t in s.steps] == [0, 1, 2]


def test_backward_ended_steps_are_emitted_once_enough_are_held() -> None:
    s = Script()
    for _ in range(HOLD_BACKWARD_STEPS + 2):
        s.micro_batch(fetch=0)
    assert len(s.steps) == HOLD_BACKWARD_STEPS + 1  # before the run ends
    s.log(CLOSE)
    assert [t.step for t in s.steps] == list(range(HOLD_BACKWARD_STEPS + 2))


def test_evaluation_without_a_dataloader_is_kept_out_and_counted() -> None:
    # Every 2 steps the loop calls its model under no_grad on batches it builds.
    s = Script()
    for i in range(6):
        if i and i % 2 == 0:
            for _ in range(3):
                s.gap(1)  # the evaluation's batch
                s.log(EVAL_FORWARD)
                s.gap(4)
        s.train_iter(fetch=0, tail=0)
        s.gap(0.5)  # get_batch: the next step's input
    s.log(CLOSE)
    assert len(s.steps) == 6
    assert all(t.total_s <= 6.5 + 1e-9 for t in s.steps)
    assert [t.num_eval for t in s.steps] == [0, 0, 1, 0, 1, 0]
    assert s.steps[2].eval_s == pytest.approx(15.5)  # the batch after it included
    assert s.steps[3].phase_s == (0.5, 2, 3, 1, 0, 0)


def test_predictions_between_closure_steps_are_evaluation() -> None:
    # LBFGS: optimizer.step(closure), then predict and plot without grad.
    s = Script()
    for _ in range(4):
        s.log(OPTIMIZER)
        s.micro_batch(fetch=0)
        s.log(OPTIMIZER_END)
        s.log(EVAL_FORWARD)  # the trained model predicts
        s.gap(3)
        s.log(NOGRAD_FORWARD)  # the criterion on the prediction
        s.gap(10)  # plotting
    s.log(CLOSE)
    assert len(s.steps) == 4
    assert all(t.total_s == pytest.approx(5) for t in s.steps)
    assert [t.num_eval for t in s.steps] == [0, 1, 1, 1]
    assert s.steps[1].eval_s == pytest.approx(13)


def test_a_target_network_inside_the_iteration_is_not_evaluation() -> None:
    s = Script()
    for _ in range(3):
        s.phase(INPUT, 1)
        s.phase(FORWARD, 2)
        s.log(EVAL_FORWARD)  # the same network, without grad, for the target
        s.gap(1)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    assert len(s.steps) == 3 and all(t.num_eval == 0 for t in s.steps)
    assert s.steps[1].total_s == pytest.approx(8)


def test_host_to_device_copies_are_input() -> None:
    s = Script()
    for _ in range(3):
        s.phase(INPUT, 1)
        s.log(COPY)  # batch.to(device) after the fetch
        s.gap(0.5)
        s.log(END)
        s.phase(FORWARD, 2)
        s.log(COPY)  # a copy between forward and backward
        s.gap(0.25)
        s.log(END)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    assert len(s.steps) == 3
    assert s.steps[1].phase_s == pytest.approx((1.75, 2, 3, 1, 0, 0))
    assert s.steps[1].counts == (1, 1, 1, 1, 0, 0)


def test_accumulation_with_the_optimizer_step_after_the_last_fetch_is_one_step() -> None:
    # Lightning accumulating 2 batches: the first micro-batch runs its closure
    # outside the optimizer step, the last one inside optimizer.step(closure).
    s = Script()
    for _ in range(3):
        s.micro_batch()
        s.phase(INPUT, 1)
        s.log(OPTIMIZER)
        s.micro_batch(fetch=0)
        s.log(OPTIMIZER_END)
    s.log(CLOSE)
    assert [t.step for t in s.steps] == [0, 1, 2]
    assert all(t.counts == (2, 2, 2, 1, 0, 0) for t in s.steps)
