"""System rules on hand-built samples of 1 and 2 nodes."""

from __future__ import annotations

import pytest

from traceml.diagnosis.finding import NOT_MEASURED, Finding
from traceml.diagnosis.system import (
    NodeSystem,
    cpu_pressure,
    diagnose_system,
    high_gpu_temp,
    low_gpu_util,
    node_system,
    ram_pressure,
)
from traceml.records import GpuSample, SystemSample

RANKS = {0: (0, 1), 1: (2, 3)}


def gpu(index: int, util: float | None = 90.0, temp: float | None = 60.0) -> GpuSample:
    return GpuSample(index, util, 1, 2, temp, 250.0)


def nodes_of(*per_node: tuple[float, float, tuple[GpuSample, ...]]) -> dict[int, NodeSystem]:
    """(cpu %, ram %, gpus) per node, three identical samples each."""
    samples = [SystemSample(n, f"h{n}", float(t), cpu, ram, 1000, gpus)
               for n, (cpu, ram, gpus) in enumerate(per_node) for t in range(3)]
    return node_system(samples, RANKS)


def labels(findings: list[Finding] | tuple[Finding, ...]) -> list[str]:
    return [f.label for f in findings]


@pytest.mark.parametrize(("cpu", "flagged"), [(84.9, False), (85.0, True)])
def test_cpu_pressure_threshold(cpu: float, flagged: bool) -> None:
    assert labels(cpu_pressure(nodes_of((cpu, 10.0, ())))) == (["CPU PRESSURE"] if flagged else [])


def test_cpu_pressure_names_the_node_and_its_ranks() -> None:
    found = cpu_pressure(nodes_of((20.0, 10.0, ()), (97.0, 10.0, ())))
    assert [(f.nodes, f.ranks) for f in found] == [((1,), (2, 3))]
    assert found[0].why == "n1 (h1) host CPU averaged 97.0%."


@pytest.mark.parametrize(("ram", "severity"), [(84.0, None), (85.0, "warn"), (95.0, "crit")])
def test_ram_pressure_thresholds(ram: float, severity: str | None) -> None:
    found = ram_pressure(nodes_of((10.0, ram, ())))
    assert [f.severity for f in found] == ([severity] if severity else [])


@pytest.mark.parametrize(("util", "flagged"), [(29.9, True), (30.0, False)])
def test_low_gpu_util_threshold(util: float, flagged: bool) -> None:
    found = low_gpu_util(nodes_of((10.0, 10.0, (gpu(0, util),))))
    assert labels(found) == (["LOW GPU UTIL"] if flagged else [])


def test_low_gpu_util_names_the_gpu_and_counts() -> None:
    found = low_gpu_util(nodes_of((10.0, 10.0, (gpu(0), gpu(1))), (10.0, 10.0, (gpu(0, 12.0),))))
    assert [(f.nodes, f.ranks) for f in found] == [((1,), (2, 3))]
    assert found[0].why.startswith("n1 gpu0 utilization averaged 12.0% (1 of 3 GPUs below 30%)")


def test_gpu_rules_abstain_without_gpus_or_readings() -> None:
    no_gpus = nodes_of((10.0, 10.0, ()))
    assert labels(low_gpu_util(no_gpus)) == ["GPU UTIL NOT MEASURED"]
    assert labels(high_gpu_temp(no_gpus)) == ["GPU TEMP NOT MEASURED"]
    blind = nodes_of((10.0, 10.0, (gpu(0, None, None),)))
    assert [f.kind for f in low_gpu_util(blind) + high_gpu_temp(blind)] == [NOT_MEASURED] * 2


@pytest.mark.parametrize(("temp", "flagged"), [(84.9, False), (85.0, True)])
def test_high_gpu_temp_threshold(temp: float, flagged: bool) -> None:
    found = high_gpu_temp(nodes_of((10.0, 10.0, (gpu(0), gpu(1, temp=temp)))))
    assert labels(found) == (["HIGH GPU TEMP"] if flagged else [])
    if flagged:
        assert found[0].evidence["gpu"] == 1.0


def test_normal_and_abstentions_come_last() -> None:
    findings = diagnose_system(nodes_of((10.0, 10.0, ())))
    assert labels(findings) == ["NORMAL", "GPU TEMP NOT MEASURED", "GPU UTIL NOT MEASURED"]
    assert findings[0].why.startswith("CPU and RAM showed no system pressure")
    assert findings[0].why.endswith(" (no GPU was sampled).")
    assert labels(diagnose_system(nodes_of((10.0, 10.0, (gpu(0),))))) == ["NORMAL"]
    # A MIG slice: memory and temperature sampled, utilization never reported.
    mig = diagnose_system(nodes_of((10.0, 10.0, (gpu(0, util=None),))))
    assert mig[0].why.endswith(" (GPUs sampled, but none reported utilization)."), mig[0].why


def test_not_measured_without_samples() -> None:
    assert labels(diagnose_system({})) == ["SYSTEM NOT MEASURED"]


def test_node_summary_averages_and_peaks() -> None:
    samples = [SystemSample(0, "h0", float(t), cpu, ram, 1000, (gpu(0, util, temp),))
               for t, (cpu, ram, util, temp) in enumerate([(10.0, 20.0, 40.0, 50.0),
                                                           (30.0, 60.0, None, 70.0)])]
    node = node_system(samples, RANKS)[0]
    assert (node.cpu_avg_pct, node.ram_avg_pct, node.ram_peak_pct) == (20.0, 40.0, 60.0)
    assert (node.gpus[0].util_avg_pct, node.gpus[0].temp_peak_c) == (40.0, 70.0)
    assert node.ranks == (0, 1)
