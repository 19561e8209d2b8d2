"""Process rules on hand-built samples of 1, 2 and 8 ranks."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from traceml.diagnosis.finding import Finding
from traceml.diagnosis.process import (
    diagnose_process,
    high_cpu,
    high_rss,
    rank_process,
    reserved_overhang,
)
from traceml.records import ProcessSample

GIB = 1024**3
HOST_RAM = 100 * GIB
DEVICE = 80 * GIB


def samples(world: int, *, cpu_pct: float = 100.0, rss: int = 2 * GIB, num_cpus: int = 16,
            device: tuple[int, int] | None = None, num_nodes: int = 1,
            hot_rank: int = 0, hot: Mapping[str, float] | None = None) -> list[ProcessSample]:
    """Four samples per rank; ``hot_rank`` gets the ``hot`` cpu_pct/rss overrides."""
    out = []
    for rank in range(world):
        values: dict[str, float] = {"cpu_pct": cpu_pct, "rss": rss}
        if rank == hot_rank and hot:
            values.update(hot)
        alloc, reserved = device if device else (None, None)
        out += [ProcessSample(rank, rank * num_nodes // world, float(t), float(values["cpu_pct"]),
                              int(values["rss"]), HOST_RAM, num_cpus, alloc, reserved,
                              DEVICE if device else None)
                for t in range(4)]
    return out


def labels(findings: list[Finding] | tuple[Finding, ...]) -> list[str]:
    return [f.label for f in findings]


@pytest.mark.parametrize(
    ("alloc_gib", "reserved_gib", "flagged"),
    [(20, 30, True), (20, 29.5, False), (16, 24.5, True), (16, 23.8, False), (0, 40, True)],
)
def test_reserved_overhang_needs_ratio_and_share(alloc_gib: float, reserved_gib: float,
                                                 flagged: bool) -> None:
    # 30 % of 80 GiB is 24 GiB; ratio 1.5 of 16 GiB is 24 GiB.
    procs = rank_process(samples(1, device=(int(alloc_gib * GIB), int(reserved_gib * GIB))))
    found = reserved_overhang(procs)
    assert labels(found) == (["GPU MEMORY RESERVED OVERHANG"] if flagged else [])


def test_reserved_overhang_ratio_is_in_why_and_evidence() -> None:
    found = reserved_overhang(rank_process(samples(2, device=(20 * GIB, 34 * GIB))))
    assert found[0].ranks == (0, 1)
    assert found[0].why == ("r0 reserved 34.0 GiB (42.5% of the device) against a peak "
                            "allocated of 20.0 GiB (1.70x).")
    assert found[0].evidence["reserved_ratio"] == pytest.approx(1.7)


def test_reserved_overhang_abstains_on_cpu() -> None:
    assert labels(reserved_overhang(rank_process(samples(1)))) == ["GPU MEMORY NOT MEASURED"]


@pytest.mark.parametrize(("rss_pct", "severity"), [(79.9, None), (80.0, "warn"), (95.0, "crit")])
def test_high_rss_thresholds_eight_ranks(rss_pct: float, severity: str | None) -> None:
    procs = rank_process(samples(8, hot_rank=6, hot={"rss": int(HOST_RAM * rss_pct / 100) + 1}))
    found = high_rss(procs)
    assert [(f.severity, f.ranks) for f in found] == ([(severity, (6,))] if severity else [])


@pytest.mark.parametrize(
    ("world", "cpu_pct", "flagged"),
    [(1, 1520.0, True), (1, 1500.0, False), (8, 190.0, True), (8, 180.0, False)],
)
def test_high_cpu_is_relative_to_the_cores_per_rank(world: int, cpu_pct: float,
                                                    flagged: bool) -> None:
    # 16 CPUs: one rank owns 16 cores (flag at >= 1520 %), eight ranks own 2 each (>= 190 %).
    found = high_cpu(rank_process(samples(world, cpu_pct=50.0, hot={"cpu_pct": cpu_pct})))
    assert [f.ranks for f in found] == ([(0,)] if flagged else [])


def test_high_cpu_counts_ranks_per_node() -> None:
    # 8 ranks on 2 nodes of 16 CPUs: 4 ranks a node, 4 cores a rank (flag at >= 380 %).
    procs = rank_process(samples(8, num_nodes=2, hot_rank=5, cpu_pct=50.0, hot={"cpu_pct": 390.0}))
    assert procs[5].num_node_ranks == 4
    assert [f.ranks for f in high_cpu(procs)] == [(5,)]


def test_normal_and_not_measured() -> None:
    findings = diagnose_process(rank_process(samples(2, device=(GIB, 2 * GIB))))
    assert labels(findings) == ["NORMAL"]
    assert findings[0].why.startswith("CPU, RSS and device memory looked normal")
    assert findings[0].why.endswith(", device memory reserved peak 2.0 GiB (r0).")
    assert labels(diagnose_process({})) == ["PROCESS NOT MEASURED"]


@pytest.mark.parametrize("world", [1, 8])
def test_normal_says_only_what_was_measured(world: int) -> None:
    # No device memory sampled (a CPU job): the card must not call it normal.
    found = diagnose_process(rank_process(samples(world)))[0]
    assert found.why.startswith("CPU and RSS looked normal: "), found.why
    assert "device" not in found.why


def test_crit_rss_comes_before_warn_cpu() -> None:
    procs = rank_process(samples(1, hot={"cpu_pct": 1600.0, "rss": 99 * GIB}))
    assert labels(diagnose_process(procs))[:2] == ["HIGH RSS", "HIGH CPU"]
