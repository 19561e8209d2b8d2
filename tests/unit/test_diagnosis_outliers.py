"""Outlier steps on hand-built 1-, 2- and 8-rank windows: found, patterned, kept
out of the typical step, and the verdict the finding with most to win back."""

from __future__ import annotations

import random

import pytest

from tests.rows import step_row
from traceml.diagnosis.outliers import period
from traceml.diagnosis.step_time import diagnose_step_time, rank_step_times
from traceml.diagnosis.window import select_window
from traceml.records import StepRow


def rows_of(world: int, num_steps: int, slow: dict[int, float], input_ms: float = 0.5,
            noise: float = 0.0, seed: int = 0) -> list[StepRow]:
    """Steps of 10 ms compute and ``input_ms`` input on every rank; a step in
    ``slow`` takes that much longer (as waiting: a checkpoint) on every rank."""
    rng = random.Random(seed)
    out = []
    for rank in range(world):
        for s in range(num_steps):
            fwd = 4.0 + rng.uniform(-noise, noise)
            wait = slow.get(s, 0.0)
            total = input_ms + fwd + 5.0 + 1.0 + wait
            out.append(step_row(rank, s, input_ms, fwd, 5.0, 1.0, total, wait))
    return out


def diagnose(rows: list[StepRow], world: int) -> tuple:  # type: ignore[type-arg]
    return diagnose_step_time(rank_step_times(select_window(rows, 10_000, world), {}))


@pytest.mark.parametrize("world", [1, 2, 8])
def test_a_slow_step_every_50_is_the_verdict_and_the_typical_diagnosis_stays(world: int) -> None:
    slow = {s: 300.0 for s in range(50, 300, 50)}  # a 300 ms checkpoint every 50 steps
    found = diagnose(rows_of(world, 300, slow), world)
    first = found[0]
    assert first.kind == "OUTLIER_STEPS" and first.severity == "crit"
    assert first.evidence["period_steps"] == 50 and first.evidence["num_outlier_steps"] == 5
    assert "every 50 steps" in first.why and "30x the 10.5 ms median step" in first.why
    share = 100 * 5 * 310.5 / (5 * 310.5 + 290 * 10.5)
    assert first.evidence["outlier_share_pct"] == pytest.approx(share)
    assert first.ranks == tuple(range(world))
    # The typical step is diagnosed as the run without the checkpoints is.
    assert [f.kind for f in found[1:] if f.measured] == [
        f.kind for f in diagnose(rows_of(world, 300, {}), world) if f.measured]
    assert "COMPUTE_BOUND" in [f.kind for f in found]


def test_one_off_outliers_are_listed_by_step() -> None:
    found = diagnose(rows_of(2, 100, {17: 40.0, 63: 60.0}), 2)
    outliers = next(f for f in found if f.kind == "OUTLIER_STEPS")
    assert "at steps 17, 63:" in outliers.why and outliers.evidence["period_steps"] is None
    # 2 steps of 100 cost 10 % of nothing much: info, and the typical diagnosis leads.
    assert outliers.severity == "info" and found[0].kind != "OUTLIER_STEPS"


def test_outliers_do_not_decide_the_typical_diagnosis() -> None:
    # Two 2 s stalls in 496 steps used to make a compute-bound run WAIT-HEAVY.
    found = diagnose(rows_of(1, 496, {200: 2000.0, 400: 2000.0}, noise=0.5), 1)
    kinds = [f.kind for f in found if f.measured]
    assert "WAIT_HEAVY" not in kinds and "COMPUTE_BOUND" in kinds
    assert found[0].kind == "OUTLIER_STEPS" and found[0].severity == "crit"


def test_outliers_lose_to_a_typical_problem_with_more_to_win_back() -> None:
    # Input takes 8 of every 18 ms (2.2 s over the window's typical steps): more to win
    # back than a 60 ms stall every 15 steps (1.2 s), which is warn on its own.
    found = diagnose(rows_of(2, 300, {s: 60.0 for s in range(0, 300, 15)}, input_ms=8.0), 2)
    assert found[0].kind == "INPUT_BOUND"
    assert [f.severity for f in found if f.kind == "OUTLIER_STEPS"] == ["warn"]


def test_many_slow_steps_are_not_outliers() -> None:
    # Every other step slow: that is how the run goes, not outliers.
    found = diagnose(rows_of(1, 100, {s: 30.0 for s in range(0, 100, 2)}), 1)
    assert "OUTLIER_STEPS" not in [f.kind for f in found]
    assert found[0].kind == "WAIT_HEAVY"


def test_noise_alone_makes_no_outliers() -> None:
    found = diagnose(rows_of(8, 200, {}, noise=3.0, seed=3), 8)
    assert "OUTLIER_STEPS" not in [f.kind for f in found]


@pytest.mark.parametrize("steps,expected", [
    ((50, 100, 150), 50), ((25, 50, 76, 100), 25), ((3, 6, 9, 12), 3), ((3, 6, 10), None),
    ((10, 20), None), ((5, 40, 41), None),
])
def test_period(steps: tuple[int, ...], expected: int | None) -> None:
    assert period(steps) == expected


def test_on_a_busy_host_only_steps_far_beyond_the_spread_are_outliers() -> None:
    # Contention spreads the steps wide: a fifth or more take 2-6x the median (a
    # loaded 2-core host); the checkpoints still stand out.
    rng = random.Random(1)
    slow = {s: rng.uniform(0, 15) if rng.random() < 0.75 else rng.uniform(25, 60)
            for s in range(300)}
    slow |= {s: 300.0 for s in (50, 100, 150)}
    found = diagnose(rows_of(1, 300, slow, noise=2.0), 1)
    outliers = next(f for f in found if f.kind == "OUTLIER_STEPS")
    assert outliers.evidence["num_outlier_steps"] == 3 and outliers.evidence["period_steps"] == 50


def test_a_period_is_found_among_one_off_outliers() -> None:
    slow = {s: 300.0 for s in range(50, 300, 50)} | {133: 120.0, 178: 90.0}
    found = diagnose(rows_of(2, 300, slow), 2)
    outliers = found[0]
    assert outliers.kind == "OUTLIER_STEPS" and outliers.evidence["period_steps"] == 50
    assert outliers.evidence["num_outlier_steps"] == 7
    assert "7 steps took" in outliers.why
    assert "5 of them every 50 steps (from step 50), and at steps 133, 178:" in outliers.why
