"""Findings: what a diagnosis rule concludes, and how a section orders them (offline analysis).

Runs in the offline-analysis process. A rule returns a list of
:class:`Finding`; a section's list starts with its diagnosis. A rule whose
signal was not measured returns a ``NOT_MEASURED`` finding instead of guessing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Severity = Literal["info", "warn", "crit"]

NOT_MEASURED = "NOT_MEASURED"
"""Kind of every abstention; the label names what was not measured."""

_SEVERITY_ORDER: Mapping[Severity, int] = {"crit": 0, "warn": 1, "info": 2}


@dataclass(frozen=True)
class Finding:
    """One conclusion of one rule, with the numbers that support it."""

    kind: str  # machine name, e.g. "INPUT_BOUND"
    label: str  # what the report shows, e.g. "INPUT-BOUND"
    severity: Severity
    why: str  # one sentence with the numbers
    next: str  # what to try
    ranks: tuple[int, ...] = ()  # global ranks involved, most affected first
    evidence: Mapping[str, float | None] = field(default_factory=dict)
    nodes: tuple[int, ...] = ()  # node ranks involved (system findings)

    @property
    def measured(self) -> bool:
        """False for an abstention ("not measured")."""
        return self.kind != NOT_MEASURED

    @property
    def actionable(self) -> bool:
        """A measured problem: warn or crit."""
        return self.measured and self.severity != "info"


def not_measured(what: str, why: str) -> Finding:
    """An abstention: ``what`` (e.g. "DEVICE MEMORY") was not measured, ``why`` says so."""
    return Finding(NOT_MEASURED, f"{what} NOT MEASURED", "info", why, "")


def grade(value: float, warn: float, crit: float | None = None) -> Severity | None:
    """Severity of ``value`` against rising thresholds; None below ``warn``."""
    if crit is not None and value >= crit:
        return "crit"
    if value >= warn:
        return "warn"
    return None


def borderline(value: float, warn: float) -> bool:
    """Whether ``value`` sits within ``BORDERLINE_MARGIN`` of its warn threshold."""
    from traceml.diagnosis.thresholds import BORDERLINE_MARGIN

    return (1.0 - BORDERLINE_MARGIN) * warn <= value < (1.0 + BORDERLINE_MARGIN) * warn


def as_borderline(finding: Finding, warn: float, unit: str = "%") -> Finding:
    """``finding`` said as borderline: info, labelled so, the threshold in its why."""
    why = (f"{finding.why[:-1]}; that is within {100 * _margin():.0f}% of the "
           f"{warn:.0f}{unit} threshold: borderline, so another run may land on either side.")
    return dataclasses.replace(finding, label=f"BORDERLINE {finding.label}", severity="info",
                               why=why, evidence={**finding.evidence, "borderline": 1.0})


def _margin() -> float:
    from traceml.diagnosis.thresholds import BORDERLINE_MARGIN

    return BORDERLINE_MARGIN


def order_findings(found: Sequence[Finding], default: Finding) -> tuple[Finding, ...]:
    """A section's list: measured findings by severity (stable, so the rule order breaks
    ties), ``default`` when none fired, abstentions last."""
    measured = sorted((f for f in found if f.measured), key=lambda f: severity_rank(f.severity))
    absent: dict[str, Finding] = {}
    for f in found:
        if not f.measured:
            absent.setdefault(f.label, f)
    return tuple((measured or [default]) + list(absent.values()))


def severity_rank(severity: Severity) -> int:
    """0 for crit, 1 for warn, 2 for info: sorts the most severe first."""
    return _SEVERITY_ORDER[severity]


def format_ranks(ranks: Sequence[int], limit: int = 4) -> str:
    """``r0, r3`` or ``r0, r1, r2, r3 +4 more``: rank lists in sentences."""
    shown = ", ".join(f"r{r}" for r in ranks[:limit])
    rest = len(ranks) - limit
    return f"{shown} +{rest} more" if rest > 0 else shown


_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB")


def format_bytes(num_bytes: float) -> str:
    """``512 B``, ``192.0 MiB``, ``1.3 GiB``: binary units, one decimal."""
    if abs(num_bytes) < 1024:
        return f"{num_bytes:.0f} B"
    value = float(num_bytes)
    for unit in _BYTE_UNITS:
        value /= 1024.0
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            break
    return f"{value:.1f} {unit}"
