"""StepTracker on hand-built event sequences with a fake clock."""

from __future__ import annotations

import pytest

from traceml.agent.steps import BACKWARD, FORWARD, INPUT, OPTIMIZER, StepTiming, StepTracker


class Script:
    """Feeds events at fake times: each call advances the clock."""

    def __init__(self) -> None:
        self.t = 0.0
        self.steps: list[StepTiming] = []
        self.tr = StepTracker(self.steps.append)

    def phase(self, phase: int, dur: float, count: bool = True) -> None:
        self.tr.enter(phase, self.t)
        self.t += dur
        self.tr.exit(self.t, count)
        if phase == OPTIMIZER:
            self.tr.optimizer_done(self.t)

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

    def eval_pass(self, batches: int, fetch: float = 4, fwd: float = 5) -> None:
        for _ in range(batches):
            self.phase(INPUT, fetch)
            self.tr.nograd_forward(self.t)
            self.gap(fwd)


def test_plain_loop_steps_add_up() -> None:
    s = Script()
    for _ in range(4):
        s.train_iter()
    s.tr.close()
    assert [t.step for t in s.steps] == [0, 1, 2, 3]
    for t in s.steps[:3]:
        assert t.phase_s == (1, 2, 3, 1)
        assert t.total_s == pytest.approx(7.5)  # boundary (fetch) to boundary
        assert t.wait_s == pytest.approx(0.5)
        assert t.counts == (1, 1, 1, 1)
    assert s.steps[3].total_s == pytest.approx(7.0)  # last one ends at its optimizer


def test_gradient_accumulation_is_one_step() -> None:
    s = Script()
    for _ in range(3):
        for _ in range(4):
            s.phase(INPUT, 1)
            s.phase(FORWARD, 2)
            s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.tr.close()
    assert len(s.steps) == 3
    assert all(t.counts == (4, 4, 4, 1) for t in s.steps)
    assert s.steps[0].phase_s == (4, 8, 12, 1)


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
    s.tr.close()
    assert len(s.steps) == 3
    assert s.steps[0].counts == (1, 2, 2, 2)
    assert s.steps[0].total_s == pytest.approx(13)


def test_without_dataloader_forward_begins_the_step() -> None:
    s = Script()
    for _ in range(3):
        s.train_iter(fetch=0, tail=2)
    s.tr.close()
    assert len(s.steps) == 3
    assert s.steps[0].total_s == pytest.approx(8)
    assert s.steps[0].phase_s == (0, 2, 3, 1)


def test_closure_optimizer_time_is_exclusive() -> None:
    s = Script()
    for _ in range(2):
        s.phase(INPUT, 1)
        s.tr.enter(OPTIMIZER, s.t)
        s.gap(0.5)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.gap(0.25)
        s.tr.exit(s.t)
        s.tr.optimizer_done(s.t)
    s.tr.close()
    assert len(s.steps) == 2
    assert s.steps[0].phase_s == pytest.approx((1, 2, 3, 0.75))
    assert s.steps[0].counts == (1, 1, 1, 1)


def test_eval_loop_is_kept_out_of_steps() -> None:
    s = Script()
    s.train_iter()
    s.eval_pass(3)  # 27 s of evaluation
    s.train_iter()
    s.train_iter()
    s.tr.close()
    assert len(s.steps) == 3
    first, second = s.steps[0], s.steps[1]
    assert first.total_s == pytest.approx(7.5)  # closed where evaluation began
    assert second.phase_s == (1, 2, 3, 1)
    assert second.counts == (1, 1, 1, 1)
    assert second.total_s == pytest.approx(7.5)


def test_nograd_forward_inside_a_step_is_not_evaluation() -> None:
    # Distillation: a frozen teacher runs without grad after the fetch.
    s = Script()
    for _ in range(3):
        s.phase(INPUT, 1)
        s.tr.nograd_forward(s.t)
        s.gap(4)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
    s.tr.close()
    assert len(s.steps) == 3
    assert s.steps[0].phase_s == (1, 2, 3, 1)
    assert s.steps[0].total_s == pytest.approx(11)
    assert s.steps[0].wait_s == pytest.approx(4)


def test_skipped_scaler_step_still_ends_iteration() -> None:
    s = Script()
    for i in range(3):
        s.phase(INPUT, 1)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.tr.enter(OPTIMIZER, s.t)
        s.gap(0.5)
        s.tr.exit(s.t)
        s.tr.optimizer_done(s.t, skipped=(i == 1))
    s.tr.close()
    assert len(s.steps) == 3
    assert [t.num_skipped for t in s.steps] == [0, 1, 0]


def test_manual_boundaries_replace_detection() -> None:
    s = Script()
    s.train_iter()  # automatic step, open when trace_step first enters
    for _ in range(2):
        s.phase(INPUT, 1)  # the seed README fetches outside the context
        s.tr.manual_enter(s.t)
        s.phase(FORWARD, 2)
        s.phase(BACKWARD, 3)
        s.phase(OPTIMIZER, 1)
        s.phase(FORWARD, 2)  # a second optimizer inside the same context
        s.phase(OPTIMIZER, 1)
        s.tr.manual_exit(s.t)
        s.gap(5)  # outside any step
    s.tr.close()
    assert len(s.steps) == 3
    assert s.steps[1].phase_s == (1, 4, 3, 2)
    assert s.steps[1].total_s == pytest.approx(10)
    assert s.steps[2].total_s == pytest.approx(10)


def test_incomplete_last_step_is_dropped() -> None:
    s = Script()
    s.train_iter()
    s.phase(INPUT, 1)
    s.phase(FORWARD, 2)  # crashed before backward/optimizer
    s.tr.close()
    assert len(s.steps) == 1


def test_work_after_an_eval_loop_stays_out_of_the_next_step() -> None:
    # A plain DataLoader ends the evaluation loop with a fetch that raises
    # StopIteration; then come metrics, logging, a checkpoint (300 s here).
    s = Script()
    s.train_iter()
    s.eval_pass(2)
    s.tr.enter(INPUT, s.t)
    s.t += 0.25
    s.tr.exit(s.t, exhausted=True)
    s.gap(300)
    s.train_iter()
    s.train_iter()
    s.tr.close()
    assert len(s.steps) == 3
    assert s.steps[0].total_s == pytest.approx(7.5)
    assert s.steps[1].total_s == pytest.approx(7.5) and s.steps[1].counts == (1, 1, 1, 1)


def test_a_training_loader_running_out_still_begins_the_last_step() -> None:
    # Accelerate's loaders fetch one batch ahead: the last step's only fetch is
    # the one that raises StopIteration.
    s = Script()
    s.train_iter()
    s.tr.enter(INPUT, s.t)
    s.t += 0.25
    s.tr.exit(s.t, exhausted=True)
    s.phase(FORWARD, 2)
    s.phase(BACKWARD, 3)
    s.phase(OPTIMIZER, 1)
    s.tr.close()
    assert len(s.steps) == 2 and s.steps[1].counts == (1, 1, 1, 1)
