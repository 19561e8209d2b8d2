"""The compare report as JSON data, written to BASE.json (offline analysis).

Runs in the offline-analysis process. The document is described in
docs/compare.md. "Not measured" or "not comparable" is ``null``; non-finite
numbers are written as ``null``. Deltas are B - A.
"""

from __future__ import annotations

import math

from traceml.compare.model import (
    COMPARE_VERSION,
    CaptureCompare,
    Comparison,
    MemoryChange,
    MetricRow,
    RunInfo,
    SectionCompare,
    TimeChange,
)
from traceml.records import Json


def comparison_to_json(comparison: Comparison) -> dict[str, Json]:
    """The whole compare document."""
    return {
        "compare_version": COMPARE_VERSION,
        "verdict": comparison.verdict.label,
        "why": comparison.verdict.why,
        "threshold_pct": comparison.threshold_pct,
        "a": run_to_json(comparison.a),
        "b": run_to_json(comparison.b),
        "notes": list(comparison.notes),
        "step_time": time_to_json(comparison.time),
        "memory": memory_to_json(comparison.memory),
        "sections": {s.name: section_to_json(s) for s in comparison.sections},
        "captures": None if comparison.captures is None else captures_to_json(comparison.captures),
    }


def captures_to_json(c: CaptureCompare) -> dict[str, Json]:
    """B's profiler capture against A's: each operator's ms per step on each side."""
    return {"a": c.a_id, "b": c.b_id, "a_label": c.a_label, "b_label": c.b_label,
            "operators": [{"name": o.name, "communication": o.communication,
                           "a_ms": _num(o.a_ms), "b_ms": _num(o.b_ms),
                           "delta_ms": _num(o.delta_ms), "a_shapes": o.a_shapes,
                           "b_shapes": o.b_shapes} for o in c.operators]}


def run_to_json(run: RunInfo) -> dict[str, Json]:
    """One side: label, summary path, session, schema version, topology."""
    return {
        "label": run.label,
        "path": run.path,
        "session_id": run.session_id,
        "schema_version": run.schema_version,
        "world_size": run.world_size,
        "device": run.device,
        "partial": run.partial,
    }


def time_to_json(time: TimeChange) -> dict[str, Json]:
    """The step-time signal and the gates it passed or not."""
    return {
        "direction": time.direction,
        "a_ms": _num(time.a_ms),
        "b_ms": _num(time.b_ms),
        "delta_ms": _num(time.delta_ms),
        "delta_pct": _num(time.delta_pct),
        "a_p50_ms": _num(time.a_p50_ms),
        "b_p50_ms": _num(time.b_p50_ms),
        "threshold_ms": _num(time.threshold_ms),
        "noise_ms": _num(time.noise_ms),
        "median_moved": time.median_moved,
        "phase": time.phase,
        "phase_delta_ms": _num(time.phase_delta_ms),
        "why": time.why,
    }


def memory_to_json(memory: MemoryChange) -> dict[str, Json]:
    """The memory signal: which peak decided, and how it moved."""
    return {
        "direction": memory.direction,
        "metric": memory.metric,
        "label": memory.label,
        "a_bytes": _num(memory.a_bytes),
        "b_bytes": _num(memory.b_bytes),
        "why": memory.why,
    }


def section_to_json(section: SectionCompare) -> dict[str, Json]:
    """One section: status, diagnosis on both sides, and its metric rows."""
    return {
        "title": section.title,
        "status": "inconclusive" if section.inconclusive else "compared",
        "inconclusive_why": section.inconclusive_why,
        "diagnosis": {"a": section.diagnosis.a, "b": section.diagnosis.b,
                      "changed": section.diagnosis.changed},
        "metrics": [row_to_json(row) for row in section.rows],
    }


def row_to_json(row: MetricRow) -> dict[str, Json]:
    """One metric: key, label, A, B, delta and % of A."""
    return {
        "key": row.key,
        "label": row.label,
        "a": _num(row.a),
        "b": _num(row.b),
        "delta": _num(row.delta),
        "delta_pct": _num(row.delta_pct),
    }


def _num(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
