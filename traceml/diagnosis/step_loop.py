"""How the training loop was read: the step boundary rule, where input time
comes from, and evaluation passes kept out of the steps (offline analysis).

Runs in the offline-analysis process.  Pure functions of stored step rows (and
of each rank's whole-run totals, for evaluation):
the collector marks each step with what ended it (`traceml.phases.STEP_BOUNDARIES`)
and the evaluation that ran right before it began; a step with DataLoader
fetches has ``num_input`` > 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from traceml import phases
from traceml.records import RankTotals, StepRow, column

BOUNDARY_TEXT: Mapping[str, str] = {
    "optimizer": "optimizer",
    "backward": "backward, no torch.optim seen",
    "trace_step": "trace_step",
}
"""The card's ``steps: ...`` for each boundary rule."""

INPUT_SOURCES = ("dataloader", "before_forward", "copies")
INPUT_TEXT: Mapping[str, str] = {
    "dataloader": "DataLoader fetches and host-to-device copies",
    "before_forward": "time before the first forward; no DataLoader "
                      "(and host-to-device copies)",
    "copies": "host-to-device copies only; no DataLoader",
}
"""What a step's input time is, by source: the card's ``- Input:`` line."""


def boundary_rule(rows: Iterable[StepRow]) -> str | None:
    """The rule that ended most of these steps (ties: the table's order); None
    without steps."""
    counts = Counter(column(rows, "boundary"))
    if not counts:
        return None
    return max(phases.STEP_BOUNDARIES, key=lambda b: (counts.get(b, 0),
                                                      -phases.STEP_BOUNDARIES.index(b)))


def input_source(by_rank: Mapping[int, Sequence[StepRow]]) -> str | None:
    """Where the steps' input time comes from: DataLoader fetches when every rank
    fetched; else, without a DataLoader, the time before the first forward of
    steps that optimizer steps end, or host-to-device copies alone."""
    rows = [r for rank_rows in by_rank.values() for r in rank_rows]
    if not rows:
        return None
    if all(any(r.num_input for r in rank_rows) for rank_rows in by_rank.values() if rank_rows):
        return "dataloader"
    return "before_forward" if boundary_rule(rows) == "optimizer" else "copies"


def evaluation_by_rank(totals: Iterable[RankTotals]) -> dict[int, tuple[float, int]]:
    """Per rank, the evaluation kept out of its steps over the whole run: wall
    time (ms) and number of passes; ranks without any are left out."""
    return {t.rank: (t.eval_ms, t.num_eval) for t in totals if t.num_eval}
