"""The compare verdict: noise-gated step time, memory growth, and how they combine
(offline analysis).

Runs in the offline-analysis process. Small pure functions over the typed
summary view and the named thresholds below (documented in docs/compare.md).

Step time (SPEC R-CMP-2). Each run has a mean step (the number the table
shows: how long a step takes on average, i.e. throughput) and a median step
(p50: the typical step), each the median over ranks. A change between A and B
counts only when *both* moved the same way and each moved by more than

1. the relative threshold: ``--threshold-pct`` (default 5 %) of A's value, and
2. the runs' step-to-step noise: how far the per-step spread alone can move a
   run's median step, ``NOISE_Z * sqrt(se_A**2 + se_B**2)`` with
   ``se = 1.2533 * (IQR / 1.349) / sqrt(steps)`` - the standard error of a median,
   with the step-to-step standard deviation estimated from the interquartile
   range (p75 - p25 of the per-step totals) so a few very slow steps do not
   inflate it. Few steps or a wide spread give a wide gate.

Requiring the median too keeps a few long pauses (garbage collection, a
checkpoint, a noisy neighbour on the CPU) from reading as a slowdown: they move
the mean, not the typical step. The price: a slowdown confined to fewer than
half of the steps is not reported as a change (the table still shows it).
Requiring the mean too keeps a median that flips between two modes of a
bimodal step from reading as a change. The relative threshold absorbs
run-to-run differences of the machine that no single run can show.

Memory. The runs' peaks (device peak reserved, and host RSS peak so CPU-only
runs compare too) move when the change exceeds both
:data:`MEMORY_CHANGE_PCT` of A's peak and :data:`MEMORY_CHANGE_MIN_BYTES`.
Creep (MEMORY CREEP, HOST RSS CREEP) appearing in B counts as growth, creep
gone as shrinkage.

Combination: any signal worse and another better - MIXED; worse - REGRESSION;
better - IMPROVEMENT; step time compared and nothing moved - NO CHANGE;
step time not comparable and memory unmoved or unknown - INCONCLUSIVE.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from traceml import phases
from traceml.compare.model import Direction, MemoryChange, TimeChange, Verdict, VerdictLabel
from traceml.compare.summary import SectionData
from traceml.diagnosis import thresholds
from traceml.diagnosis.finding import format_bytes
from traceml.diagnosis.stats import Distribution

MIB = 1024 * 1024

STEP_TIME_THRESHOLD_PCT = 5.0
"""Default ``--threshold-pct``: a step-time change below this share of A's step is no change."""

NOISE_Z = 3.0
"""A step-time change must exceed this many standard errors of the difference of medians."""

MEDIAN_SE_FACTOR = 1.2533
"""sqrt(pi / 2): standard error of a median = this * standard deviation / sqrt(n)."""

IQR_PER_SIGMA = 1.349
"""Interquartile range of a normal distribution in standard deviations."""

MEMORY_CHANGE_PCT = 10.0
"""A peak-memory change below this share of A's peak is no change..."""

MEMORY_CHANGE_MIN_BYTES = 64 * MIB
"""...and so is one below this many bytes (allocator rounding, library buffers)."""

MEMORY_METRICS = (("peak_reserved_bytes", "peak device memory reserved"),
                  ("rss_peak_bytes", "peak host RSS"))
"""Step Memory stats that decide the memory signal, in order of precedence."""

CREEP_KINDS = {"MEMORY_CREEP": "device memory creep", "RSS_CREEP": "host RSS creep"}

ATTRIBUTION_PHASES = tuple(p.name for p in phases.stacked())
"""Phases the why line can name as the main part of a step-time change."""

WAITING_PHASES = frozenset(p.name for p in phases.PHASES if p.waits)
"""Of those, the time blocked on collectives: waiting for other ranks (a comm hook's
own work is not)."""


@dataclass(frozen=True)
class StepSignal:
    """One run's step-time distribution, summarised over ranks (medians over ranks)."""

    mean_ms: float
    p50_ms: float
    iqr_ms: float
    num_steps: int

    @property
    def median_se_ms(self) -> float:
        """Standard error of the median step, from the IQR and the number of steps."""
        return MEDIAN_SE_FACTOR * (self.iqr_ms / IQR_PER_SIGMA) / math.sqrt(self.num_steps)


def step_signal(dists: Sequence[Distribution]) -> StepSignal | None:
    """The median over ranks of each rank's mean, p50, IQR and step count; None without ranks."""
    if not dists:
        return None
    return StepSignal(
        mean_ms=statistics.median(d.mean for d in dists),
        p50_ms=statistics.median(d.p50 for d in dists),
        iqr_ms=statistics.median(d.p75 - d.p25 for d in dists),
        num_steps=max(1, int(statistics.median(d.count for d in dists))),
    )


def noise_ms(a: StepSignal, b: StepSignal) -> float:
    """How far step-to-step noise alone can move the difference of the two median steps."""
    return NOISE_Z * math.hypot(a.median_se_ms, b.median_se_ms)


def exceeds(delta: float, threshold: float, noise: float) -> bool:
    """True when ``delta`` is larger than both gates."""
    return abs(delta) > threshold and abs(delta) > noise


def moved(a_ms: float, b_ms: float, threshold_pct: float, noise: float) -> float:
    """B - A when it exceeds ``threshold_pct`` of A and ``noise``; else 0."""
    delta = b_ms - a_ms
    return delta if exceeds(delta, threshold_pct / 100.0 * a_ms, noise) else 0.0


def time_change(a: SectionData | None, b: SectionData | None, threshold_pct: float) -> TimeChange:
    """The step-time signal between two Step Time sections (see the module docstring)."""
    missing = _time_unknown_why(a, b)
    sig_a = step_signal(a.rank_dists.get("total_ms", ())) if a else None
    sig_b = step_signal(b.rank_dists.get("total_ms", ())) if b else None
    if missing or a is None or b is None or sig_a is None or sig_b is None:
        why = missing or "step time could not be compared: a summary has no per-rank step times"
        return TimeChange("unknown", None, None, None, None, threshold_pct, None, False, None,
                          None, why)
    noise = noise_ms(sig_a, sig_b)
    mean_delta = moved(sig_a.mean_ms, sig_b.mean_ms, threshold_pct, noise)
    median_delta = moved(sig_a.p50_ms, sig_b.p50_ms, threshold_pct, noise)
    direction: Direction = "same"
    if mean_delta * median_delta > 0:
        direction = "worse" if mean_delta > 0 else "better"
    phase, phase_delta = leading_phase(a.stats, b.stats, sig_b.mean_ms - sig_a.mean_ms)
    change = TimeChange(direction, sig_a.mean_ms, sig_b.mean_ms, sig_a.p50_ms, sig_b.p50_ms,
                        threshold_pct, noise, median_delta * (sig_b.mean_ms - sig_a.mean_ms) > 0,
                        phase, phase_delta, "")
    return dataclasses.replace(change, why=_time_why(change))


def _time_unknown_why(a: SectionData | None, b: SectionData | None) -> str | None:
    for side, section in (("A", a), ("B", b)):
        if section is None:
            return f"step time could not be compared: {side} has no Step Time section"
        if not section.measured:
            return f"step time could not be compared: it was not measured in {side}"
    return None


def leading_phase(a_stats: Mapping[str, float | None], b_stats: Mapping[str, float | None],
                  delta_ms: float) -> tuple[str | None, float | None]:
    """The phase whose mean moved most in the direction of ``delta_ms``, and by how much.

    A waiting phase is named only when no phase of the ranks' own work moved by
    at least ``STRAGGLER_EXPLAINS_FRACTION`` of it: time waiting in a collective
    mirrors other ranks' own work (a slow rank's input is its peers' communication),
    so fixing a straggler moves both, and the cause is the own-work phase."""
    moves = {}
    for phase in ATTRIBUTION_PHASES:
        a_ms, b_ms = a_stats.get(f"{phase}_ms"), b_stats.get(f"{phase}_ms")
        if a_ms is not None and b_ms is not None and (b_ms - a_ms) * delta_ms > 0:
            moves[phase] = b_ms - a_ms
    if not moves:
        return None, None
    best = max(moves, key=lambda p: abs(moves[p]))
    own = [p for p in moves if p not in WAITING_PHASES]
    if best in WAITING_PHASES and own:
        own_best = max(own, key=lambda p: abs(moves[p]))
        if abs(moves[own_best]) >= thresholds.STRAGGLER_EXPLAINS_FRACTION * abs(moves[best]):
            best = own_best
    return best, moves[best]


def _time_why(change: TimeChange) -> str:
    assert change.a_ms is not None and change.b_ms is not None and change.noise_ms is not None
    pct = change.delta_pct or 0.0
    span = f"({change.a_ms:.1f} -> {change.b_ms:.1f} ms per step)"
    noise = f"the runs' step-to-step noise ({change.noise_ms:.1f} ms)"
    threshold = f"the {change.threshold_pct:g}% threshold"
    if change.direction in ("worse", "better"):
        verb = "rose" if change.direction == "worse" else "fell"
        text = f"step time {verb} {abs(pct):.1f}% {span}, beyond {threshold} and {noise}"
        if change.phase is not None and change.phase_delta_ms is not None:
            text += f"; most of it is {change.phase} time ({change.phase_delta_ms:+.1f} ms)"
        return text
    text = f"step time moved {pct:+.1f}% {span}"
    delta = abs(change.b_ms - change.a_ms)
    if change.threshold_ms is not None and delta <= change.threshold_ms:
        return f"{text}, within {threshold}"
    if delta <= change.noise_ms:
        return f"{text}, within {noise}"
    assert change.a_p50_ms is not None and change.b_p50_ms is not None
    return (f"{text}, but the median step did not move with it ({change.a_p50_ms:.1f} -> "
            f"{change.b_p50_ms:.1f} ms): a few slow steps, not the typical step")


def memory_change(a: SectionData | None, b: SectionData | None) -> MemoryChange:
    """The memory signal between two Step Memory sections (see the module docstring):
    the first peak that moved worse, else better (creep after peaks), else unchanged."""
    if missing := _memory_unknown_why(a, b):
        return _unknown_memory(missing)
    assert a is not None and b is not None
    moves = [_peak_move(key, label, a.stats.get(key), b.stats.get(key))
             for key, label in MEMORY_METRICS]
    compared = [m for m in moves if m is not None]
    creep = _creep_move(a.finding_kinds, b.finding_kinds)
    candidates = compared + ([creep] if creep else [])
    for wanted in ("worse", "better"):
        for move in candidates:
            if move.direction == wanted:
                return move
    if compared:
        return compared[0]
    return _unknown_memory("memory could not be compared: A and B measured different "
                           "memory signals")


def _memory_unknown_why(a: SectionData | None, b: SectionData | None) -> str | None:
    for side, section in (("A", a), ("B", b)):
        if section is None:
            return f"memory could not be compared: {side} has no Step Memory section"
        if not section.measured:
            return f"memory could not be compared: it was not measured in {side}"
    return None


def _unknown_memory(why: str) -> MemoryChange:
    return MemoryChange("unknown", None, None, None, None, why)


def _peak_move(key: str, label: str, a_bytes: float | None,
               b_bytes: float | None) -> MemoryChange | None:
    """One peak's move; None when either side did not measure it."""
    if a_bytes is None or b_bytes is None:
        return None
    delta = b_bytes - a_bytes
    gate = max(MEMORY_CHANGE_MIN_BYTES, MEMORY_CHANGE_PCT / 100.0 * a_bytes)
    span = f"({format_bytes(a_bytes)} -> {format_bytes(b_bytes)})"
    if abs(delta) <= gate:
        return MemoryChange("same", key, label, a_bytes, b_bytes, f"{label} unchanged {span}")
    pct = f" {abs(100.0 * delta / a_bytes):.1f}%" if a_bytes else ""
    direction: Direction = "worse" if delta > 0 else "better"
    verb = "grew" if delta > 0 else "fell"
    return MemoryChange(direction, key, label, a_bytes, b_bytes, f"{label} {verb}{pct} {span}")


def _creep_move(a_kinds: Sequence[str], b_kinds: Sequence[str]) -> MemoryChange | None:
    """Creep that appeared in B (worse) or is gone in B (better); None otherwise."""
    for kind, label in CREEP_KINDS.items():
        if kind in b_kinds and kind not in a_kinds:
            return MemoryChange("worse", None, label, None, None, f"{label} appeared in B")
        if kind in a_kinds and kind not in b_kinds:
            return MemoryChange("better", None, label, None, None, f"{label} is gone in B")
    return None


def decide(time: Direction, memory: Direction) -> VerdictLabel:
    """The verdict from the two signals (see the module docstring)."""
    moved = {time, memory}
    if {"worse", "better"} <= moved:
        return "MIXED"
    if "worse" in moved:
        return "REGRESSION"
    if "better" in moved:
        return "IMPROVEMENT"
    return "NO CHANGE" if time == "same" else "INCONCLUSIVE"


def verdict(time: TimeChange, memory: MemoryChange) -> Verdict:
    """The verdict and its one-line why: the clauses of the signals that moved, then
    what step time did when only memory moved; with nothing moved, why not."""
    label = decide(time.direction, memory.direction)
    moved = [s.why for s in (time, memory) if s.direction in ("worse", "better")]
    if label == "MIXED":
        why = " but ".join(moved)
    elif moved:
        why = "; ".join(moved if time.why in moved else [*moved, time.why])
    else:
        why = "; ".join([time.why] + ([memory.why] if time.direction == "unknown" else []))
    return Verdict(label, why[:1].upper() + why[1:] + ".")
