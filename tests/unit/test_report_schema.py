"""The summary schema: the stdlib validator, agreement with JSON Schema, and the docs."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from traceml.records_json import from_jsonable
from traceml.report import build_report, report_to_json, validate_summary
from traceml.report.schema import SUMMARY_SCHEMA

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "tests" / "fixtures" / "scenarios"


def summary(name: str = "input_straggler_2r") -> dict[str, Any]:
    run = from_jsonable(json.loads((SCENARIOS / name / "run.json").read_text()))
    return report_to_json(build_report(run, 10_000))


def test_a_built_summary_is_valid() -> None:
    assert validate_summary(summary()) == []


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda d: d.pop("meta"), "$: missing key 'meta'"),
        (lambda d: d["meta"].update(world_size="2"), "$.meta.world_size: expected integer"),
        (lambda d: d["meta"].update(partial=1), "$.meta.partial: expected boolean"),
        (lambda d: d["meta"].update(exit_code=True), "$.meta.exit_code: expected integer or null"),
        (lambda d: d["primary"].update(severity="bad"), "$.primary.severity: 'bad' is not one"),
        (lambda d: d["step_time"].update(extra=1), "$.step_time: unexpected key 'extra'"),
        (lambda d: d["step_time"].update(findings=[]), "$.step_time.findings: fewer than 1"),
        (lambda d: d["step_time"]["stats"].update(total_ms={"median": 1}),
         "$.step_time.stats.total_ms: missing key 'worst'"),
        (lambda d: d["step_time"]["ranks"][0]["total_ms"].update(p50=None),
         "$.step_time.ranks[0].total_ms.p50: expected number"),
        (lambda d: d["step_memory"]["ranks"][0].update(allocated_thirds_bytes=[1, 2]),
         "$.step_memory.ranks[0].allocated_thirds_bytes: fewer than 3"),
        (lambda d: d["system"]["diagnosis"]["evidence"].update(x="1"),
         "$.system.diagnosis.evidence.x: expected number or null"),
    ],
)
def test_validator_reports_each_problem_with_its_path(
    mutate: Callable[[dict[str, Any]], object], problem: str
) -> None:
    doc = copy.deepcopy(summary())
    mutate(doc)
    problems = validate_summary(doc)
    assert any(p.startswith(problem) for p in problems), problems


def test_null_stats_are_allowed_where_not_measured() -> None:
    doc = summary("host_rss_creep")
    assert doc["step_memory"]["stats"]["peak_reserved_bytes"] is None
    assert validate_summary(doc) == []


@pytest.mark.parametrize("name", ["healthy", "host_rss_creep", "watch_mode", "cpu_pressure_2n"])
def test_schema_agrees_with_a_json_schema_implementation(name: str) -> None:
    jsonschema.Draft202012Validator.check_schema(SUMMARY_SCHEMA)
    validator = jsonschema.Draft202012Validator(SUMMARY_SCHEMA)
    doc = summary(name)
    assert list(validator.iter_errors(doc)) == []
    doc["meta"]["world_size"] = "2"
    assert list(validator.iter_errors(doc))
    assert validate_summary(doc)


def schema_keys(schema: Mapping[str, Any]) -> Iterator[str]:
    """Every property name the schema defines, however deep."""
    for key, value in schema.items():
        if key == "properties":
            yield from value
        if isinstance(value, Mapping):
            yield from schema_keys(value)


def test_docs_name_every_schema_key() -> None:
    doc = (ROOT / "docs" / "summary-schema.md").read_text()
    documented = set(re.findall(r"`([a-z0-9_]+)`", doc))
    assert set(schema_keys(SUMMARY_SCHEMA)) - documented == set()
