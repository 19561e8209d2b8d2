"""The JSON schema of final_summary.json and a small stdlib validator (offline analysis).

Runs in the offline-analysis process (and in tests, which validate every
summary they build). :data:`SUMMARY_SCHEMA` is standard JSON Schema
(draft 2020-12) using only the keywords :func:`validate` implements: type,
enum, properties, required, additionalProperties, items, minItems, maxItems
and local ``$ref``. docs/summary-schema.md documents every key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from traceml import phases, step_fields
from traceml.diagnosis.ending import STATES as ENDING_STATES
from traceml.report.model import SCHEMA_VERSION

Schema = Mapping[str, Any]

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_STR = {"type": "string"}
_INT_OR_NULL = {"type": ["integer", "null"]}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INTS = {"type": "array", "items": _INT}
_DIST = {"$ref": "#/$defs/distribution"}
_DIST_OR_NULL = {"$ref": "#/$defs/distribution_or_null"}
_STAT = {"$ref": "#/$defs/stat"}


def _obj(props: Mapping[str, Schema], nullable: bool = False) -> dict[str, Any]:
    """A closed object: every listed key required, no other key allowed."""
    return {
        "type": ["object", "null"] if nullable else "object",
        "properties": dict(props),
        "required": list(props),
        "additionalProperties": False,
    }


_DIST_PROPS: dict[str, Schema] = {
    "count": _INT, "mean": _NUM, "p10": _NUM, "p25": _NUM, "p50": _NUM, "p75": _NUM, "p90": _NUM,
}

_FINDING_PROPS: dict[str, Schema] = {
    "kind": _STR,
    "label": _STR,
    "severity": {"type": "string", "enum": ["info", "warn", "crit"]},
    "why": _STR,
    "next": _STR,
    "ranks": _INTS,
    "nodes": _INTS,
    "evidence": {"type": "object", "additionalProperties": _NUM_OR_NULL},
}

_META = _obj({
    "session_id": _STR,
    "command": {"type": "array", "items": _STR},
    "started_at": _STR,
    "ended_at": _STR,
    "duration_s": _NUM,
    "exit_code": _INT_OR_NULL,
    "partial": {"type": "boolean"},
    "missing_ranks": _INTS,
    "world_size": _INT,
    "nodes": {"type": "array", "items": _obj({
        "node_rank": _INT, "host": _STR, "ranks": _INTS,
        "clock": _obj({"offset_ms": _NUM, "uncertainty_ms": _NUM,
                       "measured_at": {"type": ["string", "null"]}, "num_bursts": _INT,
                       "drift_ppm": _NUM_OR_NULL}, nullable=True)})},
    "device": {"type": "string", "enum": ["cpu", "cuda"]},
    "mode": {"type": "string", "enum": ["run", "watch"]},
    "versions": _obj({k: {"type": ["string", "null"]} for k in ("traceml", "torch", "python")}),
    "transport": _obj({k: _INT_OR_NULL for k in ("sent", "dropped", "gaps", "rejected")}),
    "rejected": {"type": "object", "additionalProperties": _INT},
    "telemetry_complete": {"type": "boolean"},
    "exports": {"type": "object", "additionalProperties": _obj({
        "endpoint": _STR, "sent": _INT, "failed": _INT, "error": {"type": ["string", "null"]}})},
})

_SCOPE = _obj({
    "window_rows": _INT,
    "ranks": _INTS,
    "missing_ranks": _INTS,
    "nodes": _INTS,
    "num_nodes": _INT,
    "num_steps": _INT_OR_NULL,
    "num_warmup_steps": _INT_OR_NULL,
    "first_step": _INT_OR_NULL,
    "last_step": _INT_OR_NULL,
    "num_samples": _INT_OR_NULL,
    "num_counted_steps": _INT_OR_NULL,
    "num_captured_steps": _INT_OR_NULL,
    "step_boundary": {"type": ["string", "null"], "enum": [*phases.STEP_BOUNDARIES, None]},
    "input_source": {"type": ["string", "null"],
                     "enum": ["dataloader", "before_forward", "copies", None]},
})

_THIRDS = {"type": ["array", "null"], "items": _NUM, "minItems": 3, "maxItems": 3}
_TREND = _obj({"start": _NUM, "slope_per_step": _NUM, "r2": _NUM, "num_steps": _INT},
              nullable=True)

_STEP_TIME_ROW = _obj({
    "rank": _INT,
    "node_rank": _INT_OR_NULL,
    "num_steps": _INT,
    "num_outlier_steps": _INT,
    "outlier_total_ms": _NUM,
    **{p.column: _DIST for p in phases.step_metrics()},
    **{f.name: _DIST_OR_NULL for f in step_fields.reported()},
    **{f"{p.name}_share_pct": _NUM_OR_NULL for p in phases.share_metrics()},
    "gpu_ms": _DIST_OR_NULL,
    "num_gpu_timed_steps": _INT_OR_NULL,
})

_STEP_MEMORY_ROW = _obj({
    "rank": _INT,
    "node_rank": _INT_OR_NULL,
    "num_steps": _INT,
    "peak_allocated_bytes": _INT_OR_NULL,
    "peak_reserved_bytes": _INT_OR_NULL,
    "rss_peak_bytes": _INT_OR_NULL,
    "device_total_bytes": _INT_OR_NULL,
    "allocated_thirds_bytes": _THIRDS,
    "rss_thirds_bytes": _THIRDS,
    "allocated_trend": _TREND,
    "rss_trend": _TREND,
    "pressure_pct": _NUM_OR_NULL,
    "allocated_growth_bytes": _NUM_OR_NULL,
    "rss_growth_bytes": _NUM_OR_NULL,
})

_PROCESS_ROW = _obj({
    "rank": _INT,
    "node_rank": _INT,
    "num_samples": _INT,
    "cpu_avg_pct": _NUM,
    "cpu_peak_pct": _NUM,
    "num_cpus": _INT,
    "num_node_ranks": _INT,
    "rss_peak_bytes": _INT,
    "host_ram_total_bytes": _INT,
    "device_allocated_peak_bytes": _INT_OR_NULL,
    "device_reserved_peak_bytes": _INT_OR_NULL,
    "device_total_bytes": _INT_OR_NULL,
    "cpu_share_pct": _NUM_OR_NULL,
    "rss_pct": _NUM_OR_NULL,
    "reserved_pct": _NUM_OR_NULL,
    "reserved_ratio": _NUM_OR_NULL,
})

_GPU_ROW = _obj({
    "node_rank": _INT,
    "index": _INT,
    "num_samples": _INT,
    "util_avg_pct": _NUM_OR_NULL,
    "temp_peak_c": _NUM_OR_NULL,
    "mem_used_peak_bytes": _INT_OR_NULL,
    "mem_total_bytes": _INT_OR_NULL,
    "power_avg_w": _NUM_OR_NULL,
})

_SYSTEM_ROW = _obj({
    "node_rank": _INT,
    "host": _STR,
    "ranks": _INTS,
    "num_samples": _INT,
    "cpu_avg_pct": _NUM,
    "cpu_peak_pct": _NUM,
    "ram_avg_pct": _NUM,
    "ram_peak_pct": _NUM,
    "ram_total_bytes": _INT,
    "gpus": {"type": "array", "items": _GPU_ROW},
})

_STR_OR_NULL = {"type": ["string", "null"]}

_THROUGHPUT_ROW = _obj({
    "rank": _INT,
    "node_rank": _INT_OR_NULL,
    "num_steps": _INT,
    **{key: _NUM_OR_NULL for key in (
        "samples_per_step", "tokens_per_step", "samples_per_s", "tokens_per_s",
        "flops_per_step", "achieved_tflops", "peak_tflops", "mfu_pct")},
    "device_name": _STR_OR_NULL,
    "dtype": _STR_OR_NULL,
})

_THROUGHPUT_JOB = _obj({
    **{key: _NUM_OR_NULL for key in (
        "samples_per_s", "tokens_per_s", "achieved_tflops", "mfu_pct", "peak_tflops")},
    "peak_device": _STR_OR_NULL,
    "peak_dtype": _STR_OR_NULL,
    "peak_source": _STR,
    "flops_source": _STR,
})

_ARRIVAL = _obj({"median_ms": _NUM, "worst_ms": _NUM, "worst_step": _INT,
                 "worst_rank": _INT_OR_NULL, "last_rank": _INT_OR_NULL, "last_pct": _NUM,
                 "num_steps": _INT,
                 "uncertainty_ms": _NUM}, nullable=True)

SECTION_STATS: Mapping[str, tuple[str, ...]] = {
    "step_time": (
        *(p.column for p in phases.step_metrics()), *(f.name for f in step_fields.reported()),
        *(f"{p.name}_share_pct" for p in phases.share_metrics()), "gpu_ms",
        "eval_total_ms", "num_eval",
    ),
    "step_memory": (
        "peak_allocated_bytes", "peak_reserved_bytes", "pressure_pct", "allocated_growth_bytes",
        "rss_peak_bytes", "rss_growth_bytes",
    ),
    "process": (
        "cpu_avg_pct", "cpu_share_pct", "rss_peak_bytes", "rss_pct",
        "device_allocated_peak_bytes", "device_reserved_peak_bytes", "device_reserved_pct",
    ),
    "system": (
        "cpu_avg_pct", "ram_peak_pct", "gpu_util_avg_pct", "gpu_temp_peak_c",
        "gpu_mem_used_peak_bytes", "gpu_power_avg_w",
    ),
    "throughput": ("samples_per_step", "tokens_per_step", "samples_per_s", "tokens_per_s",
                   "achieved_tflops", "mfu_pct"),
}
"""The stats keys of each section, in order; each value is a stat object or null."""

_ROWS: Mapping[str, Schema] = {
    "step_time": _STEP_TIME_ROW,
    "step_memory": _STEP_MEMORY_ROW,
    "process": _PROCESS_ROW,
    "system": _SYSTEM_ROW,
    "throughput": _THROUGHPUT_ROW,
}


def _section(name: str) -> dict[str, Any]:
    return _obj({
        "diagnosis": {"$ref": "#/$defs/finding"},
        "findings": {"type": "array", "items": {"$ref": "#/$defs/finding"}, "minItems": 1},
        "scope": _SCOPE,
        "stats": _obj({key: _STAT for key in SECTION_STATS[name]}),
        "ranks": {"type": "array", "items": _ROWS[name]},
        **({"job": _THROUGHPUT_JOB} if name == "throughput" else {}),
        **({"arrival": _ARRIVAL} if name == "step_time" else {}),
    })


_INCIDENT = _obj({
    "what": {"type": "string", "enum": ["stall", "exception", "exit"]},
    "rank": _INT,
    "node_rank": _INT,
    "host": _STR,
    "pid": _INT,
    "began_at": _STR,
    "detected_at": _STR,
    "cleared_at": {"type": ["string", "null"]},
    "duration_s": _NUM_OR_NULL,
    "step": _INT_OR_NULL,
    "phase": {"type": ["string", "null"]},
    "open_phases": {"type": "array", "items": _STR},
    "waiting_in_collective": {"type": "boolean"},
    "stack": {"type": "array", "items": _obj({"file": _STR, "line": _INT, "function": _STR,
                                               "user": {"type": "boolean"}})},
    "stack_source": {"type": ["string", "null"], "enum": ["python", "faulthandler", None]},
    "detail": {"type": "object",
               "additionalProperties": {"type": ["string", "number", "null"]}},
})

_ENDING = _obj({
    "state": {"type": "string", "enum": list(ENDING_STATES)},
    "headline": _obj(_FINDING_PROPS, nullable=True),
    "findings": {"type": "array", "items": {"$ref": "#/$defs/finding"}},
    "culprits": _INTS,
    "incidents": {"type": "array", "items": _INCIDENT},
})

_OPERATOR_SIDE = _obj({"ms": _NUM, "calls": _NUM, "shapes": _STR}, nullable=True)
_CAPTURE = _obj({
    "id": _STR,
    "trigger": _STR,
    "label": _STR,
    "phase": {"type": ["string", "null"]},
    "suspect": _INT,
    "reference": _INT_OR_NULL,
    "first_step": _INT,
    "steps_asked": _INT,
    "num_steps": _INT,
    "device": {"type": "boolean"},
    "phase_ms": _obj({"suspect": _NUM_OR_NULL, "reference": _NUM_OR_NULL}),
    "compute_diff_ms": _NUM_OR_NULL,
    "communication_diff_ms": _NUM_OR_NULL,
    "operators": {"type": "array", "items": _obj({
        "name": _STR, "part": {"type": "string", "enum": ["compute", "input", "optimizer"]},
        "communication": {"type": "boolean"}, "diff_ms": _NUM_OR_NULL,
        "suspect": _OPERATOR_SIDE, "reference": _OPERATOR_SIDE})},
    "traces": {"type": "array", "items": _obj({
        "rank": _INT, "host": {"type": ["string", "null"]}, "path": _STR, "bytes": _INT})},
    "notes": {"type": "array", "items": _STR},
})

SUMMARY_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": f"traceml final_summary.json {SCHEMA_VERSION}",
    **_obj({
        "schema_version": _STR,
        "meta": _META,
        "primary": _obj({
            "section": {"type": "string", "enum": [*SECTION_STATS, "ending"]},
            **_FINDING_PROPS,
        }),
        **{name: _section(name) for name in SECTION_STATS},
        "ending": _ENDING,
        "captures": {"type": "array", "items": _CAPTURE},
    }),
    "$defs": {
        "finding": _obj(_FINDING_PROPS),
        "stat": _obj({
            "median": _NUM,
            "worst": _NUM,
            "median_rank": _INT_OR_NULL,
            "worst_rank": _INT_OR_NULL,
            "worst_node": _INT_OR_NULL,
            "worst_gpu": _INT_OR_NULL,
        }, nullable=True),
        "distribution": _obj(_DIST_PROPS),
        "distribution_or_null": _obj(_DIST_PROPS, nullable=True),
    },
}


def validate_summary(obj: object) -> list[str]:
    """Problems of a final_summary.json document against :data:`SUMMARY_SCHEMA`;
    empty when valid. Each problem names the JSON path, e.g. ``$.meta.world_size``."""
    return validate(obj, SUMMARY_SCHEMA, SUMMARY_SCHEMA)


_TYPES: Mapping[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is_type(value: object, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _TYPES[name])


def validate(value: object, schema: Schema, root: Schema, path: str = "$") -> list[str]:
    """Problems of ``value`` against ``schema`` (the keywords of the module docstring)."""
    if "$ref" in schema:
        ref = str(schema["$ref"])
        assert ref.startswith("#/$defs/"), f"only local $defs refs are supported: {ref}"
        return validate(value, root["$defs"][ref.removeprefix("#/$defs/")], root, path)
    kinds = schema.get("type")
    if kinds is not None:
        names = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_is_type(value, n) for n in names):
            return [f"{path}: expected {' or '.join(names)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: {value!r} is not one of {schema['enum']}"]
    if isinstance(value, dict):
        return _validate_object(value, schema, root, path)
    if isinstance(value, list):
        return _validate_array(value, schema, root, path)
    return []


def _validate_object(value: dict[Any, Any], schema: Schema, root: Schema, path: str) -> list[str]:
    problems = [f"{path}: missing key {key!r}" for key in schema.get("required", ())
                if key not in value]
    props: Mapping[str, Schema] = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in props:
            problems += validate(item, props[key], root, f"{path}.{key}")
        elif extra is False:
            problems.append(f"{path}: unexpected key {key!r}")
        elif isinstance(extra, Mapping):
            problems += validate(item, extra, root, f"{path}.{key}")
    return problems


def _validate_array(value: list[Any], schema: Schema, root: Schema, path: str) -> list[str]:
    problems = []
    if len(value) < schema.get("minItems", 0):
        problems.append(f"{path}: fewer than {schema['minItems']} items")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        problems.append(f"{path}: more than {schema['maxItems']} items")
    if "items" in schema:
        for i, item in enumerate(value):
            problems += validate(item, schema["items"], root, f"{path}[{i}]")
    return problems
