"""Hand-built rows for tests: step rows with the four phases the tests were written
with, positionally, as they were before the phase table (traceml.phases); step and
run-start records for hand-built stores."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from traceml import phases, step_fields
from traceml.records import StepRow
from traceml.wire.identity import Sender
from traceml.wire.records import RunStart

_OLD_ORDER = ("peak_allocated_bytes", "peak_reserved_bytes", "rss_bytes", "gpu_ms", "t",
              "collective_ms", "samples", "tokens", "flops", "flops_counted", "boundary",
              "eval_ms", "num_eval", "num_input")
"""StepRow's fields after wait_ms, in the order the tests were written with."""


def step_row(rank: int, step: int, input_ms: float, forward_ms: float, backward_ms: float,
             optimizer_ms: float, total_ms: float, wait_ms: float, *rest: Any,
             **named: Any) -> StepRow:
    """A StepRow with input, forward, backward and optimizer times, then the
    rest of the fields in :data:`_OLD_ORDER` (positionally or by name)."""
    phase_ms = {"input": input_ms, "forward": forward_ms, "backward": backward_ms,
                "optimizer": optimizer_ms}
    if len(rest) < len(_OLD_ORDER):  # a step with input time fetched it from a DataLoader
        named.setdefault("num_input", 1 if input_ms else 0)
    return row_of(rank, step, phase_ms, total_ms, wait_ms,
                  **dict(zip(_OLD_ORDER, rest)), **named)


def row_of(rank: int, step: int, phase_ms: dict[str, float], total_ms: float, wait_ms: float,
           gpu_ms: float | None = None, t: float | None = None, num_input: int = 0,
           **columns: Any) -> StepRow:
    """A StepRow from phase times by name, its GPU time (as the first GPU-timed phase's)
    and its end time ``t``; other columns by name."""
    gpu = [p.gpu_column for p in phases.gpu_compute()]  # a DDP wait: by name
    if gpu_ms is not None:
        columns |= dict.fromkeys(gpu, 0.0) | {gpu[0]: gpu_ms}
    return StepRow.of(rank=rank, step=step, total_ms=total_ms, wait_ms=wait_ms,
                      t_begin=None if t is None else t - total_ms / 1e3,
                      **{phases.PHASES[0].count_column: num_input},
                      **{f"{name}_ms": ms for name, ms in phase_ms.items()}, **columns)


def step_record(step: int, rank: int = 0, **columns: Any) -> StepRow:
    """A stored step of ``rank`` from column values (``input_ms=1.0``...); others are 0
    (None where the column is optional and not given)."""
    values = {f.name: 0 for f in step_fields.STEP_FIELDS if not f.optional and f.kind is not str}
    return StepRow.of(**(values | {"t_begin": 0.0} | columns | {"step": step, "rank": rank}))


def run_start(session_id: str, started_at: float, summary_window_rows: int,
              expected_world_size: int = 0) -> RunStart:
    """A RunStart of a ``run`` with no command and no versions."""
    return RunStart(session_id=session_id, command=(), started_at=started_at,
                    traceml_version="", torch_version="", python_version="",
                    summary_window_rows=summary_window_rows, mode="run",
                    expected_world_size=expected_world_size)


def sent_by(sender: Sender, rows: Iterable[StepRow]) -> list[StepRow]:
    """The rows as ``sender``'s: its rank, attempt and node."""
    return [row.replace(rank=sender.rank or 0, restart=sender.restart, node_rank=sender.node_rank)
            for row in rows]
