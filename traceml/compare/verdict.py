"""The compare verdict: noise-gated step time, memory growth, and how they combine
(offline analysis).

Runs in the offline-analysis process. Small pure functions over the typed
summary view and the named thresholds below (documented in docs/compare.md).

Step time (SPEC R-CMP-2). Each run's step time is the median over ranks of the
rank's mean step (the number the table shows). A change between A and B counts
only when all of these hold:

1. it exceeds the relative threshold: ``--threshold-pct`` (default 5 %) of A's
   step time;
2. it exceeds the runs' own step-to-step spread: the larger of A's and B's
   interquartile range (p75 - p25 of the per-step totals, median over ranks),
   times :data:`NOISE_IQR_FACTOR`;
3. the body of the distribution moved, not a few outliers: at least one of the
   median-over-ranks p25, p50, p75 or p90 moved past both gates in the same
   direction. A single long pause (garbage collection, a checkpoint) moves the
   mean but none of these; a slowdown of 10 % or more of the steps moves p90.

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

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from traceml.compare.model import Direction, MemoryChange, TimeChange, Verdict, VerdictLabel
from traceml.compare.summary import SectionData
from traceml.diagnosis.finding import format_bytes
from traceml.diagnosis.stats import Distribution

MIB = 1024 * 1024

STEP_TIME_THRESHOLD_PCT = 5.0
"""Default ``--threshold-pct``: a step-time change below this share of A's step is no change."""

NOISE_IQR_FACTOR = 1.0
"""A step-time change must exceed this many interquartile ranges of the noisier run."""

BODY_QUANTILES = ("p25", "p50", "p75", "p90")
"""At least one of these (median over ranks) must move past both gates with the mean."""

MEMORY_CHANGE_PCT = 10.0
"""A peak-memory change below this share of A's peak is no change..."""

MEMORY_CHANGE_MIN_BYTES = 64 * MIB
"""...and so is one below this many bytes (allocator rounding, library buffers)."""

MEMORY_METRICS = (("peak_reserved_bytes", "peak device memory reserved"),
                  ("rss_peak_bytes", "peak host RSS"))
"""Step Memory stats that decide the memory signal, in order of precedence."""

CREEP_KINDS = {"MEMORY_CREEP": "device memory creep", "RSS_CREEP": "host RSS creep"}

ATTRIBUTION_PHASES = ("input", "forward", "backward", "optimizer", "wait")
"""Phases the why line can name as the main part of a step-time change."""


@dataclass(frozen=True)
class StepSignal:
    """One run's step-time distribution, summarised over ranks (medians over ranks)."""

    mean_ms: float
    quantiles_ms: Mapping[str, float]  # "p10".."p90"
    iqr_ms: float


def step_signal(dists: Sequence[Distribution]) -> StepSignal | None:
    """The median over ranks of each rank's mean, quantiles and IQR; None without ranks."""
    if not dists:
        return None
    quantiles = {q: statistics.median(getattr(d, q) for d in dists)
                 for q in ("p10", "p25", "p50", "p75", "p90")}
    return StepSignal(
        mean_ms=statistics.median(d.mean for d in dists),
        quantiles_ms=quantiles,
        iqr_ms=statistics.median(d.p75 - d.p25 for d in dists),
    )


def gates_ms(a: StepSignal, b: StepSignal, threshold_pct: float) -> tuple[float, float]:
    """(relative threshold, noise spread) in ms that a step-time change must exceed."""
    return threshold_pct / 100.0 * a.mean_ms, NOISE_IQR_FACTOR * max(a.iqr_ms, b.iqr_ms)


def exceeds(delta: float, threshold: float, spread: float) -> bool:
    """True when ``delta`` is larger than both gates."""
    return abs(delta) > threshold and abs(delta) > spread


def body_moved(a: StepSignal, b: StepSignal, threshold_ms: float, spread_ms: float) -> bool:
    """True when a body quantile moved past both gates in the direction of the mean."""
    sign = 1.0 if b.mean_ms >= a.mean_ms else -1.0
    for q in BODY_QUANTILES:
        delta = b.quantiles_ms[q] - a.quantiles_ms[q]
        if delta * sign > 0 and exceeds(delta, threshold_ms, spread_ms):
            return True
    return False


def time_change(a: SectionData | None, b: SectionData | None, threshold_pct: float) -> TimeChange:
    """The step-time signal between two Step Time sections (see the module docstring)."""
    missing = _time_unknown_why(a, b)
    sig_a = step_signal(a.rank_dists.get("total_ms", ())) if a else None
    sig_b = step_signal(b.rank_dists.get("total_ms", ())) if b else None
    if missing or a is None or b is None or sig_a is None or sig_b is None:
        why = missing or "step time could not be compared: a summary has no per-rank step times"
        return TimeChange("unknown", None, None, None, None, False, None, None, why)
    threshold_ms, spread_ms = gates_ms(sig_a, sig_b, threshold_pct)
    delta = sig_b.mean_ms - sig_a.mean_ms
    moved = body_moved(sig_a, sig_b, threshold_ms, spread_ms)
    counts = exceeds(delta, threshold_ms, spread_ms) and moved
    direction: Direction = "same" if not counts else ("worse" if delta > 0 else "better")
    phase, phase_delta = leading_phase(a.stats, b.stats, delta)
    change = TimeChange(direction, sig_a.mean_ms, sig_b.mean_ms, threshold_ms, spread_ms, moved,
                        phase, phase_delta, "")
    return _with_why(change, _time_why(change, threshold_pct))


def _with_why(change: TimeChange, why: str) -> TimeChange:
    return TimeChange(change.direction, change.a_ms, change.b_ms, change.threshold_ms,
                      change.spread_ms, change.body_moved, change.phase, change.phase_delta_ms, why)


def _time_unknown_why(a: SectionData | None, b: SectionData | None) -> str | None:
    for side, section in (("A", a), ("B", b)):
        if section is None:
            return f"step time could not be compared: {side} has no Step Time section"
        if not section.measured:
            return f"step time could not be compared: it was not measured in {side}"
    return None


def leading_phase(a_stats: Mapping[str, float | None], b_stats: Mapping[str, float | None],
                  delta_ms: float) -> tuple[str | None, float | None]:
    """The phase whose mean moved most in the direction of ``delta_ms``, and by how much."""
    best: tuple[str | None, float | None] = (None, None)
    for phase in ATTRIBUTION_PHASES:
        a_ms, b_ms = a_stats.get(f"{phase}_ms"), b_stats.get(f"{phase}_ms")
        if a_ms is None or b_ms is None:
            continue
        moved = b_ms - a_ms
        if moved * delta_ms > 0 and (best[1] is None or abs(moved) > abs(best[1])):
            best = (phase, moved)
    return best


def _time_why(change: TimeChange, threshold_pct: float) -> str:
    assert change.a_ms is not None and change.b_ms is not None and change.spread_ms is not None
    pct = change.delta_pct or 0.0
    span = f"({change.a_ms:.1f} -> {change.b_ms:.1f} ms per step)"
    spread = f"the runs' step-to-step spread (IQR {change.spread_ms:.1f} ms)"
    if change.direction in ("worse", "better"):
        verb = "rose" if change.direction == "worse" else "fell"
        text = (f"step time {verb} {abs(pct):.1f}% {span}, beyond the {threshold_pct:g}% "
                f"threshold and {spread}")
        if change.phase is not None and change.phase_delta_ms is not None:
            text += f"; most of it is {change.phase} time ({change.phase_delta_ms:+.1f} ms)"
        return text
    moved = f"step time moved {pct:+.1f}% {span}"
    delta = abs(change.b_ms - change.a_ms)
    if change.threshold_ms is not None and delta <= change.threshold_ms:
        return f"{moved}, within the {threshold_pct:g}% threshold"
    if delta <= change.spread_ms:
        return f"{moved}, within {spread}"
    return f"{moved}, but only in a few outlier steps (p25 to p90 stayed within noise)"


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
