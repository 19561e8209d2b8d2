"""final_summary.json: R-OUT-3 keys, null vs 0, quantiles for compare, the flat W&B form."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.rows import step_row
from traceml.records import (
    NodeInfo,
    ProcessSample,
    RunData,
    RunMeta,
    SystemSample,
)
from traceml.report import build_report, flatten_summary, report_to_json, validate_summary
from traceml.report.model import SCHEMA_VERSION, Report
from traceml.report.schema import SECTION_STATS

GIB = 1024**3


def cpu_run(world: int = 2, wait_ms: float = 0.0) -> RunData:
    """A CPU-only DDP-like run: no device memory, no GPUs, wait measured as exactly 0."""
    meta = RunMeta(
        session_id="cpu-run", command=["train.py"], started_at=1_767_225_600.0,
        ended_at=1_767_225_661.25, exit_code=0, partial=False, world_size=world,
        missing_ranks=(), nodes=(NodeInfo(0, "box", tuple(range(world))),), device="cpu",
        versions={"traceml": "0.1.0", "torch": "2.5.1", "python": "3.11.7"},
        transport={"sent": 12, "dropped": 0, "gaps": 0, "rejected": 0},
    )
    steps = tuple(step_row(r, s, 1.0, 4.0, 8.0, 2.0, 15.0 + wait_ms, wait_ms, rss_bytes=GIB)
                  for r in range(world) for s in range(50))
    process = tuple(ProcessSample(r, 0, meta.started_at + t, 100.0, GIB, 64 * GIB, 8)
                    for r in range(world) for t in range(5))
    system = tuple(SystemSample(0, "box", meta.started_at + t, 30.0, 20.0, 64 * GIB)
                   for t in range(5))
    return RunData(meta, steps, process, system)


def as_json(report: Report) -> Any:
    """The summary as a reader of final_summary.json sees it (strict JSON, no NaN)."""
    return json.loads(json.dumps(report_to_json(report), allow_nan=False))


def test_top_level_and_meta_keys_follow_r_out_3() -> None:
    doc = as_json(build_report(cpu_run(), 10_000))
    assert list(doc) == ["schema_version", "meta", "primary", "step_time", "step_memory",
                         "process", "system", "throughput", "ending", "captures"]
    assert doc["schema_version"] == SCHEMA_VERSION
    meta = doc["meta"]
    assert meta["started_at"] == "2026-01-01T00:00:00.000+00:00"
    assert meta["ended_at"] == "2026-01-01T00:01:01.250+00:00"
    assert meta["duration_s"] == 61.25
    assert meta["nodes"] == [{"node_rank": 0, "host": "box", "ranks": [0, 1], "clock": None}]
    assert meta["versions"] == {"traceml": "0.1.0", "torch": "2.5.1", "python": "3.11.7"}
    assert meta["transport"] == {"sent": 12, "dropped": 0, "gaps": 0, "rejected": 0}
    assert (meta["partial"], meta["missing_ranks"], meta["device"]) == (False, [], "cpu")
    assert validate_summary(doc) == []


def test_each_section_has_diagnosis_findings_scope_stats_ranks() -> None:
    doc = as_json(build_report(cpu_run(), 10_000))
    for name, keys in SECTION_STATS.items():
        section = doc[name]
        job = ["job"] if name == "throughput" else ["arrival"] if name == "step_time" else []
        assert list(section) == ["diagnosis", "findings", "scope", "stats", "ranks", *job]
        assert section["diagnosis"] == section["findings"][0]
        assert list(section["stats"]) == list(keys)


def test_not_measured_is_null_and_measured_zero_is_zero() -> None:
    doc = as_json(build_report(cpu_run(wait_ms=0.0), 10_000))
    step_time, step_memory, system = doc["step_time"], doc["step_memory"], doc["system"]
    assert step_time["stats"]["wait_ms"]["median"] == 0.0
    assert step_memory["stats"]["peak_reserved_bytes"] is None
    assert system["stats"]["gpu_util_avg_pct"] is None
    row = step_memory["ranks"][0]
    assert (row["peak_allocated_bytes"], row["rss_peak_bytes"]) == (None, GIB)


def test_step_time_keeps_per_rank_quantiles_for_compare() -> None:
    doc = as_json(build_report(cpu_run(), 10_000))
    rows = doc["step_time"]["ranks"]
    assert [r["rank"] for r in rows] == [0, 1]
    for phase in ("total", "input", "forward", "backward", "optimizer", "compute", "wait"):
        dist = rows[0][f"{phase}_ms"]
        assert list(dist) == ["count", "mean", "p10", "p25", "p50", "p75", "p90"]
        assert dist["count"] == 45  # 50 steps, 5 warm-up
    assert rows[0]["total_ms"]["p50"] == 15.0
    scope = doc["step_time"]["scope"]
    assert (scope["num_steps"], scope["num_warmup_steps"], scope["ranks"]) == (45, 5, [0, 1])


def test_findings_carry_kind_label_severity_why_next_ranks_evidence() -> None:
    doc = as_json(build_report(cpu_run(wait_ms=5.0), 10_000))
    finding = doc["step_time"]["diagnosis"]
    assert list(finding) == ["kind", "label", "severity", "why", "next", "ranks", "nodes",
                             "evidence"]
    assert (finding["kind"], finding["severity"], finding["ranks"]) == ("WAIT_HEAVY", "crit", [0, 1])
    assert finding["evidence"]["wait_share_pct"] == pytest.approx(25.0)
    assert doc["primary"]["section"] == "step_time"


def test_infinite_ratio_is_written_as_null() -> None:
    run = cpu_run(world=1)
    process = tuple(ProcessSample(0, 0, s.t, 50.0, GIB, 64 * GIB, 8, 0, 40 * GIB, 80 * GIB)
                    for s in run.process)
    doc = as_json(build_report(RunData(run.meta, run.steps, process, run.system), 10))
    row = doc["process"]["ranks"][0]
    assert row["reserved_ratio"] is None
    finding = doc["process"]["diagnosis"]
    assert finding["label"] == "GPU MEMORY RESERVED OVERHANG"
    assert finding["evidence"]["reserved_ratio"] is None
    assert finding["why"].endswith("against a peak allocated of 0 B.")
    assert validate_summary(doc) == []


def test_flatten_summary_for_wandb() -> None:
    flat = flatten_summary(as_json(build_report(cpu_run(), 10_000)))
    assert all(k.startswith("traceml/") for k in flat)
    assert all(isinstance(v, (float, str)) for v in flat.values())
    assert flat["traceml/primary/label"] == "COMPUTE-BOUND"
    assert flat["traceml/step_time/diagnosis"] == "COMPUTE-BOUND"
    assert flat["traceml/step_time/total_ms/median"] == 15.0
    assert flat["traceml/meta/partial"] == 0.0
    assert flat["traceml/meta/transport/sent"] == 12.0
    assert "traceml/step_memory/peak_reserved_bytes/median" not in flat  # not measured
    assert flatten_summary({}) == {}
