"""Step Time rules on hand-built 1-, 2- and 8-rank windows."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.rows import step_row
from traceml.diagnosis.finding import NOT_MEASURED, Finding
from traceml.diagnosis.step_time import (
    RankStepTimes,
    compute_bound,
    diagnose_step_time,
    input_bound,
    rank_step_times,
    stragglers,
    wait_heavy,
)
from traceml.diagnosis.window import select_window

Phases = tuple[float, float, float, float, float]  # input, forward, backward, optimizer, wait


def times_of(world: int, phases: Callable[[int], Phases], num_steps: int = 20
             ) -> dict[int, RankStepTimes]:
    """Every rank runs ``num_steps`` identical steps with ``phases(rank)``."""
    rows = []
    for rank in range(world):
        inp, fwd, bwd, opt, wait = phases(rank)
        total = inp + fwd + bwd + opt + wait
        rows += [step_row(rank, s, inp, fwd, bwd, opt, total, wait) for s in range(num_steps)]
    return rank_step_times(select_window(rows, 10_000, world), {})


def uniform(phases: Phases) -> Callable[[int], Phases]:
    return lambda rank: phases


def kinds(findings: list[Finding] | tuple[Finding, ...]) -> list[str]:
    """The measured findings' kinds (hand-built runs time no collectives: the
    COMMUNICATION abstention is tested on its own)."""
    return [f.kind for f in findings if f.measured]


@pytest.mark.parametrize(
    ("input_ms", "severity"),
    # 9-11 % sits within the borderline margin of the 10 % threshold: info, either side.
    [(8.9, None), (9.0, "info"), (10.9, "info"), (11.0, "warn"), (19.9, "warn"), (20.0, "crit"),
     (45.0, "crit")],
)
def test_input_bound_thresholds_one_rank(input_ms: float, severity: str | None) -> None:
    times = times_of(1, uniform((input_ms, 30.0, 50.0, 20.0 - input_ms, 0.0)))
    found = input_bound(times)
    assert [f.severity for f in found] == ([severity] if severity else [])
    if severity:
        assert found[0].label == ("BORDERLINE INPUT-BOUND" if severity == "info"
                                  else "INPUT-BOUND")
        assert found[0].ranks == (0,)
        assert found[0].evidence["input_share_pct"] == pytest.approx(input_ms)
        assert f"{input_ms:.1f}%" in found[0].why


@pytest.mark.parametrize(("wait_ms", "severity"),
                         [(8.9, None), (10.0, "info"), (11.0, "warn"), (20.0, "crit")])
def test_wait_heavy_thresholds_eight_ranks(wait_ms: float, severity: str | None) -> None:
    times = times_of(8, uniform((2.0, 30.0, 50.0, 18.0 - wait_ms, wait_ms)))
    found = wait_heavy(times)
    assert [f.severity for f in found] == ([severity] if severity else [])
    if severity:
        assert found[0].label.endswith("WAIT-HEAVY")
        assert found[0].ranks == tuple(range(8))


def test_compute_bound_is_the_diagnosis_when_nothing_else_fires() -> None:
    findings = diagnose_step_time(times_of(1, uniform((2.0, 30.0, 58.0, 8.0, 2.0))))
    assert kinds(findings) == ["COMPUTE_BOUND"]
    assert findings[0].severity == "info"
    assert findings[0].evidence["compute_share_pct"] == pytest.approx(96.0)


def test_compute_bound_is_dropped_when_another_rule_fires() -> None:
    # compute share 86 % would qualify, but wait is 12 %: WAIT-HEAVY, nothing else.
    times = times_of(2, uniform((2.0, 30.0, 48.0, 8.0, 12.0)))
    assert compute_bound(times)
    assert kinds(diagnose_step_time(times)) == ["WAIT_HEAVY"]


def test_balanced_when_no_phase_dominates_eight_ranks() -> None:
    findings = diagnose_step_time(times_of(8, uniform((8.0, 30.0, 46.0, 8.0, 8.0))))
    assert kinds(findings) == ["BALANCED"]
    assert "input 8.0%" in findings[0].why
    assert "wait 8.0%" in findings[0].why


def ddp_input_straggler(slow: int, excess_ms: float) -> Callable[[int], Phases]:
    """The slow rank's loader takes ``excess_ms`` longer; every other rank waits for it
    inside backward's all-reduce, so every step total is 100 ms."""
    def phases(rank: int) -> Phases:
        if rank == slow:
            return (10.0 + excess_ms, 20.0, 60.0 - excess_ms, 10.0, 0.0)
        return (10.0, 20.0, 60.0, 10.0, 0.0)
    return phases


@pytest.mark.parametrize(
    ("excess_ms", "severity"),
    [(8.9, None), (9.0, "info"), (11.0, "warn"), (19.9, "warn"), (20.0, "crit")]
)
def test_input_straggler_two_ranks_with_equal_totals(excess_ms: float, severity: str | None
                                                     ) -> None:
    times = times_of(2, ddp_input_straggler(1, excess_ms))
    assert times[0].total_ms.mean == times[1].total_ms.mean == 100.0
    found = stragglers(times)
    assert [(f.kind, f.severity, f.ranks) for f in found] == (
        [("INPUT_STRAGGLER", severity, (1,))] if severity else []
    )


def test_input_straggler_names_the_rank_and_is_the_diagnosis() -> None:
    findings = diagnose_step_time(times_of(2, ddp_input_straggler(0, 40.0)))
    top = findings[0]
    assert (top.label, top.severity, top.ranks) == ("INPUT STRAGGLER", "crit", (0,))
    assert top.why.startswith("r0 input was 50.0 ms vs 10.0 ms on the other ranks")
    assert top.evidence["excess_pct"] == pytest.approx(40.0)
    assert "r0" in top.next
    # r1 waits for r0 inside backward: that must not read as r1 computing slowly.
    assert "COMPUTE_STRAGGLER" not in kinds(findings)


def test_input_straggler_two_ranks_fsdp_waits_in_forward() -> None:
    # Under FSDP the fast rank waits for r0's loader in forward's all-gather.
    times = times_of(2, lambda r: (45.0, 20.0, 40.0, 5.0, 0.0) if r == 0
                     else (5.0, 60.0, 40.0, 5.0, 0.0))
    assert [(f.kind, f.ranks) for f in stragglers(times)] == [("INPUT_STRAGGLER", (0,))]


def test_input_straggler_eight_ranks_ddp() -> None:
    findings = diagnose_step_time(times_of(8, ddp_input_straggler(6, 15.0)))
    assert (findings[0].kind, findings[0].severity, findings[0].ranks) == (
        "INPUT_STRAGGLER", "warn", (6,))
    assert "COMPUTE_STRAGGLER" not in kinds(findings)


def test_compute_straggler_two_ranks_slow_backward() -> None:
    # Without DDP nothing equalises: r1's backward is 30 ms slower.
    times = times_of(2, lambda r: (5.0, 20.0, 60.0 + (30.0 if r == 1 else 0.0), 10.0, 5.0))
    found = stragglers(times)
    assert [(f.kind, f.ranks) for f in found] == [("COMPUTE_STRAGGLER", (1,))]
    assert found[0].why.startswith("r1 backward was 90.0 ms vs 60.0 ms")


def test_compute_straggler_eight_ranks_ddp_slow_forward() -> None:
    # r5's forward is 30 ms slower; the others wait for it in backward (not timed
    # here): equal totals and equal compute totals, forward names the phase.
    def phases(rank: int) -> Phases:
        return (2.0, 50.0, 60.0, 6.0, 2.0) if rank == 5 else (2.0, 20.0, 90.0, 6.0, 2.0)
    times = times_of(8, phases)
    assert len({t.total_ms.mean for t in times.values()}) == 1
    found = stragglers(times)
    assert [(f.kind, f.severity, f.ranks) for f in found] == [("COMPUTE_STRAGGLER", "crit", (5,))]
    assert found[0].why.startswith("r5 forward was 50.0 ms vs 20.0 ms")


def test_straggler_when_input_and_compute_are_each_just_below_the_limit() -> None:
    def phases(rank: int) -> Phases:
        return (12.0, 20.0, 66.0, 10.0, 0.0) if rank == 2 else (6.0, 20.0, 60.0, 10.0, 4.0)
    found = stragglers(times_of(8, phases))
    assert [(f.kind, f.ranks) for f in found] == [("STRAGGLER", (2,))]


def test_several_stragglers_are_listed_worst_first() -> None:
    extra = {3: 15.0, 6: 25.0}
    times = times_of(8, lambda r: (5.0 + extra.get(r, 0.0), 20.0, 60.0, 10.0, 5.0))
    found = stragglers(times)
    assert [(f.kind, f.severity, f.ranks) for f in found] == [("INPUT_STRAGGLER", "crit", (6, 3))]
    assert "slow too: r3" in found[0].why


def test_one_rank_has_no_straggler() -> None:
    assert stragglers(times_of(1, uniform((50.0, 20.0, 20.0, 5.0, 5.0)))) == []


def test_noisy_but_even_ranks_are_not_stragglers() -> None:
    rng = random.Random(7)
    rows = []
    for rank in range(8):
        for step in range(200):
            inp, fwd, bwd, opt = (rng.gauss(mu, mu * 0.05) for mu in (3.0, 25.0, 55.0, 7.0))
            total = inp + fwd + bwd + opt + 1.0
            rows.append(step_row(rank, step, inp, fwd, bwd, opt, total, 1.0))
    times = rank_step_times(select_window(rows, 10_000, 8), {})
    assert kinds(diagnose_step_time(times)) == ["COMPUTE_BOUND"]


def test_not_measured_when_no_steps() -> None:
    findings = diagnose_step_time({}, "traceml watch records no steps.")
    assert [(f.kind, f.label) for f in findings] == [(NOT_MEASURED, "STEP TIME NOT MEASURED")]
    assert findings[0].why == "traceml watch records no steps."


def test_distributions_keep_quantiles_per_phase() -> None:
    rows = [step_row(0, s, 1.0, 2.0, 3.0, 4.0, 10.0 + s, float(s)) for s in range(101)]
    times = rank_step_times(select_window(rows, 10_000, 1), {0: 0})[0]
    assert times.num_steps == 96  # 5 warm-up steps left out
    assert times.total_ms.count == 96
    assert (times.total_ms.p10, times.total_ms.p50, times.total_ms.p90) == pytest.approx(
        (24.5, 62.5, 100.5))
    assert times.dist("compute").mean == pytest.approx(9.0)
    assert times.node_rank == 0


@pytest.mark.parametrize(("world", "said"), [
    (1, "(25.0 of 100.0 ms)."),
    (2, "(30.0 of 100.0 ms, the median of r0 10.0 and r1 50.0 ms)."),
    (8, "(30.0 of 100.0 ms, the median over 8 ranks, which range 10.0 to 50.0 ms)."),
])
def test_a_median_over_ranks_says_what_it_is_made_of(world: int, said: str) -> None:
    # With two ranks the median is no rank's value: the why names each rank's own.
    def phases(rank: int) -> Phases:
        inp = 25.0 if world == 1 else (10.0 if rank < world // 2 else 50.0)
        return (inp, 30.0, 60.0 - inp, 10.0, 0.0)
    (found,) = input_bound(times_of(world, phases))
    assert found.why.endswith(said), found.why
