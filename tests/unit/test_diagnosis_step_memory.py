"""Step Memory rules on hand-built 1-, 2- and 8-rank windows."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.rows import step_row
from traceml.diagnosis.finding import NOT_MEASURED, Finding
from traceml.diagnosis.step_memory import (
    RankMemory,
    device_creep,
    diagnose_step_memory,
    high_pressure,
    imbalance,
    rank_memory,
    rss_creep,
)
from traceml.diagnosis.window import select_window

GIB = 1024**3
MIB = 1024**2
CAPACITY = 80 * GIB

Memory = tuple[int | None, int | None, int | None]  # peak allocated, peak reserved, rss


def memory_of(world: int, memory: Callable[[int, int], Memory], num_steps: int = 33,
              capacity: int | None = CAPACITY) -> dict[int, RankMemory]:
    """``num_steps`` steps per rank (3 are warm-up) with ``memory(rank, step)``."""
    rows = [step_row(r, s, 1.0, 2.0, 3.0, 4.0, 10.0, 0.0, *memory(r, s))
            for r in range(world) for s in range(num_steps)]
    caps = {r: capacity for r in range(world)} if capacity is not None else {}
    return rank_memory(select_window(rows, 10_000, world), caps, {})


def kinds(findings: list[Finding] | tuple[Finding, ...]) -> list[str]:
    return [f.kind for f in findings]


def growing(start: int, per_step: int) -> Callable[[int, int], Memory]:
    return lambda r, s: (start + per_step * s, start + per_step * s, GIB)


@pytest.mark.parametrize(
    ("start", "per_step", "creeps"),
    [
        # 30 window steps: the line rises 29 steps' worth
        (GIB, 3 * MIB, False),  # +87 MiB: above 64 MiB, below 10 % of 1 GiB
        (GIB, 4 * MIB, True),  # +116 MiB: above both
        (100 * MIB, 2 * MIB, False),  # +58 MiB: above 10 % of 100 MiB, below 64 MiB
        (100 * MIB, 5 * MIB // 2, True),  # +72.5 MiB
        (20 * GIB, 70 * MIB, False),  # +1.98 GiB: below 10 % of 20 GiB
        (20 * GIB, 72 * MIB, True),  # +2.04 GiB
    ],
)
def test_device_creep_needs_max_of_64_mib_and_ten_percent(
    start: int, per_step: int, creeps: bool
) -> None:
    found = device_creep(memory_of(1, growing(start, per_step)))
    assert kinds(found) == (["MEMORY_CREEP"] if creeps else [])


def test_steady_growth_through_noise_is_creep_and_flat_noise_never() -> None:
    rng = random.Random(7)
    noisy = [rng.uniform(-60, 60) * MIB for _ in range(200)]
    rising = memory_of(2, lambda r, s: (None, None, GIB + 4 * MIB * s + int(noisy[s])),
                       num_steps=200, capacity=None)
    assert [(f.kind, f.ranks) for f in rss_creep(rising)] == [("RSS_CREEP", (0, 1))]
    for seed in range(20):
        noise = random.Random(seed).uniform
        flat = memory_of(8, lambda r, s, noise=noise: (None, None, GIB + int(noise(-300, 300) * MIB)),
                         num_steps=200, capacity=None)
        assert rss_creep(flat) == []


def test_one_jump_halfway_is_not_creep() -> None:
    jump = memory_of(1, lambda r, s: (None, None, GIB + (GIB if s >= 18 else 0)), capacity=None)
    assert rss_creep(jump) == []


def test_device_creep_names_the_leaking_rank_of_two() -> None:
    mem = memory_of(2, lambda r, s: (GIB + (50 * MIB * s if r == 1 else 0), 2 * GIB, GIB))
    found = device_creep(mem)
    assert [(f.label, f.severity, f.ranks) for f in found] == [("MEMORY CREEP", "warn", (1,))]
    assert found[0].why.startswith("r1 device peak allocated rose")
    assert found[0].evidence["growth_bytes"] == pytest.approx(29 * 50 * MIB)
    assert found[0].evidence["slope_bytes_per_step"] == pytest.approx(50 * MIB)


def test_rise_then_fall_is_not_creep() -> None:
    def shape(r: int, s: int) -> Memory:
        value = GIB + (GIB if 11 <= s <= 22 else 0)
        return (value, value, GIB)
    assert device_creep(memory_of(1, shape)) == []


def test_too_few_steps_give_no_creep_verdict() -> None:
    mem = memory_of(1, growing(GIB, 500 * MIB), num_steps=8)
    assert mem[0].allocated_thirds_bytes is None
    assert device_creep(mem) == []


def test_host_rss_creep_on_a_cpu_run() -> None:
    mem = memory_of(1, lambda r, s: (None, None, GIB + 40 * MIB * s), capacity=None)
    findings = diagnose_step_memory(mem)
    assert [(f.label, f.ranks) for f in findings] == [
        ("HOST RSS CREEP", (0,)), ("DEVICE MEMORY NOT MEASURED", ())]
    assert rss_creep(mem)[0].why.startswith("r0 host RSS rose")


@pytest.mark.parametrize(
    ("reserved_pct", "severity"), [(91.9, None), (92.0, "warn"), (96.9, "warn"), (97.0, "crit")]
)
def test_high_pressure_thresholds(reserved_pct: float, severity: str | None) -> None:
    reserved = int(CAPACITY * reserved_pct / 100) + 1
    found = high_pressure(memory_of(1, lambda r, s: (GIB, reserved, GIB)))
    assert [f.severity for f in found] == ([severity] if severity else [])
    if severity:
        assert found[0].ranks == (0,)
        assert f"({reserved_pct:.1f}%)" in found[0].why


def test_pressure_abstains_without_device_memory_or_capacity() -> None:
    cpu = memory_of(1, lambda r, s: (None, None, GIB), capacity=None)
    assert [f.label for f in high_pressure(cpu)] == ["DEVICE MEMORY NOT MEASURED"]
    no_capacity = memory_of(1, lambda r, s: (GIB, GIB, GIB), capacity=None)
    found = high_pressure(no_capacity)
    assert [(f.kind, f.label) for f in found] == [(NOT_MEASURED, "DEVICE CAPACITY NOT MEASURED")]


def test_imbalance_eight_ranks_names_the_heavy_rank() -> None:
    mem = memory_of(8, lambda r, s: (GIB, (60 if r == 3 else 40) * GIB, GIB))
    found = imbalance(mem)
    assert [(f.label, f.ranks) for f in found] == [("IMBALANCE", (3,))]
    assert found[0].evidence["skew_pct"] == pytest.approx(100 / 3)


def test_imbalance_needs_thirty_percent_pressure() -> None:
    mem = memory_of(8, lambda r, s: (GIB, (60 if r == 3 else 40) * GIB, GIB), capacity=400 * GIB)
    assert imbalance(mem) == []


def test_imbalance_needs_a_twenty_percent_skew_and_two_ranks() -> None:
    even = memory_of(2, lambda r, s: (GIB, (50 if r else 45) * GIB, GIB))
    assert imbalance(even) == []
    assert imbalance(memory_of(1, lambda r, s: (GIB, 60 * GIB, GIB))) == []


def test_balanced_and_diagnosis_order() -> None:
    findings = diagnose_step_memory(memory_of(2, lambda r, s: (4 * GIB, 5 * GIB, GIB)))
    assert kinds(findings) == ["BALANCED"]
    assert "worst peak reserved 5.0 GiB (6.2%) on r0, skew 0.0%" in findings[0].why
    # crit pressure comes before warn creep
    leak = memory_of(1, lambda r, s: (GIB + 100 * MIB * s, int(0.98 * CAPACITY), GIB))
    assert kinds(diagnose_step_memory(leak)) == ["HIGH_PRESSURE", "MEMORY_CREEP"]


def test_not_measured_when_nothing_was_recorded() -> None:
    assert [f.label for f in diagnose_step_memory({})] == ["STEP MEMORY NOT MEASURED"]
    blank = memory_of(1, lambda r, s: (None, None, None), capacity=None)
    assert [f.label for f in diagnose_step_memory(blank)] == ["STEP MEMORY NOT MEASURED"]
