"""Hand-built rows for tests: step rows with the four phases the tests were written
with, positionally, as they were before the phase table (traceml.phases); step and
run-start records for hand-built stores."""

from __future__ import annotations

from typing import Any

from traceml import phases
from traceml.protocol import RunStart
from traceml.records import StepRow
from traceml.store import STEP_COLUMNS, StepRecord


def step_row(rank: int, step: int, input_ms: float, forward_ms: float, backward_ms: float,
             optimizer_ms: float, total_ms: float, wait_ms: float, *rest: Any,
             **named: Any) -> StepRow:
    """A StepRow with input, forward, backward and optimizer times, then the
    rest of StepRow's fields in order (positionally or by name)."""
    phase_ms = {p.name: 0.0 for p in phases.PHASES} | {
        "input": input_ms, "forward": forward_ms, "backward": backward_ms,
        "optimizer": optimizer_ms}
    if len(rest) < 8:  # a step with input time fetched it from a DataLoader
        named.setdefault("num_input", 1 if input_ms else 0)
    return StepRow(rank, step, phase_ms, total_ms, wait_ms, *rest, **named)


def step_record(step: int, **columns: Any) -> StepRecord:
    """A StepRecord from store column values (``input_ms=1.0``...); others are 0."""
    values = {c: columns.get(c, 0) for c in STEP_COLUMNS} | {"step": step}
    return StepRecord(
        step=step, t_begin=values["t_begin"], total_ms=values["total_ms"],
        wait_ms=values["wait_ms"], phase_ms=tuple(values[p.column] for p in phases.PHASES),
        counts=tuple(values[p.count_column] for p in phases.PHASES),
        num_skipped=values["num_skipped"], rss_bytes=values["rss_bytes"],
        peak_allocated_bytes=columns.get("peak_allocated_bytes"),
        peak_reserved_bytes=columns.get("peak_reserved_bytes"),
        gpu_ms=tuple(columns.get(p.gpu_column) for p in phases.gpu_timed()))


def run_start(session_id: str, started_at: float, summary_window_rows: int,
              expected_world_size: int = 0) -> RunStart:
    """A RunStart of a ``run`` with no command and no versions."""
    return RunStart(session_id=session_id, command=(), started_at=started_at,
                    traceml_version="", torch_version="", python_version="",
                    summary_window_rows=summary_window_rows, mode="run",
                    expected_world_size=expected_world_size)
