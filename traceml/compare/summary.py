"""A typed, read-only view of one final_summary.json for comparing (offline analysis).

Runs in the offline-analysis process (``traceml compare``). :func:`decode_summary`
reads the parts of a summary that compare needs and nothing else. It is lenient
on purpose: a key that is missing or has the wrong type reads as "not there"
(``None``), so a summary from a neighbouring schema version or one with a
missing section still compares, and that part is reported INCONCLUSIVE instead
of crashing. Whether the document is a traceml summary at all is decided by
:mod:`traceml.compare.load`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from traceml import phases
from traceml.diagnosis.stats import Distribution
from traceml.report.model import SECTION_NAMES, SECTION_TITLES

STEP_PHASES = tuple(p.name for p in phases.step_metrics())
"""Phases whose per-rank distributions a Step Time rank row keeps."""

QUANTILE_KEYS = ("p10", "p25", "p50", "p75", "p90")

NOT_MEASURED_KIND = "NOT_MEASURED"


@dataclass(frozen=True)
class SectionData:
    """One section of a summary, as compare reads it."""

    name: str
    diagnosis_kind: str | None
    diagnosis_label: str | None
    finding_kinds: tuple[str, ...]
    stats: Mapping[str, float | None]  # stat key -> median over ranks; None = not measured
    rank_dists: Mapping[str, tuple[Distribution, ...]] = field(default_factory=dict)
    """Step Time only: ``"total_ms"`` etc. -> one distribution per rank that has it."""

    @property
    def title(self) -> str:
        """Display name, e.g. "Step Time"."""
        return SECTION_TITLES.get(self.name, self.name)

    @property
    def measured(self) -> bool:
        """False when the section holds no measured number (e.g. Step Time of a watch run)."""
        return any(v is not None for v in self.stats.values()) or bool(self.rank_dists)


@dataclass(frozen=True)
class CaptureData:
    """One profiler capture of a summary: its suspect rank's operators, ms per step."""

    capture_id: str
    trigger: str
    label: str
    suspect: int | None
    operators: Mapping[str, tuple[float, float | None, str, bool]]  # name -> ms, calls,
    # shapes, collective


@dataclass(frozen=True)
class RunSummary:
    """One side of a comparison: where it came from, its meta data and its sections."""

    label: str  # short name for the report, e.g. the session folder's name
    path: str  # the final_summary.json that was read
    schema_version: str
    session_id: str | None
    world_size: int | None
    device: str | None
    partial: bool
    sections: Mapping[str, SectionData | None]  # None: the section is missing in the file
    problems: tuple[str, ...] = ()  # schema problems found (same schema version only)
    ending: str | None = None  # how it ended (``ending.state``; None before schema 1.2)
    ending_label: str | None = None  # its headline's label, e.g. "STALLED"
    captures: tuple[CaptureData, ...] = ()  # profiler captures that profiled a step (1.6)

    def section(self, name: str) -> SectionData | None:
        """A section by its JSON name; None when the file lacks it."""
        return self.sections.get(name)


def decode_summary(doc: Mapping[str, object], label: str, path: str,
                   problems: tuple[str, ...] = ()) -> RunSummary:
    """The compare view of a parsed final_summary.json (``doc`` must be a JSON object)."""
    meta = _as_map(doc.get("meta"))
    return RunSummary(
        label=label,
        path=path,
        schema_version=str(doc.get("schema_version")),
        session_id=_as_str(meta.get("session_id")),
        world_size=_as_int(meta.get("world_size")),
        device=_as_str(meta.get("device")),
        partial=meta.get("partial") is True,
        sections={name: decode_section(name, doc.get(name)) for name in SECTION_NAMES},
        problems=problems,
        ending=_as_str(_as_map(doc.get("ending")).get("state")),
        ending_label=_as_str(_as_map(_as_map(doc.get("ending")).get("headline")).get("label")),
        captures=decode_captures(doc.get("captures")),
    )


def decode_captures(obj: object) -> tuple[CaptureData, ...]:
    """The captures that profiled a step; a malformed one is left out."""
    out = []
    for raw in obj if isinstance(obj, list) else []:
        c = _as_map(raw)
        cid, trigger = _as_str(c.get("id")), _as_str(c.get("trigger"))
        ops = c.get("operators")
        if cid is None or trigger is None or not _as_int(c.get("num_steps")) \
                or not isinstance(ops, list):
            continue
        operators = {}
        for op in ops:
            o, mine = _as_map(op), _as_map(_as_map(op).get("suspect"))
            name, ms = _as_str(o.get("name")), _as_num(mine.get("ms"))
            part = _as_str(o.get("part")) or "compute"
            if name is not None and part != "compute":
                name += f" [{part}]"
            if name is not None and ms is not None:
                operators[name] = (ms, _as_num(mine.get("calls")),
                                   _as_str(mine.get("shapes")) or "", o.get("communication") is True)
        out.append(CaptureData(cid, trigger, _as_str(c.get("label")) or trigger,
                               _as_int(c.get("suspect")), operators))
    return tuple(out)


def decode_section(name: str, obj: object) -> SectionData | None:
    """A section object; None when it is missing or not an object."""
    if not isinstance(obj, Mapping):
        return None
    diagnosis = _as_map(obj.get("diagnosis"))
    findings = obj.get("findings")
    kinds = [_as_str(_as_map(f).get("kind")) for f in findings] if isinstance(findings, list) else []
    stats = {str(key): _as_num(_as_map(stat).get("median"))
             for key, stat in _as_map(obj.get("stats")).items()}
    dists = decode_rank_dists(obj.get("ranks")) if name == "step_time" else {}
    return SectionData(
        name=name,
        diagnosis_kind=_as_str(diagnosis.get("kind")),
        diagnosis_label=_as_str(diagnosis.get("label")),
        finding_kinds=tuple(k for k in kinds if k is not None),
        stats=stats,
        rank_dists=dists,
    )


def decode_rank_dists(rows: object) -> dict[str, tuple[Distribution, ...]]:
    """Per-phase distributions of the Step Time rank rows; phases no row has are left out."""
    if not isinstance(rows, list):
        return {}
    out: dict[str, tuple[Distribution, ...]] = {}
    for phase in STEP_PHASES:
        key = f"{phase}_ms"
        dists = [d for row in rows if (d := decode_distribution(_as_map(row).get(key)))]
        if dists:
            out[key] = tuple(dists)
    return out


def decode_distribution(obj: object) -> Distribution | None:
    """``{count, mean, p10..p90}``; None when any part is missing or the count is 0."""
    raw = _as_map(obj)
    count = _as_int(raw.get("count"))
    numbers = [_as_num(raw.get(key)) for key in ("mean", *QUANTILE_KEYS)]
    if not count or count <= 0:
        return None
    mean, p10, p25, p50, p75, p90 = numbers
    if mean is None or p10 is None or p25 is None or p50 is None or p75 is None or p90 is None:
        return None
    return Distribution(count, mean, p10, p25, p50, p75, p90)


def _as_map(obj: object) -> Mapping[str, object]:
    return obj if isinstance(obj, Mapping) else {}


def _as_str(obj: object) -> str | None:
    return obj if isinstance(obj, str) else None


def _as_int(obj: object) -> int | None:
    return obj if isinstance(obj, int) and not isinstance(obj, bool) else None


def _as_num(obj: object) -> float | None:
    """A finite number; anything else (NaN and infinity included) reads as not measured."""
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        return None
    value = float(obj)
    return value if math.isfinite(value) else None
