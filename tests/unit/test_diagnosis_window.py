"""The analysis window: alignment across ranks, warm-up, window size, sample span."""

from __future__ import annotations

import pytest

from tests.rows import step_row
from traceml.diagnosis.window import in_span, select_window, warmup_steps
from traceml.records import ProcessSample, StepRow, SystemSample


def row(rank: int, step: int, total_ms: float = 10.0, t: float | None = None) -> StepRow:
    return step_row(rank, step, 1.0, 2.0, 3.0, 4.0, total_ms, 0.0, t=t)


@pytest.mark.parametrize(("aligned", "warm"), [(0, 0), (9, 0), (10, 1), (30, 3), (50, 5),
                                              (10_000, 5)])
def test_warmup_is_min_five_and_ten_percent(aligned: int, warm: int) -> None:
    assert warmup_steps(aligned) == warm


def test_window_aligns_on_steps_every_rank_completed() -> None:
    rows = [row(0, s) for s in range(30)] + [row(1, s) for s in range(20)]
    window = select_window(rows, 10_000, 2)
    assert window.num_warmup_steps == 2  # 10 % of the 20 aligned steps
    assert window.steps == tuple(range(2, 20))
    assert [r.step for r in window.by_rank[0]] == list(window.steps)
    assert [r.step for r in window.by_rank[1]] == list(window.steps)


def test_window_keeps_the_last_rows_after_warmup() -> None:
    window = select_window([row(r, s) for r in range(8) for s in range(100)], 10, 8)
    assert window.steps == tuple(range(90, 100))
    scope = window.scope({r: r // 4 for r in range(8)}, 2)
    assert (scope.num_steps, scope.num_warmup_steps, scope.first_step, scope.last_step) == (
        10, 5, 90, 99)
    assert scope.ranks == tuple(range(8))
    assert scope.nodes == (0, 1)
    assert scope.window_rows == 10


def test_missing_ranks_are_listed_not_waited_for() -> None:
    window = select_window([row(r, s) for r in (0, 1, 2) for s in range(12)], 10_000, 4)
    assert window.ranks == (0, 1, 2)
    scope = window.scope({}, 1)
    assert scope.missing_ranks == (3,)
    assert scope.num_steps == 11


def test_a_resent_step_replaces_the_first() -> None:
    window = select_window([row(0, 0, 10.0), row(0, 0, 12.0)], 10_000, 1)
    assert [r.total_ms for r in window.by_rank[0]] == [12.0]


def test_no_steps_gives_an_empty_window() -> None:
    window = select_window([], 10_000, 2)
    assert window.steps == ()
    assert window.scope({}, 1).missing_ranks == (0, 1)
    assert window.time_span() is None


def test_time_span_covers_the_window_steps() -> None:
    rows = [row(r, s, 100.0, t=1000.0 + 0.1 * (s + 1)) for r in range(2) for s in range(20)]
    span = select_window(rows, 10_000, 2).time_span()
    assert span == pytest.approx((1000.2, 1002.0))  # steps 2..19; step 2 starts at 1000.2


def test_time_span_is_none_when_steps_have_no_times() -> None:
    assert select_window([row(0, s) for s in range(20)], 10_000, 1).time_span() is None


def sample(t: float, rank: int = 0) -> ProcessSample:
    return ProcessSample(rank, 0, t, 100.0, 1, 2, 4)


def test_in_span_keeps_samples_inside_or_all_when_none_fall_inside() -> None:
    samples = [sample(float(t)) for t in range(10)]
    assert [s.t for s in in_span(samples, (2.5, 5.0))] == [3.0, 4.0, 5.0]
    assert len(in_span(samples, (100.0, 200.0))) == 10
    assert len(in_span(samples, None)) == 10


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_in_span_keeps_a_rank_with_no_sample_inside_by_its_own_samples(world_size: int) -> None:
    # r0 sampled inside the span; every other rank only before and after it.
    samples = [sample(1.0, 0), sample(3.0, 0)] + [
        sample(t, r) for r in range(1, world_size) for t in (0.5, 4.0)]
    kept = in_span(samples, (2.0, 3.5))
    assert {s.rank for s in kept} == set(range(world_size))
    assert [s.t for s in kept if s.rank == 0] == [3.0]
    assert all([s.t for s in kept if s.rank == r] == [0.5, 4.0] for r in range(1, world_size))


def test_in_span_keeps_a_node_with_no_system_sample_inside() -> None:
    samples = [SystemSample(node, f"h{node}", t, 10.0, 20.0, 8) for node, t in
               ((0, 1.0), (0, 3.0), (1, 0.5), (1, 4.0))]
    kept = in_span(samples, (2.0, 3.5))
    assert [(s.node_rank, s.t) for s in kept] == [(0, 3.0), (1, 0.5), (1, 4.0)]
