"""A run's records as plain JSON (shared: recorded test scenarios keep a `RunData` so,
``tests/fixtures/scenarios/*/run.json``): rows column-wise to stay small, steps as the
step-field table's columns."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from traceml import step_fields
from traceml.clocks import NodeClock
from traceml.records import (
    FlopCount,
    GpuSample,
    Json,
    NodeInfo,
    ProcessSample,
    RunData,
    RunMeta,
    StepRow,
    SystemSample,
)

RUNDATA_FORMAT = "traceml.rundata/2"  # 2: steps as the step-field table's columns

_Row = TypeVar("_Row", ProcessSample, GpuSample, FlopCount)


def to_jsonable(run: RunData) -> dict[str, Json]:
    """Encode a run as plain JSON data; rows are stored column-wise to stay small."""
    meta = dataclasses.asdict(run.meta)
    meta["missing_ranks"] = list(run.meta.missing_ranks)
    meta["nodes"] = [
        {"node_rank": n.node_rank, "host": n.host, "ranks": list(n.ranks),
         "clock": None if n.clock is None else dataclasses.asdict(n.clock)}
        for n in run.meta.nodes
    ]
    return {
        "format": RUNDATA_FORMAT,
        "meta": meta,
        "steps": _encode_steps(run.steps),
        "process": _encode_rows(ProcessSample, run.process),
        "system": [_encode_system(s) for s in run.system],
        "flop_counts": _encode_rows(FlopCount, run.flop_counts),
    }


def from_jsonable(obj: object) -> RunData:
    """Decode what :func:`to_jsonable` wrote; ValueError or TypeError on malformed input."""
    top = _as_dict(obj, "run data")
    if top.get("format") != RUNDATA_FORMAT:
        raise ValueError(f"run data format is {top.get('format')!r}, expected {RUNDATA_FORMAT!r}")
    return RunData(
        meta=_decode_meta(_as_dict(top.get("meta"), "meta")),
        steps=_decode_steps(top.get("steps")),
        process=_decode_rows(ProcessSample, top.get("process")),
        system=tuple(_decode_system(s) for s in _as_list(top.get("system"), "system")),
        flop_counts=(_decode_rows(FlopCount, top["flop_counts"]) if "flop_counts" in top
                     else ()),
    )


def _encode_steps(rows: Sequence[StepRow]) -> dict[str, Json]:
    """Step rows as the table's columns."""
    return {"fields": list(step_fields.names()), "rows": [list(row) for row in rows]}


def _decode_steps(obj: object) -> tuple[StepRow, ...]:
    """What :func:`_encode_steps` wrote; a column it lacks (written before the column
    existed) takes its default."""
    table = _as_dict(obj, "steps")
    names = [_as_str(n, "field name") for n in _as_list(table.get("fields"), "fields")]
    unknown = set(names) - set(step_fields.names())
    if unknown:
        raise ValueError(f"steps: unknown fields {sorted(unknown)}")
    out = []
    for raw in _as_list(table.get("rows"), "rows"):
        values = _as_list(raw, "row")
        if len(values) != len(names):
            raise ValueError(f"steps: row has {len(values)} values, expected {len(names)}")
        out.append(StepRow.of(**dict(zip(names, values))))
    return tuple(out)


def _encode_rows(cls: type[_Row], rows: Sequence[_Row]) -> dict[str, Json]:
    names = [f.name for f in dataclasses.fields(cls)]
    return {
        "fields": list(names),
        "rows": [[getattr(row, name) for name in names] for row in rows],
    }


def _decode_rows(cls: type[_Row], obj: object) -> tuple[_Row, ...]:
    table = _as_dict(obj, cls.__name__)
    names = [_as_str(n, "field name") for n in _as_list(table.get("fields"), "fields")]
    unknown = set(names) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    out = []
    for raw in _as_list(table.get("rows"), "rows"):
        values = _as_list(raw, "row")
        if len(values) != len(names):
            raise ValueError(f"{cls.__name__}: row has {len(values)} values, expected {len(names)}")
        kwargs: dict[str, Any] = dict(zip(names, values))
        out.append(cls(**kwargs))
    return tuple(out)


def _encode_system(sample: SystemSample) -> dict[str, Json]:
    return {
        "node_rank": sample.node_rank,
        "host": sample.host,
        "t": sample.t,
        "cpu_pct": sample.cpu_pct,
        "ram_pct": sample.ram_pct,
        "ram_total_bytes": sample.ram_total_bytes,
        "gpus": _encode_rows(GpuSample, sample.gpus),
    }


def _decode_system(obj: object) -> SystemSample:
    raw = _as_dict(obj, "system sample")
    kwargs: dict[str, Any] = {k: v for k, v in raw.items() if k != "gpus"}
    return SystemSample(**kwargs, gpus=_decode_rows(GpuSample, raw.get("gpus")))


def _decode_meta(raw: dict[str, object]) -> RunMeta:
    kwargs: dict[str, Any] = dict(raw)
    kwargs["missing_ranks"] = tuple(_as_list(raw.get("missing_ranks"), "missing_ranks"))
    kwargs["nodes"] = tuple(_decode_node(n) for n in _as_list(raw.get("nodes"), "nodes"))
    return RunMeta(**kwargs)


def _decode_node(obj: object) -> NodeInfo:
    raw = _as_dict(obj, "node")
    ranks = tuple(_as_int(r, "node rank") for r in _as_list(raw.get("ranks"), "node ranks"))
    host = _as_str(raw.get("host"), "node host")
    clock = raw.get("clock")  # absent before clocks were measured
    return NodeInfo(node_rank=_as_int(raw.get("node_rank"), "node_rank"), host=host, ranks=ranks,
                    clock=None if clock is None else _decode_clock(clock))


def _decode_clock(obj: object) -> NodeClock:
    raw: dict[str, Any] = _as_dict(obj, "node clock")
    return NodeClock(**raw)


def _as_dict(obj: object, what: str) -> dict[str, object]:
    if not isinstance(obj, dict):
        raise TypeError(f"{what}: expected an object, got {type(obj).__name__}")
    return {str(k): v for k, v in obj.items()}


def _as_list(obj: object, what: str) -> list[object]:
    if not isinstance(obj, list):
        raise TypeError(f"{what}: expected a list, got {type(obj).__name__}")
    return list(obj)


def _as_int(obj: object, what: str) -> int:
    if not isinstance(obj, int) or isinstance(obj, bool):
        raise TypeError(f"{what}: expected an integer, got {type(obj).__name__}")
    return obj


def _as_str(obj: object, what: str) -> str:
    if not isinstance(obj, str):
        raise TypeError(f"{what}: expected a string, got {type(obj).__name__}")
    return obj
