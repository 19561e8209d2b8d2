"""final_summary.json: the report as JSON data, and its flat form for W&B/MLflow (offline analysis).

Runs in the offline-analysis process. :func:`report_to_json` follows SPEC
R-OUT-3 and docs/summary-schema.md; :func:`flatten_summary` turns such a
document (freshly built or read from a file) into ``{"traceml/...": value}``.

Times are ISO-8601 strings in UTC with milliseconds (``2026-01-31T12:00:00.000+00:00``).
"Not measured" is ``null``; a measured zero is ``0``; non-finite numbers
(an infinite ratio) are written as ``null`` because JSON has no infinity.
A rank row is written with every field of its dataclass plus every
property it defines (derived numbers such as ``pressure_pct``); a Step Time
row with one distribution and one share per part of the phase table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from datetime import datetime, timezone

from traceml.clocks import NodeClock
from traceml.diagnosis.ending import Ending
from traceml.diagnosis.ending_text import waiting
from traceml.diagnosis.finding import Finding
from traceml.diagnosis.operators import CaptureResult
from traceml.diagnosis.stats import MetricStat
from traceml.diagnosis.step_time import RankStepTimes
from traceml.records import Incident, Json, RunMeta
from traceml.report.model import Primary, RankRow, Report, Section

VERSION_KEYS = ("traceml", "torch", "python")
TRANSPORT_KEYS = ("sent", "dropped", "gaps", "rejected")


def report_to_json(report: Report) -> dict[str, Json]:
    """The whole final_summary.json document."""
    out: dict[str, Json] = {
        "schema_version": report.schema_version,
        "meta": meta_to_json(report.meta, report.duration_s),
        "primary": primary_to_json(report.primary),
    }
    for section in report.sections:
        out[section.name] = section_to_json(section)
    out["ending"] = ending_to_json(report.ending)
    out["captures"] = [capture_to_json(c) for c in report.captures]
    return out


def capture_to_json(c: CaptureResult) -> dict[str, Json]:
    """One profiler capture: who asked, which steps, the operators' difference per step."""
    def side(ms: float | None, calls: float | None, shapes: str | None) -> Json:
        if ms is None:
            return None
        return {"ms": ms, "calls": calls, "shapes": shapes}

    return {
        "id": c.capture_id, "trigger": c.trigger, "label": c.label, "phase": c.phase,
        "suspect": c.suspect, "reference": c.reference, "first_step": c.start_after,
        "steps_asked": c.steps_asked, "num_steps": c.num_steps, "device": c.device,
        "phase_ms": {"suspect": c.phase_ms[0], "reference": c.phase_ms[1]},
        "compute_diff_ms": c.compute_diff_ms, "communication_diff_ms": c.communication_diff_ms,
        "operators": [{"name": o.name, "part": o.part, "communication": o.communication,
                       "diff_ms": o.diff_ms,
                       "suspect": side(o.suspect_ms, o.suspect_calls, o.suspect_shapes),
                       "reference": side(o.reference_ms, o.reference_calls, o.reference_shapes)}
                      for o in c.operators],
        "traces": [{"rank": t.rank, "host": t.host, "path": t.path, "bytes": t.num_bytes}
                   for t in c.traces],
        "notes": list(c.notes),
    }


def ending_to_json(ending: Ending) -> dict[str, Json]:
    """The ``ending`` object: how the run ended, its findings and every stall and crash."""
    headline = ending.headline
    return {
        "state": ending.state,
        "headline": finding_to_json(headline) if headline is not None else None,
        "findings": [finding_to_json(f) for f in ending.findings],
        "culprits": list(ending.culprits),
        "incidents": [incident_to_json(i) for i in ending.incidents],
    }


def incident_to_json(i: Incident) -> dict[str, Json]:
    """One stall or crash, times as ISO strings, the stack outermost first."""
    return {
        "what": i.what, "rank": i.rank, "node_rank": i.node_rank, "host": i.host, "pid": i.pid,
        "began_at": iso_utc(i.began_at), "detected_at": iso_utc(i.detected_at),
        "cleared_at": iso_utc(i.cleared_at) if i.cleared_at is not None else None,
        "duration_s": (round(i.cleared_at - i.began_at, 3) if i.cleared_at is not None
                       else None),
        "step": i.step, "phase": i.phase, "open_phases": list(i.open_phases),
        "waiting_in_collective": waiting(i) if i.what == "stall" else False,
        "stack": [{"file": f.file, "line": f.line, "function": f.function, "user": f.user}
                  for f in i.stack],
        "stack_source": i.stack_source,
        "detail": dict(i.detail),
    }


def meta_to_json(meta: RunMeta, duration_s: float) -> dict[str, Json]:
    """The ``meta`` object: what ran, where, how it ended, and the transport's counts."""
    return {
        "session_id": meta.session_id,
        "command": list(meta.command),
        "started_at": iso_utc(meta.started_at),
        "ended_at": iso_utc(meta.ended_at),
        "duration_s": round(duration_s, 3),
        "exit_code": meta.exit_code,
        "partial": meta.partial,
        "missing_ranks": list(meta.missing_ranks),
        "world_size": meta.world_size,
        "nodes": [
            {"node_rank": n.node_rank, "host": n.host, "ranks": list(n.ranks),
             "clock": clock_to_json(n.clock)} for n in meta.nodes
        ],
        "device": meta.device,
        "mode": meta.mode,
        "versions": {key: meta.versions.get(key) for key in VERSION_KEYS},
        "transport": {key: meta.transport.get(key) for key in TRANSPORT_KEYS},
        "rejected": {reason: meta.rejected[reason] for reason in sorted(meta.rejected)},
        "telemetry_complete": meta.telemetry_complete,
        "exports": {name: dict(meta.exports[name]) for name in sorted(meta.exports)},
    }


def iso_utc(unix_s: float) -> str:
    """Unix seconds as an ISO-8601 UTC string with milliseconds."""
    return datetime.fromtimestamp(unix_s, tz=timezone.utc).isoformat(timespec="milliseconds")


def primary_to_json(primary: Primary) -> dict[str, Json]:
    """The verdict's finding, with the section it comes from."""
    return {"section": primary.section, **finding_to_json(primary.finding)}


def finding_to_json(finding: Finding) -> dict[str, Json]:
    """One finding: kind, label, severity, why, next, ranks, nodes and evidence numbers."""
    return {
        "kind": finding.kind,
        "label": finding.label,
        "severity": finding.severity,
        "why": finding.why,
        "next": finding.next,
        "ranks": list(finding.ranks),
        "nodes": list(finding.nodes),
        "evidence": {key: _number(value) for key, value in finding.evidence.items()},
    }


def clock_to_json(clock: NodeClock | None) -> Json:
    """A node's clock against the collector's node's (`traceml.clocks`); null: not
    measured."""
    if clock is None:
        return None
    return {"offset_ms": _number(clock.offset_ms), "uncertainty_ms": _number(clock.uncertainty_ms),
            "measured_at": None if clock.measured_at is None else iso_utc(clock.measured_at),
            "num_bursts": clock.num_bursts, "drift_ppm": _number(clock.drift_ppm)}


def section_to_json(section: Section) -> dict[str, Json]:
    """One section: diagnosis, findings, scope, stats and per-rank rows."""
    out: dict[str, Json] = {
        "diagnosis": finding_to_json(section.diagnosis),
        "findings": [finding_to_json(f) for f in section.findings],
        "scope": _plain(section.scope),
        "stats": {key: stat_to_json(stat) for key, stat in section.stats.items()},
        "ranks": [row_to_json(row) for row in section.ranks],
    }
    if section.job is not None:
        out["job"] = _plain(section.job)
    if section.name == "step_time":
        out["arrival"] = _plain(section.arrival)
    return out


def stat_to_json(stat: MetricStat | None) -> Json:
    """A metric's median and worst with their locations; null when not measured."""
    return None if stat is None else _plain(stat)


def row_to_json(row: RankRow) -> dict[str, Json]:
    """A rank row: its fields, then its derived properties; a row whose fields
    follow the phase table says how it is written (``json_fields``)."""
    if isinstance(row, RankStepTimes):
        return {key: _plain(value) for key, value in row.json_fields().items()}
    out = _plain(row)
    assert isinstance(out, dict)
    for name, attr in vars(type(row)).items():
        if isinstance(attr, property) and not name.startswith("_"):
            out[name] = _plain(getattr(row, name))
    return out


def _plain(value: object) -> Json:
    """Dataclasses, tuples and numbers as JSON data (non-finite floats as null)."""
    kind = type(value)
    if kind is float:  # the common cases first: a wide job writes millions of them
        return _number(value)  # type: ignore[arg-type]
    if value is None or kind in (bool, int, str):
        return value  # type: ignore[return-value]
    names = _FIELD_NAMES.get(kind)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, (bool, int, str)):
        return value
    raise TypeError(f"cannot write {type(value).__name__} to the summary")


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
"""A dataclass's field names, by class (dataclasses.fields is slow to ask each time)."""


def _number(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def flatten_summary(summary: Mapping[str, Json]) -> dict[str, float | str]:
    """``{"traceml/<section>/<metric>/median": 12.5, ...}`` for wandb.log / mlflow.

    Keys: ``traceml/schema_version``, ``traceml/meta/{duration_s,world_size,exit_code,
    partial,device,session_id}``, ``traceml/meta/transport/<count>``,
    ``traceml/primary/{section,label,severity}``, and per section
    ``traceml/<section>/{diagnosis,severity}`` and ``traceml/<section>/<stat>/{median,worst}``.
    Not-measured values are left out; booleans become 0.0/1.0.
    """
    flat: dict[str, float | str] = {}
    _put(flat, "traceml/schema_version", summary.get("schema_version"))
    meta = _obj(summary.get("meta"))
    for key in ("duration_s", "world_size", "exit_code", "partial", "device", "session_id"):
        _put(flat, f"traceml/meta/{key}", meta.get(key))
    for key, value in _obj(meta.get("transport")).items():
        _put(flat, f"traceml/meta/transport/{key}", value)
    primary = _obj(summary.get("primary"))
    for key in ("section", "label", "severity"):
        _put(flat, f"traceml/primary/{key}", primary.get(key))
    for name in ("step_time", "step_memory", "process", "system", "throughput"):
        section = _obj(summary.get(name))
        diagnosis = _obj(section.get("diagnosis"))
        _put(flat, f"traceml/{name}/diagnosis", diagnosis.get("label"))
        _put(flat, f"traceml/{name}/severity", diagnosis.get("severity"))
        for stat_name, stat in _obj(section.get("stats")).items():
            for part in ("median", "worst"):
                _put(flat, f"traceml/{name}/{stat_name}/{part}", _obj(stat).get(part))
        for key, value in _obj(section.get("job")).items():
            _put(flat, f"traceml/{name}/job/{key}", value)
    return flat


def _obj(value: Json | None) -> Mapping[str, Json]:
    return value if isinstance(value, dict) else {}


def _put(flat: dict[str, float | str], key: str, value: Json | None) -> None:
    if isinstance(value, (bool, int, float)):
        flat[key] = float(value)
    elif isinstance(value, str):
        flat[key] = value
