"""Whether a rank's excess holds step by step (offline analysis).

Runs in the offline-analysis process (SPEC R-COMM-4).  A straggler found from
the ranks' means (`traceml.diagnosis.stragglers`) is named only when its excess
holds at the window's steps: at each step the rank's time in the part is
compared with the median of the other ranks' at that step; it must be slower in
at least ``STRAGGLER_MIN_SLOWER_PCT`` of the steps of each half of the window,
and its median per-step excess at least ``STRAGGLER_MIN_SIGNAL_TO_NOISE`` times
the step-to-step noise it is held against (`StepSeries.consistency`), over at
least ``STRAGGLER_MIN_STEPS`` steps.  A mean can come from a coin toss: two
ranks sharing two cores with their communication threads take turns being
slower, and their means differ while no rank is the cause.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from traceml.diagnosis import thresholds
from traceml.diagnosis.stats import median_without, medians_of_others, spread_sd


class StepTimes(Protocol):
    """What the step-by-step test reads of one rank (`step_time.RankStepTimes`)."""

    def per_step(self, phase: str) -> Mapping[int, float]: ...


@dataclass(frozen=True)
class Consistency:
    """How steadily one rank's excess held over the window's steps."""

    num_steps: int  # steps compared (the rank's typical steps other ranks also had)
    slower_pct: tuple[float, float]  # % of steps it was slower, in each half of the window
    median_excess_ms: float  # its typical per-step excess
    noise_ms: float  # the step-to-step noise it is held against (`StepSeries.consistency`)

    @property
    def decided(self) -> bool:
        """Enough steps to tell."""
        return self.num_steps >= thresholds.STRAGGLER_MIN_STEPS

    @property
    def holds(self) -> bool:
        """Slower in a clear majority of each half, by more than the noise."""
        return (self.decided and min(self.slower_pct) >= thresholds.STRAGGLER_MIN_SLOWER_PCT
                and self.median_excess_ms > 0.0
                and self.median_excess_ms
                >= thresholds.STRAGGLER_MIN_SIGNAL_TO_NOISE * self.noise_ms)


@dataclass
class StepSeries:
    """Every rank's per-step times, for testing an excess step by step: per part (or
    parts added up), each window step's values over the ranks, sorted once, so each
    rank's per-step reference (the median of the others) is a bisection."""

    times: Mapping[int, StepTimes]
    # Parts each rank has at steps of its own (CUDA's GPU times, on each rank's sample
    # of steps): compared with the other ranks' typical value, not step by step
    pooled: frozenset[str] = frozenset()
    _sorted: dict[tuple[str, ...], dict[int, list[float]]] = field(default_factory=dict)
    _noise: dict[tuple[str, ...], dict[int, float]] = field(default_factory=dict)
    _references: dict[tuple[str, ...], dict[int, float]] = field(default_factory=dict)

    def values(self, rank: int, parts: tuple[str, ...]) -> dict[int, float]:
        """One rank's time in ``parts`` (added up) at each of its typical steps."""
        columns = [self.times[rank].per_step(part) for part in parts]
        if len(columns) == 1:
            return dict(columns[0])
        return {step: sum(c[step] for c in columns) for step in columns[0]
                if all(step in c for c in columns)}

    def excesses(self, rank: int, parts: tuple[str, ...]) -> list[float]:
        """The rank's per-step excess over the other ranks' median, in step order.  For
        `pooled` parts, over the median of the other ranks' medians (their steps are
        not the rank's)."""
        if self.pooled.intersection(parts):
            return self._pooled_excesses(rank, parts)
        table = self._sorted.get(parts)
        if table is None:
            table = {}
            for other in self.times:
                for step, value in self.values(other, parts).items():
                    table.setdefault(step, []).append(value)
            for column in table.values():
                column.sort()
            self._sorted[parts] = table
        return [value - median_without(table[step], value)
                for step, value in sorted(self.values(rank, parts).items())
                if len(table[step]) >= 2]

    def _pooled_excesses(self, rank: int, parts: tuple[str, ...]) -> list[float]:
        references = self._references.get(parts)
        if references is None:
            medians = {r: statistics.median(v) for r in self.times
                       if (v := list(self.values(r, parts).values()))}
            references = medians_of_others(medians) if len(medians) >= 2 else {}
            self._references[parts] = references
        reference = references.get(rank)
        if reference is None:
            return []
        return [value - reference for _, value in sorted(self.values(rank, parts).items())]

    def own_noise_ms(self, rank: int, parts: tuple[str, ...]) -> float:
        """The median over the *other* ranks of their own step-to-step spread in
        ``parts``: how much a rank's time there moves by itself."""
        noise = self._noise.get(parts)
        if noise is None:
            spread = {r: spread_sd(list(self.values(r, parts).values())) for r in self.times}
            noise = medians_of_others(spread) if len(spread) >= 2 else {}
            self._noise[parts] = noise
        return noise.get(rank, 0.0)

    def consistency(self, rank: int, parts: tuple[str, ...]) -> Consistency:
        """How steadily ``rank``'s excess in ``parts`` held over the window.  Its
        noise is the smaller of two spreads: of its own per-step excess (a steady
        offset between ranks that swing together stands out from it) and of the
        other ranks' own times (an erratic rank whose excess never dips into the
        others' range stands out from that).  Ranks taking turns stand out from
        neither."""
        per_step = self.excesses(rank, parts)
        half = len(per_step) // 2
        halves = (per_step[:half], per_step[half:])
        slower = tuple(100.0 * sum(d > 0.0 for d in h) / len(h) if h else 0.0 for h in halves)
        noise = min(spread_sd(per_step), self.own_noise_ms(rank, parts))
        return Consistency(len(per_step), (slower[0], slower[1]),
                           statistics.median(per_step) if per_step else 0.0, noise)
