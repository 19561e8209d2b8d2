"""Outlier steps: the few steps far slower than a rank's typical one (offline analysis).

Runs in the offline-analysis process.  A step is an outlier when it took at
least `thresholds.OUTLIER_STEP_RATIO` times its rank's median step and
`thresholds.OUTLIER_MAD_FACTOR` median absolute deviations above it, as long as
such steps are few (`thresholds.OUTLIER_MAX_FRACTION`).  The Step Time rules
diagnose the typical step, the window without them, so two slow steps cannot
flip a run's diagnosis; OUTLIER STEPS reports them on their own: how many, how
much slower, their pattern (a period, or the steps one by one) and their share
of the window's wall time.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from traceml.diagnosis import thresholds
from traceml.diagnosis.finding import Finding, format_ranks, grade
from traceml.diagnosis.stats import pct
from traceml.records import StepRow, ms_column

MAX_LISTED_STEPS = 8
"""One-off outliers are listed by step up to this many."""


@dataclass(frozen=True)
class RankOutliers:
    """One rank's outlier steps over the window."""

    rank: int
    median_ms: float  # the rank's median step over the whole window
    steps: tuple[int, ...]  # outlier step indices, ascending
    outlier_ms: tuple[float, ...]  # their totals
    window_ms: float  # every window step's total, summed

    @property
    def excess_ms(self) -> float:
        """Wall time the outliers took beyond the median step: what there is to win back."""
        return sum(self.outlier_ms) - len(self.steps) * self.median_ms

    @property
    def share_pct(self) -> float | None:
        """The outlier steps' share of the window's wall time."""
        return pct(sum(self.outlier_ms), self.window_ms)


def find_outliers(rank: int, rows: Sequence[StepRow]) -> RankOutliers:
    """A rank's outlier steps (none in a window too short to tell)."""
    totals = ms_column(rows, "total")
    median = statistics.median(totals) if totals else 0.0
    slow: list[StepRow] = []
    if len(rows) >= thresholds.OUTLIER_MIN_STEPS and median > 0:
        spread = statistics.median(abs(t - median) for t in totals)
        limit = median + max((thresholds.OUTLIER_STEP_RATIO - 1.0) * median,
                             thresholds.OUTLIER_MAD_FACTOR * spread)
        slow = [r for r, t in zip(rows, totals) if t >= limit]
        if len(slow) > thresholds.OUTLIER_MAX_FRACTION * len(rows):
            slow = []
    return RankOutliers(rank, median, tuple(r.step for r in slow),
                        tuple(r.total_ms for r in slow), sum(totals))


MAX_PERIOD_CANDIDATES = 12
"""Periods are looked for among the pairs of this many slowest outliers."""


def period(steps: Sequence[int]) -> int | None:
    """The period of all the steps, when at least 3 come at a steady interval
    (within one step, for intervals of 5 and more); None otherwise."""
    every, periodic = periodic_steps(steps, [1.0] * len(steps))
    return every if len(periodic) == len(steps) else None


def periodic_steps(steps: Sequence[int], weights: Sequence[float]
                   ) -> tuple[int | None, tuple[int, ...]]:
    """The interval of the heaviest run of at least 3 steps that come every
    ``d`` steps without a gap (``d`` >= 2, within one step from 5 on), and those
    steps; ``(None, ())`` when there is none.  Other slow steps (noise, one-offs)
    may lie between them."""
    heaviest = sorted(range(len(steps)), key=lambda i: -weights[i])[:MAX_PERIOD_CANDIDATES]
    best: tuple[float, int, tuple[int, ...]] | None = None
    for a in heaviest:
        for b in heaviest:
            d = steps[b] - steps[a]
            if d < 2:
                continue
            run = _progression(steps, steps[a], d)
            weight = sum(weights[steps.index(s)] for s in run)
            if len(run) >= 3 and (best is None or (weight, d) > best[:2]):
                best = (weight, d, run)
    return (best[1], best[2]) if best is not None else (None, ())


def _progression(steps: Sequence[int], start: int, d: int) -> tuple[int, ...]:
    """The steps at ``start``, ``start + d``, ... (within one step when d >= 5),
    both ways from ``start``, up to the first missing one."""
    slack = 1 if d >= 5 else 0
    present = set(steps)

    def near(target: int) -> int | None:
        return next((t for t in range(target - slack, target + slack + 1) if t in present), None)

    found = [start]
    for sign in (1, -1):
        at = start
        while (hit := near(at + sign * d)) is not None:
            found.append(hit)
            at = hit
    return tuple(sorted(found))


def outlier_steps(outliers: Mapping[int, RankOutliers]) -> list[Finding]:
    """OUTLIER STEPS from the rank whose outliers cost most; warn from 10 % of the
    window's wall time beyond the median step (crit 20 %), info below."""
    found = {r: o for r, o in outliers.items() if o.steps}
    if not found:
        return []
    ranks = tuple(sorted(found, key=lambda r: -found[r].excess_ms))
    worst = found[ranks[0]]
    excess_pct = pct(worst.excess_ms, worst.window_ms) or 0.0
    ratio = statistics.median(worst.outlier_ms) / worst.median_ms
    every, periodic = periodic_steps(worst.steps, worst.outlier_ms)
    num = len(worst.steps)
    others = [s for s in worst.steps if s not in periodic]
    at = f"at step{'s' if len(others) > 1 else ''} {_listed(others)}"
    if every and others:
        pattern = f"{len(periodic)} of them every {every} steps (from step {periodic[0]}), and {at}"
    else:
        pattern = f"every {every} steps (from step {periodic[0]})" if every else at
    why = (f"r{worst.rank}: {num} step{'s' if num > 1 else ''} took {_times(ratio)} the "
           f"{worst.median_ms:.1f} ms median step, {pattern}: {worst.share_pct or 0.0:.1f}% "
           f"of wall time ({worst.excess_ms / 1e3:.2f} s beyond the median step, "
           f"{excess_pct:.1f}% of the window)")
    why += f"; also {format_ranks(ranks[1:])}." if len(ranks) > 1 else "."
    severity = grade(excess_pct, thresholds.OUTLIER_WARN_PCT, thresholds.OUTLIER_CRIT_PCT)
    evidence = {"rank": worst.rank, "num_outlier_steps": num, "median_step_ms": worst.median_ms,
                "ratio": ratio, "outlier_share_pct": worst.share_pct,
                "excess_share_pct": excess_pct, "win_back_ms": worst.excess_ms,
                "period_steps": every, "first_step": worst.steps[0]}
    return [Finding("OUTLIER_STEPS", "OUTLIER STEPS", severity or "info", why,
                    _next(every), ranks, evidence)]


def _next(every: int | None) -> str:
    if every:
        return (f"Find what runs every {every} steps (a checkpoint, an evaluation, logging, "
                "a garbage collection) and make it asynchronous, cheaper or rarer; the "
                "typical step's diagnosis is listed as well.")
    return ("Look at what ran at those steps: a torch.compile recompilation, a slow batch or "
            "shard, a garbage collection, another process on the host; the typical step's "
            "diagnosis is listed as well.")


def _times(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def _listed(steps: Sequence[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:MAX_LISTED_STEPS])
    rest = len(steps) - MAX_LISTED_STEPS
    return f"{shown} +{rest} more" if rest > 0 else shown
