"""The compare report as boxed text, the layout of the seed README (offline analysis).

Runs in the offline-analysis process. Verdict first with its one-line why,
then the two runs and any notes (schema, topology, partial runs), then per
section (Step Time, Step Memory, Process, System, Throughput) its two diagnoses
on one line and a table: metric, A, B, delta (B - A) and % of A.  All tables
share column widths, and the card fits 80 columns: the diagnoses (labels up to
30 characters) stay out of the table, and a rate's unit is in its metric's name,
not in every cell.  ASCII only.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from traceml.compare.model import CaptureCompare, Comparison, MetricRow, RunInfo, SectionCompare
from traceml.diagnosis.finding import format_bytes

MIN_WIDTH = 80
"""The box is this wide, or wider when a table row needs it (none does today)."""

HEADER = ("Metric", "A", "B", "Delta", "%")
MISSING = "-"


def render_text(comparison: Comparison) -> str:
    """The boxed compare report, ending in a newline."""
    tables = {s.name: table_cells(s) for s in comparison.sections}
    widths = column_widths([HEADER, *(row for cells in tables.values() for row in cells)])
    width = max(MIN_WIDTH, sum(widths) + 2 * (len(widths) - 1) + 6)
    body = ["", *overview(comparison), ""]
    for section in comparison.sections:
        body += [*section_lines(section, tables[section.name], widths), ""]
    if comparison.captures is not None:
        body += [*capture_lines(comparison.captures), ""]
    rule = "+" + "-" * (width - 2) + "+"
    lines = [rule, *boxed(["TraceML Compare"], width), rule, *boxed(body[:-1], width), rule]
    return "\n".join(lines) + "\n"


def capture_lines(c: CaptureCompare) -> list[str]:
    """B's profiler capture against A's: the suspect rank's operators, ms per step."""
    lines = [f"Operators (B's profiler capture {c.b_id}, {c.b_label}, against A's {c.a_id}, "
             f"{c.a_label}: each suspect rank's self time per step)"]
    for o in c.operators:
        a = "-" if o.a_ms is None else f"{o.a_ms:.2f}"
        b = "-" if o.b_ms is None else f"{o.b_ms:.2f}"
        delta = "not listed on both" if o.delta_ms is None else f"{o.delta_ms:+.2f} ms"
        text = f"- {o.name}{' [collective]' if o.communication else ''} {delta} (A {a}, B {b})"
        if o.a_shapes != o.b_shapes and o.a_shapes and o.b_shapes:
            text += f"; A {o.a_shapes}; B {o.b_shapes}"
        lines.append(text)
    return lines


def boxed(items: Sequence[str], width: int) -> list[str]:
    """Frame each item; long prose wraps with continuation lines indented."""
    out = []
    for item in items:
        if len(item) <= width - 6:  # tables: keep their spacing exactly
            out.append("|  " + item.ljust(width - 4) + "|")
            continue
        wrapped = textwrap.wrap(item, width - 6, subsequent_indent="  ", break_on_hyphens=False)
        out += ["|  " + part.ljust(width - 4) + "|" for part in wrapped or [""]]
    return out


def overview(comparison: Comparison) -> list[str]:
    """Verdict, why, the two runs, the delta convention and the notes."""
    return [
        f"Verdict: {comparison.verdict.label}",
        f"Why: {comparison.verdict.why}",
        "",
        f"A: {run_line(comparison.a)}",
        f"B: {run_line(comparison.b)}",
        "Delta: B - A (values: median over ranks of each rank's mean or peak)",
        *(f"Note: {note}" for note in comparison.notes),
    ]


def run_line(run: RunInfo) -> str:
    """``fast (1 rank, cpu)``, plus the session id when it is not the label."""
    ranks = "? ranks" if run.world_size is None else (
        f"{run.world_size} rank" + ("" if run.world_size == 1 else "s"))
    parts = [ranks, run.device or "unknown device"]
    if run.session_id and run.session_id != run.label:
        parts.append(f"session {run.session_id}")
    if run.partial:
        parts.append("PARTIAL")
    return f"{run.label} ({', '.join(parts)})"


def section_lines(section: SectionCompare, cells: list[tuple[str, ...]],
                  widths: Sequence[int]) -> list[str]:
    """A section's title, its INCONCLUSIVE line if any, and its table."""
    diag = section.diagnosis
    a, b = diag.a or MISSING, diag.b or MISSING
    said = f"A {a}, B {b} (changed)" if diag.changed else f"{a} in both (same)"
    lines = [section.title, f"Diagnosis: {said}"]
    if section.inconclusive_why:  # only the diagnoses: the other side has no numbers
        return [*lines, f"INCONCLUSIVE: {section.title} {section.inconclusive_why}."]
    return lines + [format_row(row, widths) for row in [HEADER, *cells]]


def table_cells(section: SectionCompare) -> list[tuple[str, ...]]:
    """One row per metric, as text cells."""
    return [metric_cells(row) for row in section.rows]


def metric_cells(row: MetricRow) -> tuple[str, ...]:
    """``Total step | 20.0 ms | 23.0 ms | +3.0 ms | +15.0%``."""
    delta, pct = row.delta, row.delta_pct
    return (
        row.label,
        format_value(row.key, row.a),
        format_value(row.key, row.b),
        MISSING if delta is None else format_delta(row.key, delta),
        MISSING if pct is None else f"{pct:+.1f}%",
    )


def format_value(key: str, value: float | None) -> str:
    """A value in the unit its key names: ``20.0 ms``, ``1.2 GiB``, ``45.0%``, ``71.0 C``."""
    return MISSING if value is None else _in_unit(key, value, signed=False)


RATE_KEYS = frozenset({"samples_per_s", "tokens_per_s", "samples_per_step",
                       "tokens_per_step", "achieved_tflops"})
"""Throughput keys, shown as bare numbers: their metric names carry the unit
(Samples/s, Tokens per step, Achieved TFLOP/s)."""


def format_delta(key: str, delta: float) -> str:
    """A signed change: ``+3.0 ms``, ``-128.0 MiB``, ``+2.5 pp`` (percentage points)."""
    return _in_unit(key, delta, signed=True)


def _in_unit(key: str, x: float, signed: bool) -> str:
    """``x`` in the unit ``key`` names, with its sign when ``signed``."""
    sign = ("-" if x < 0 else "+") if signed else ""
    size = abs(x) if signed else x
    if key.endswith("_bytes"):
        return sign + format_bytes(size)
    if key.endswith("_pct"):
        return f"{x:+.1f} pp" if signed else f"{x:.1f}%"
    if key.endswith("_w"):
        return f"{x:+.0f} W" if signed else f"{x:.0f} W"
    if key in RATE_KEYS:  # the metric's name says the unit
        return sign + _rate(size)
    unit = " C" if key.endswith("_c") else " ms"
    return f"{x:+.1f}{unit}" if signed else f"{x:.1f}{unit}"


def _rate(value: float) -> str:
    """4 significant digits below 1000 (``290.9``, ``4.062e-05`` for tiny TFLOP/s),
    whole numbers with thousands separators above (``123,456``), never ``1.235e+05``."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def column_widths(rows: Sequence[Sequence[str]]) -> list[int]:
    """The widest cell of each column."""
    return [max(len(row[i]) for row in rows) for i in range(len(HEADER))]


def format_row(cells: Sequence[str], widths: Sequence[int]) -> str:
    """Cells padded to the column widths, two spaces apart, left-aligned."""
    return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()
