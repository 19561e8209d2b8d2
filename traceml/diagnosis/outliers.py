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
from traceml.diagnosis.samples import StepRow
from traceml.diagnosis.stats import pct

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
    totals = [r.total_ms for r in rows]
    median = statistics.median(totals) if totals else 0.0
    slow: list[StepRow] = []
    if len(rows) >= thresholds.OUTLIER_MIN_STEPS and median > 0:
        spread = statistics.median(abs(t - median) for t in totals)
        limit = median + max((thresholds.OUTLIER_STEP_RATIO - 1.0) * median,
                             thresholds.OUTLIER_MAD_FACTOR * spread)
        slow = [r for r in rows if r.total_ms >= limit]
        if len(slow) > thresholds.OUTLIER_MAX_FRACTION * len(rows):
            slow = []
    return RankOutliers(rank, median, tuple(r.step for r in slow),
                        tuple(r.total_ms for r in slow), sum(totals))


def period(steps: Sequence[int]) -> int | None:
    """The steps' period when at least 3 come at a steady interval (within one
    step, for intervals of 5 and more); None otherwise."""
    if len(steps) < 3:
        return None
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    typical = round(statistics.median(gaps))
    slack = 1 if typical >= 5 else 0
    return typical if typical >= 2 and all(abs(g - typical) <= slack for g in gaps) else None


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
    every = period(worst.steps)
    num = len(worst.steps)
    pattern = (f"every {every} steps (from step {worst.steps[0]})" if every else
               f"at step{'s' if num > 1 else ''} {_listed(worst.steps)}")
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
