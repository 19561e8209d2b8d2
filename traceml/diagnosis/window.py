"""The analysis window: which steps and samples the diagnosis looks at (offline analysis).

Runs in the offline-analysis process. The step window is the last
``summary_window_rows`` steps that every rank present completed (aligned on
the step index), after leaving out warm-up. Ranks that sent no steps at all
(crashed before their first step, or their node never reported) are not
waited for: they are listed as missing. A wide job's window is shorter: at most
``WINDOW_MAX_ROWS`` rows over all its ranks, never under ``WINDOW_MIN_STEPS``
steps a rank (10 000 steps of 8192 ranks would be 82 M rows to read). A step in which the FLOP counter ran
(on any rank) is left out too: the counter slowed it. Sample sections use each rank's (each
node's) samples taken while the step window ran when steps carry end times,
else all its samples; so a rank with samples is never missing from them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from traceml import step_fields
from traceml.diagnosis import thresholds
from traceml.records import (
    Capture,
    Incident,
    ProcessSample,
    RunData,
    StepRow,
    SystemSample,
    column,
    ms_column,
)


@dataclass(frozen=True)
class Scope:
    """What a section's diagnosis was computed over."""

    window_rows: int  # the configured --summary-window-rows
    ranks: tuple[int, ...]  # ranks whose data was used
    missing_ranks: tuple[int, ...]  # ranks of the world with no data in this section
    nodes: tuple[int, ...]  # node ranks whose data was used
    num_nodes: int  # nodes of the job
    num_steps: int | None = None  # aligned steps used per rank (step sections)
    num_warmup_steps: int | None = None  # first aligned steps left out as warm-up
    first_step: int | None = None
    last_step: int | None = None
    num_samples: int | None = None  # samples used (process and system sections)
    num_counted_steps: int | None = None  # steps left out because the FLOP counter ran in them
    num_captured_steps: int | None = None  # ...because a profiler capture ran in them
    step_boundary: str | None = None  # Step Time: what ended the steps (phases.STEP_BOUNDARIES)
    input_source: str | None = None  # Step Time: what input time is (step_loop.INPUT_SOURCES)


@dataclass(frozen=True)
class StepWindow:
    """Aligned per-rank steps: every rank holds the same step indices, ascending."""

    by_rank: Mapping[int, tuple[StepRow, ...]]
    steps: tuple[int, ...]
    num_warmup_steps: int
    window_rows: int
    world_size: int
    num_counted_steps: int = 0  # aligned steps left out: the FLOP counter ran in them
    num_captured_steps: int = 0  # ...a profiler capture ran in them (or its trace's writing)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Ranks in the window, ascending."""
        return tuple(sorted(self.by_rank))

    def scope(self, node_of: Mapping[int, int], num_nodes: int) -> Scope:
        """The scope a step section reports."""
        return Scope(
            window_rows=self.window_rows,
            ranks=self.ranks,
            missing_ranks=missing(self.ranks, self.world_size),
            nodes=tuple(sorted({node_of[r] for r in self.ranks if r in node_of})),
            num_nodes=num_nodes,
            num_steps=len(self.steps),
            num_warmup_steps=self.num_warmup_steps,
            first_step=self.steps[0] if self.steps else None,
            last_step=self.steps[-1] if self.steps else None,
            num_counted_steps=self.num_counted_steps,
            num_captured_steps=self.num_captured_steps,
        )

    @functools.cached_property  # a frozen instance's __dict__ takes it all the same
    def _time_span(self) -> tuple[float, float] | None:
        rows = list(itertools.chain.from_iterable(self.by_rank.values()))
        begins = column(rows, "t_begin")
        if not rows or None in begins:
            return None
        known = typing.cast(list[float], begins)
        ends = map(operator.add, known,
                   map(operator.truediv, ms_column(rows, "total"), itertools.repeat(1e3)))
        return min(known), max(ends)

    def time_span(self) -> tuple[float, float] | None:
        """Unix seconds from the first window step's start to the last one's end,
        when steps carry end times; None otherwise."""
        return self._time_span

    def for_world(self, world_size: int) -> StepWindow:
        """This window in a job of ``world_size`` ranks (its time span, once computed,
        kept: a wide job's takes a pass over every window row)."""
        out = dataclasses.replace(self, world_size=world_size)
        if "_time_span" in self.__dict__:
            out.__dict__["_time_span"] = self.__dict__["_time_span"]
        return out


WINDOW_MAX_ROWS = 400_000
"""The most rows a summary window holds over all ranks (8192 ranks: 50 steps each)."""
WINDOW_MIN_STEPS = 50
"""...but never fewer steps a rank than this."""


def window_steps(window_rows: int, num_ranks: int) -> int:
    """The steps per rank a window of ``window_rows`` keeps with ``num_ranks`` ranks:
    the configured rows, shortened for a wide job (see the module docstring)."""
    if window_rows <= 0 or num_ranks <= 0:
        return window_rows
    return min(window_rows, max(WINDOW_MIN_STEPS, WINDOW_MAX_ROWS // num_ranks))


def warmup_steps(num_aligned: int) -> int:
    """How many of the first aligned steps are warm-up: min(5, floor(10 %))."""
    return min(thresholds.WARMUP_MAX_STEPS, int(num_aligned * thresholds.WARMUP_FRACTION))


def tail_decides(num_aligned: int, window_rows: int) -> bool:
    """Whether the last ``num_aligned`` aligned steps give the window all of them would:
    enough for the window after the longest warm-up, and already that warm-up's length."""
    return (num_aligned >= window_rows + thresholds.WARMUP_MAX_STEPS
            and warmup_steps(num_aligned) == thresholds.WARMUP_MAX_STEPS)


# A step row's columns, as C-level getters (a wide job's window has 400 000 rows).
_RANK, _STEP, _FLOPS_COUNTED = (operator.itemgetter(step_fields.names().index(c))
                                for c in ("rank", "step", "flops_counted"))


def num_aligned(steps: Iterable[StepRow], ranks: Iterable[int] = ()) -> int:
    """How many step indices every rank of ``steps`` (and of ``ranks``) holds."""
    per_rank: dict[int, set[int]] = {rank: set() for rank in ranks}
    for rank, rows in itertools.groupby(steps, key=_RANK):  # a run of one rank's rows
        per_rank.setdefault(rank, set()).update(map(_STEP, rows))
    return len(set.intersection(*per_rank.values())) if per_rank else 0


class AnalysisWindow:
    """The summary's window as the store's bounded read places it
    (`traceml.store.reader.WindowPolicy`, passed to `StoreReader.window_run`)."""

    def steps_per_rank(self, window_rows: int, num_ranks: int) -> int:
        return window_steps(window_rows, num_ranks)

    def depth(self, steps_per_rank: int) -> int:
        return max(steps_per_rank + thresholds.WARMUP_MAX_STEPS,
                   math.ceil(thresholds.WARMUP_MAX_STEPS / thresholds.WARMUP_FRACTION))

    def tail_decides(self, steps: Sequence[StepRow], ranks: Sequence[int],
                     steps_per_rank: int) -> bool:
        return tail_decides(num_aligned(steps, ranks), steps_per_rank)

    def time_span(self, steps: Sequence[StepRow], window_rows: int) -> tuple[float, float] | None:
        return select_window(steps, window_rows, 0).time_span()

    def crash_spans(self, incidents: Sequence[Incident]) -> list[tuple[float, float]]:
        """Around each crash, the host samples its ending reads (a SIGKILL's memory)."""
        return [(i.began_at - thresholds.RAM_LOOKBACK_S, i.began_at + 1.0)
                for i in incidents if i.what != "stall"]


ANALYSIS_WINDOW = AnalysisWindow()


class PlacingWindow(AnalysisWindow):
    """:data:`ANALYSIS_WINDOW` for one read, keeping the window it placed there (to
    find the samples taken while it ran), so that the report over the same rows takes
    it instead of placing it again (`window_for`)."""

    def __init__(self) -> None:
        self._placed: tuple[Sequence[StepRow], int, StepWindow] | None = None

    def time_span(self, steps: Sequence[StepRow], window_rows: int) -> tuple[float, float] | None:
        window = select_window(steps, window_rows, 0)
        self._placed = (steps, window_rows, window)
        return window.time_span()

    def window_for(self, run: RunData, window_rows: int) -> StepWindow | None:
        """The window `select_window` would place over ``run`` (the read's rows) without
        its profiler captures; None when the run is not the one read, or has captures
        (their steps are left out there: the report places its own)."""
        if self._placed is None or capture_spans(run.captures):
            return None
        steps, placed_rows, window = self._placed
        if steps is not run.steps or placed_rows != window_rows:
            return None
        return window.for_world(run.meta.world_size)


def select_window(steps: Iterable[StepRow], window_rows: int, world_size: int,
                  captured: Sequence[tuple[int, float, float]] = ()) -> StepWindow:
    """The last ``window_rows`` aligned steps after warm-up (see the module docstring).
    ``captured``: (rank, began, ended) of each profiler capture; a step of that rank that
    overlaps it is left out on every rank, like a FLOP-counting step."""
    per_rank: dict[int, dict[int, StepRow]] = {}
    for rank, run in itertools.groupby(steps, key=_RANK):  # a run of one rank's rows
        rows = list(run)
        # a resent step replaces the first
        per_rank.setdefault(rank, {}).update(zip(map(_STEP, rows), rows))
    common = sorted(set.intersection(*map(set, per_rank.values()))) if per_rank else []
    warm = warmup_steps(len(common))
    counted = {s for rows in per_rank.values()
               for s in itertools.compress(rows, map(_FLOPS_COUNTED, rows.values()))}
    kept = common[warm:]
    kept = kept[-window_steps(window_rows, len(per_rank)):] if window_rows > 0 else []
    num_counted = sum(s in counted for s in kept)
    kept = [s for s in kept if s not in counted]
    profiled = {s for rank, began, ended in captured
                for s, row in per_rank.get(rank, {}).items() if _overlaps(row, began, ended)}
    num_captured = sum(s in profiled for s in kept)
    kept = [s for s in kept if s not in profiled]
    by_rank = {rank: tuple(map(rows.__getitem__, kept)) for rank, rows in per_rank.items()}
    return StepWindow(by_rank, tuple(kept), warm, window_rows, world_size, num_counted,
                      num_captured)


def _overlaps(row: StepRow, began: float, ended: float) -> bool:
    """Whether a step ran while a capture did (a step without its start time: not known)."""
    start = row.t_begin
    return start is not None and start < ended and start + row.total_ms / 1e3 > began


def capture_spans(captures: Iterable[Capture]) -> list[tuple[int, float, float]]:
    """(rank, began, ended) of each capture that profiled a step."""
    return [(c.rank, c.began_at, c.ended_at) for c in captures
            if c.began_at is not None and c.ended_at is not None]


def missing(ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    """Ranks of the world not in ``ranks``."""
    present = set(ranks)
    return tuple(r for r in range(world_size) if r not in present)


_Sample = TypeVar("_Sample", ProcessSample, SystemSample)


def in_span(samples: Sequence[_Sample], span: tuple[float, float] | None) -> tuple[_Sample, ...]:
    """Each source's samples taken within ``span``; all of its samples when there is
    no span or none of its samples falls in it (a short window between two samples)."""
    if span is None:
        return tuple(samples)
    start, end = span
    seen_inside = {_source(s) for s in samples if start <= s.t <= end}
    return tuple(s for s in samples if start <= s.t <= end or _source(s) not in seen_inside)


def _source(sample: ProcessSample | SystemSample) -> int:
    """Who took the sample: a rank (process samples) or a node (system samples)."""
    return sample.rank if isinstance(sample, ProcessSample) else sample.node_rank
