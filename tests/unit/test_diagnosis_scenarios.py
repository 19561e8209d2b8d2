"""Recorded scenarios replayed through build_report and checked against expected.json.

Each folder of tests/fixtures/scenarios holds run.json (stored telemetry) and
expected.json (what a person expects: labels, severities, ranks, nodes, plus
labels that must or must not appear among a section's findings).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from traceml.records_json import from_jsonable
from traceml.report import build_report, report_to_json, validate_summary
from traceml.report.model import Report

SCENARIOS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"
FOLDERS = sorted(p for p in SCENARIOS.iterdir() if (p / "run.json").is_file())
REQUIRED = {
    "healthy", "input_bound", "input_straggler_2r", "compute_straggler_8r", "host_rss_creep",
    "gpu_high_pressure", "gpu_memory_creep", "gpu_imbalance", "gpu_reserved_overhang",
    "low_gpu_util", "high_gpu_temp",
}


def replay(folder: Path) -> Report:
    run = from_jsonable(json.loads((folder / "run.json").read_text()))
    return build_report(run, summary_window_rows=10_000)


def test_every_required_scenario_is_recorded() -> None:
    assert REQUIRED <= {p.name for p in FOLDERS}


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_scenario_matches_expected(folder: Path) -> None:
    expected = json.loads((folder / "expected.json").read_text())
    report = replay(folder)
    primary = expected["primary"]
    assert report.primary.section == primary["section"]
    assert report.primary.finding.label == primary["label"]
    if "ranks" in primary:
        assert list(report.primary.finding.ranks) == primary["ranks"]
    for name, want in expected["sections"].items():
        section = report.section(name)
        labels = [f.label for f in section.findings]
        kinds = [f.kind for f in section.findings]
        assert section.diagnosis.label == want["diagnosis"], labels
        for key in ("severity", "ranks", "nodes"):
            if key in want:
                got = getattr(section.diagnosis, key)
                assert (list(got) if isinstance(got, tuple) else got) == want[key], key
        if "missing_ranks" in want:
            assert list(section.scope.missing_ranks) == want["missing_ranks"]
        assert set(want.get("present", ())) <= set(labels)
        assert not set(want.get("absent", ())) & set(kinds)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_scenario_summary_is_valid_and_small(folder: Path) -> None:
    doc = report_to_json(replay(folder))
    assert validate_summary(doc) == []
    json.dumps(doc, allow_nan=False)
    assert (folder / "run.json").stat().st_size < 100_000
