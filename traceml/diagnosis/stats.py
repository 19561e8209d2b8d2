"""Small statistics the rules and the report share (offline analysis).

Runs in the offline-analysis process. Pure functions over floats:
distributions of a per-step series, the median/worst of a per-rank metric,
the "median of the other ranks" reference that straggler rules use, per rank
and per step, and a robust spread.
"""

from __future__ import annotations

import bisect
import math
import operator
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

Worst = Literal["max", "min"]


@dataclass(frozen=True)
class Distribution:
    """One rank's per-step values of one metric: count, mean and quantiles.

    Quantiles use linear interpolation between order statistics (numpy's default).
    `traceml compare` uses them to tell a change from step-to-step noise.
    """

    count: int
    mean: float
    p10: float
    p25: float
    p50: float
    p75: float
    p90: float


@dataclass(frozen=True)
class MetricStat:
    """A metric over ranks (or nodes, or GPUs): the median and the worst one.

    ``median_rank`` is the rank whose value is the lower median; ``worst_rank``,
    ``worst_node`` and ``worst_gpu`` locate the worst value (None where the
    metric is not per rank, per node or per GPU).
    """

    median: float
    worst: float
    median_rank: int | None = None
    worst_rank: int | None = None
    worst_node: int | None = None
    worst_gpu: int | None = None


class Located(NamedTuple):
    """A value and where it was measured, the input of :func:`metric_stat` (a tuple:
    a wide job's summary makes one per rank and statistic)."""

    value: float
    rank: int | None = None
    node: int | None = None
    gpu: int | None = None


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted values, linearly interpolated."""
    if not ordered:
        raise ValueError("quantile of no values")
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution(values: Sequence[float]) -> Distribution:
    """Count, mean and p10/p25/p50/p75/p90 of a non-empty series."""
    if not any(values):  # every value 0 (a phase the run does not have): nothing to sort
        if not values:
            raise ValueError("quantile of no values")
        return Distribution(len(values), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    ordered = sorted(values)
    last = len(ordered) - 1
    cut = []  # `quantile`, inline: a wide job's summary takes 70 000 distributions
    for q in _QUANTILES:
        pos = q * last
        low = int(pos)
        high = low + 1 if low < last else last
        cut.append(ordered[low] + (ordered[high] - ordered[low]) * (pos - low))
    return Distribution(len(ordered), math.fsum(ordered) / len(ordered), *cut)  # fmean's


_QUANTILES = (0.10, 0.25, 0.50, 0.75, 0.90)  # Distribution's p10 ... p90


def metric_stat(values: Sequence[Located], worst: Worst = "max") -> MetricStat | None:
    """Median and worst of located values; None when there are none (not measured)."""
    return located_stat([v.value for v in values], values.__getitem__, worst)


def located_stat(values: Sequence[float], where: Callable[[int], Located],
                 worst: Worst = "max") -> MetricStat | None:
    """:func:`metric_stat` of ``values``, the ``i``-th located by ``where(i)``: only the
    median's and the worst's (a wide job's summary has a value per rank and statistic).
    The median's is the lower median's; ties in the worst go to the first given."""
    if not values:
        return None
    order = sorted(range(len(values)), key=values.__getitem__)
    pick = max if worst == "max" else min
    bad = where(pick(range(len(values)), key=values.__getitem__))
    return MetricStat(
        median=statistics.median(values),
        worst=bad.value,
        median_rank=where(order[(len(order) - 1) // 2]).rank,
        worst_rank=bad.rank,
        worst_node=bad.node,
        worst_gpu=bad.gpu,
    )


def medians_of_others(values: Mapping[int, float]) -> dict[int, float]:
    """For every rank, the median of all *other* ranks' values: the straggler reference.

    With 2 ranks this is the other rank; with many, one slow rank cannot drag its
    own reference up. Needs at least 2 ranks; O(n log n) for large jobs.
    """
    if len(values) < 2:
        raise ValueError("medians_of_others needs at least two ranks")
    ordered = sorted(values.items(), key=lambda item: item[1])
    vals = [v for _, v in ordered]
    num_others = len(vals) - 1
    out = {}
    for pos, (rank, _) in enumerate(ordered):
        def other(i: int, pos: int = pos) -> float:
            return vals[i] if i < pos else vals[i + 1]

        half = num_others // 2
        out[rank] = other(half) if num_others % 2 else (other(half - 1) + other(half)) / 2
    return out


def median_without(ordered: Sequence[float], value: float) -> float:
    """The median of ``ordered`` (ascending, holding ``value``) with one ``value``
    left out: a rank's per-step reference among many, in O(log n)."""
    if len(ordered) < 2:
        raise ValueError("median_without needs the value and at least one other")
    pos = bisect.bisect_left(ordered, value)

    def other(i: int) -> float:
        return ordered[i] if i < pos else ordered[i + 1]

    num_others, half = len(ordered) - 1, (len(ordered) - 1) // 2
    return other(half) if num_others % 2 else (other(half - 1) + other(half)) / 2


def spread_sd(values: Sequence[float]) -> float:
    """The standard deviation a normal spread with the same interquartile range
    would have (IQR / 1.349): a few wild steps do not make a run noisy, and two
    clusters (ranks taking turns) read as the spread they are."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return (quantile(ordered, 0.75) - quantile(ordered, 0.25)) / IQR_PER_SD


IQR_PER_SD = 1.349
"""The interquartile range of normal noise is this many standard deviations."""


def thirds(values: Sequence[float]) -> tuple[float, float, float]:
    """Medians of the early, middle and late thirds of a series (>= 3 values)."""
    if len(values) < 3:
        raise ValueError("thirds needs at least three values")
    cut1, cut2 = len(values) // 3, (2 * len(values)) // 3
    parts = (values[:cut1], values[cut1:cut2], values[cut2:])
    early, middle, late = (statistics.median(p) for p in parts)
    return early, middle, late


@dataclass(frozen=True)
class Trend:
    """A least-squares line through a per-step series (index 0, 1, ...)."""

    start: float  # the line's value at the first step
    slope_per_step: float
    r2: float  # how steadily the series follows it: the variance the line explains, 0..1
    num_steps: int

    @property
    def growth(self) -> float:
        """The line's rise from the first step to the last."""
        return self.slope_per_step * (self.num_steps - 1)


def trend(values: Sequence[float]) -> Trend:
    """The least-squares line through ``values`` (>= 2 of them) and its R²."""
    n = len(values)
    if n < 2:
        raise ValueError("trend needs at least two values")
    x_mean, y_mean = (n - 1) / 2, statistics.fmean(values)
    xs = [i - x_mean for i in range(n)]
    ys = [v - y_mean for v in values]
    sxx = sum(map(operator.mul, xs, xs))
    sxy = sum(map(operator.mul, xs, ys))
    syy = sum(y ** 2 for y in ys)  # as ** rounds (libm's pow), not as y * y
    slope = sxy / sxx
    r2 = sxy * sxy / (sxx * syy) if syy > 0 else 0.0
    return Trend(y_mean - slope * x_mean, slope, r2, n)


def pct(part: float, whole: float) -> float | None:
    """``part`` as a percentage of ``whole``; None when ``whole`` is not positive."""
    return 100.0 * part / whole if whole > 0 else None


MOST_MARGIN = 0.05
"""A rank has "the most time" in a part when its value is over the median rank's by more
than this fraction (and 0.05 ms); within it the ranks are alike and none is named."""


def stands_out(worst: float, median: float) -> bool:
    """Whether the worst rank's value is clearly above the median rank's (MOST_MARGIN):
    the card's "Most time, by part" and the phase tables name a rank only then."""
    return worst > median * (1.0 + MOST_MARGIN) and worst - median >= 0.05
