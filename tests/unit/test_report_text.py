"""The text card: the whole string for one fixed run, and the box on every scenario."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rows import step_row
from traceml.records import FlopCount, GpuSample, NodeInfo, ProcessSample, RunData, RunMeta, SystemSample
from traceml.records_json import from_jsonable
from traceml.report import build_report, render_text, report_to_json, validate_summary

GIB = 1024**3
SCENARIOS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"


def fixed_run() -> RunData:
    """3 ranks launched, r2 never reported (partial); r1's loader is slow and r0 waits
    for it inside backward; GPU 0 is mostly idle. Each step takes 64 sequences of 512
    token ids and 1.5e13 FLOPs (bf16 on H100s), counted in step 10."""
    meta = RunMeta(
        session_id="demo", command=["train.py"], started_at=1_767_225_600.0,
        ended_at=1_767_225_722.5, exit_code=1, partial=True, world_size=3, missing_ranks=(2,),
        nodes=(NodeInfo(0, "gpu-box", (0, 1, 2)),), device="cuda",
        versions={"traceml": "0.1.0", "torch": "2.5.1", "python": "3.11.7"},
        transport={"sent": 300, "dropped": 2, "gaps": 0, "rejected": 0},
    )
    phases = {0: (4.0, 30.0, 56.0, 10.0), 1: (40.0, 30.0, 20.0, 10.0)}
    # GPU times on a sample of steps: every 4th on r0 (4 in the window), every 5th on r1 (3)
    gpu = {0: (4, 90.0), 1: (5, 55.0)}
    steps = tuple(step_row(r, s, *phases[r], 100.0, 0.0, 4 * GIB, 5 * GIB, 2 * GIB,
                           gpu_ms=gpu[r][1] if s % gpu[r][0] == 0 else None,
                           samples=64, tokens=64 * 512, flops=1.5e13 if s >= 10 else None,
                           flops_counted=s == 10)
                  for r in (0, 1) for s in range(20))
    counts = tuple(FlopCount(meta.started_at + 10, 1.5e13, "bf16", 0.98,
                             "NVIDIA H100 80GB HBM3", 132, None, rank=r) for r in (0, 1))
    process = tuple(ProcessSample(r, 0, meta.started_at + t, 100.0, 2 * GIB, 256 * GIB, 32,
                                  4 * GIB, 5 * GIB, 80 * GIB) for r in (0, 1) for t in range(3))
    gpus = (GpuSample(0, 20.0, 5 * GIB, 80 * GIB, 55.0, 200.0),
            GpuSample(1, 60.0, 5 * GIB, 80 * GIB, 57.0, 210.0))
    system = tuple(SystemSample(0, "gpu-box", meta.started_at + t, 25.0, 30.0, 256 * GIB, gpus)
                   for t in range(3))
    return RunData(meta, steps, process, system, counts)


EXPECTED = """\
+----------------------------------------------------------------------------+
|  TraceML Run Summary | duration 122.5s | PARTIAL                           |
+----------------------------------------------------------------------------+
|                                                                            |
|  Verdict: INPUT STRAGGLER [crit] (Step Time, r1)                           |
|  Next: Check r1's data path: its shard size, DataLoader num_workers, and   |
|    storage or preprocessing load on its node; every rank should load       |
|    alike.                                                                  |
|  Run: 3 ranks on 1 node | cuda | exit 1 | session demo                     |
|  PARTIAL: the run ended before every rank finished; missing ranks r2.      |
|  Telemetry: 2 messages dropped, 0 sequence gaps; some samples are          |
|    missing.                                                                |
|                                                                            |
|  System                                                                    |
|  - Diagnosis: LOW GPU UTIL [warn]                                          |
|  - Scope: nodes 1/1 | samples 3                                            |
|  - Stats: CPU med/worst 25.0%/25.0% n0 | RAM peak med/worst 30.0%/30.0%    |
|    n0 | GPU util med/worst 40.0%/20.0% n0 gpu0 | GPU temp med/worst        |
|    56.0C/57.0C n0 gpu1                                                     |
|  - Why: n0 gpu0 utilization averaged 20.0% (1 of 2 GPUs below 30%).        |
|  - Next: The GPUs idle much of the time: see Step Time for input or wait,  |
|    raise the batch size or DataLoader workers.                             |
|                                                                            |
|  Process                                                                   |
|  - Diagnosis: NORMAL                                                       |
|  - Scope: ranks 2/3 | samples 6 | missing r2                               |
|  - Stats: CPU avg med/worst 100.0%/100.0% r0 | RSS peak med/worst 2.0/2.0  |
|    GiB r0 | GPU reserved med/worst 6.2%/6.2% r0                            |
|  - Why: CPU, RSS and device memory looked normal: CPU avg worst 100%       |
|    (r0), RSS peak 2.0 GiB (r0), device memory reserved peak 5.0 GiB (r0).  |
|                                                                            |
|  Step Time                                                                 |
|  - Diagnosis: INPUT STRAGGLER [crit]                                       |
|  - Scope: last 17 aligned steps across 2 ranks, 2 warm-up steps left out,  |
|    1 FLOP-counting step left out | missing r2 | steps: optimizer           |
|  - Typical step, ms (a rank's mean step without outlier steps;             |
|    median/worst rank) | total 100.0/100.0 | input 22.0/40.0 | compute      |
|    78.0/96.0 | wait 0.0/0.0                                                |
|  - Most time, by part: input r1, compute r0; alike: total, wait            |
|  - Input: DataLoader fetches and host-to-device copies                     |
|  - GPU time: median/worst 72.5/90.0ms r0 (forward+backward+optimizer),     |
|    from 2-4 of 17 steps (those timed)                                      |
|  - Why: r1 input was 40.0 ms vs 4.0 ms on the other ranks (+36.0 ms,       |
|    36.0% of the 100.0 ms typical step; slower in 100% of the steps).       |
|  - Next: Check r1's data path: its shard size, DataLoader num_workers,     |
|    and storage or preprocessing load on its node; every rank should load   |
|    alike.                                                                  |
|  - Also: INPUT-BOUND [crit]: Input (data loading) took 22.0% of step time  |
|    (22.0 of 100.0 ms, the median of r0 4.0 and r1 40.0 ms).                |
|  - Not measured: COMMUNICATION                                             |
|                                                                            |
|  Throughput                                                                |
|  - Diagnosis: LOW MFU [warn]                                               |
|  - Scope: last 17 aligned steps across 2 ranks, 2 warm-up steps left out,  |
|    1 FLOP-counting step left out | missing r2                              |
|  - Job: 1,280 samples/s | 655,360 tokens/s | 300 TFLOP/s | MFU 15.2%       |
|  - Per rank: median/lowest | samples/s 640/640 r0 | tokens/s               |
|    327,680/327,680 r0 | TFLOP/s 150/150 r0 | MFU 15.2%/15.2% r0            |
|  - Peak: H100 SXM dense bf16 989.4 TFLOP/s (NVIDIA H100 Tensor Core GPU    |
|    datasheet (2023))                                                       |
|  - FLOPs: torch.utils.flop_counter.FlopCounterMode over one training step  |
|    per batch shape (2 counts over all ranks, 98% of them in bf16), for 18  |
|    of the window's 34 rank-steps; counted steps are left out of the        |
|    window                                                                  |
|  - Why: MFU was 15.2%: 150 TFLOP/s achieved per rank against a 989.4       |
|    TFLOP/s peak (H100 SXM bf16), below 20%.                                |
|  - Next: The GPUs wait for data first (see INPUT-BOUND): fix the input     |
|    pipeline before tuning kernels; MFU rises with it.                      |
|                                                                            |
|  Step Memory                                                               |
|  - Diagnosis: BALANCED                                                     |
|  - Scope: last 17 aligned steps across 2 ranks, 2 warm-up steps left out,  |
|    1 FLOP-counting step left out | missing r2                              |
|  - Stats: peak reserved med/worst 5.0/5.0 GiB r0 | pressure med/worst      |
|    6.2%/6.2% r0 | RSS peak med/worst 2.0/2.0 GiB r0                        |
|  - Why: No pressure, imbalance or creep: worst peak reserved 5.0 GiB       |
|    (6.2%) on r0, skew 0.0%.                                                |
+----------------------------------------------------------------------------+
"""


def test_text_card_exact() -> None:
    report = build_report(fixed_run(), summary_window_rows=10_000)
    assert validate_summary(report_to_json(report)) == []
    assert render_text(report) == EXPECTED


def test_window_rows_limit_shows_in_scope() -> None:
    text = render_text(build_report(fixed_run(), summary_window_rows=5))
    assert "- Scope: last 5 aligned steps across 2 ranks, 2 warm-up steps left out" in text


@pytest.mark.parametrize("width", [60, 78, 100])
@pytest.mark.parametrize("folder", sorted(p for p in SCENARIOS.iterdir() if p.is_dir()),
                         ids=lambda p: p.name)
def test_every_line_fits_the_box(folder: Path, width: int) -> None:
    run = from_jsonable(json.loads((folder / "run.json").read_text()))
    report = build_report(run, 10_000)
    lines = render_text(report, width=width).splitlines()
    assert all(len(line) == width for line in lines)
    assert all(line[0] in "|+" and line[-1] in "|+" for line in lines)
    for title in ("System", "Process", "Step Time", "Step Memory"):
        assert any(line.startswith(f"|  {title}  ") for line in lines)
    assert validate_summary(report_to_json(report)) == []


def test_most_time_names_a_rank_only_where_it_stands_out() -> None:
    from traceml import phases
    from traceml.diagnosis.stats import MetricStat
    from traceml.report.text import _most_time

    def stat(median: float, worst: float, rank: int) -> MetricStat:
        return MetricStat(median, worst, median_rank=0, worst_rank=rank)
    total, inp, comm = phases.TOTAL, phases.PHASES[0], phases.PHASES[4]
    assert _most_time([(total, stat(44.7, 44.7, 1)), (inp, stat(0.5, 0.52, 0))]) == (
        "- Most time, by part: every part alike across ranks")
    assert _most_time([(total, stat(65.4, 65.4, 1)), (inp, stat(10.7, 20.9, 1)),
                       (comm, stat(12.0, 22.2, 0))]) == (
        "- Most time, by part: input r1, communication r0; alike: total")
