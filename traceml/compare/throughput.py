"""Throughput in the compare verdict: when the batch changed, samples/s decides (offline analysis).

Runs in the offline-analysis process (``traceml compare``). Step time says
which run is faster only while both runs take the same batch per step: a run
whose batch shrank takes shorter steps and may still train slower. So when the
samples (or tokens) per step of A and B differ by more than
:data:`BATCH_SAME_PCT`, the speed signal is throughput instead (tokens/s when
both runs measured tokens, else samples/s; medians over ranks): a drop beyond
``--threshold-pct`` and the step-to-step noise (as a share of A's step) is
worse, a rise better. With the same batch, the step-time signal stands as it is.
"""

from __future__ import annotations

import dataclasses

from traceml.compare.model import Direction, TimeChange
from traceml.compare.summary import SectionData

BATCH_SAME_PCT = 0.5
"""Samples (tokens) per step within this share of A's are the same batch."""


def _unit(a: SectionData, b: SectionData) -> tuple[str, str, str] | None:
    """(per-step key, per-second key, noun) both sides measured: tokens first."""
    for noun in ("tokens", "samples"):
        keys = (f"{noun}_per_step", f"{noun}_per_s")
        if all(side.stats.get(k) is not None for side in (a, b) for k in keys):
            return (*keys, noun)
    return None


def speed_change(time: TimeChange, a: SectionData | None, b: SectionData | None) -> TimeChange:
    """``time``, or the throughput signal when the batch per step changed (module docstring)."""
    unit = _unit(a, b) if a is not None and b is not None else None
    if unit is None or a is None or b is None:
        return time
    per_step, per_s, noun = unit
    a_n, b_n = a.stats[per_step], b.stats[per_step]
    a_rate, b_rate = a.stats[per_s], b.stats[per_s]
    assert a_n is not None and b_n is not None and a_rate is not None and b_rate is not None
    if not a_n or not a_rate or abs(b_n - a_n) <= BATCH_SAME_PCT / 100.0 * a_n:
        return time
    noise_pct = (100.0 * time.noise_ms / time.a_ms
                 if time.noise_ms is not None and time.a_ms else 0.0)
    gate_pct = max(time.threshold_pct, noise_pct)
    delta_pct = 100.0 * (b_rate - a_rate) / a_rate
    batch = f"the batch went from {a_n:,.4g} to {b_n:,.4g} {noun} per step"
    span = f"({a_rate:,.4g} -> {b_rate:,.4g} {noun}/s)"
    direction: Direction = "same"
    if abs(delta_pct) <= gate_pct:
        why = (f"{noun}/s moved {delta_pct:+.1f}% {span}, within the {gate_pct:.1f}% gate; "
               f"{batch}, so throughput, not step time, tells the speed")
    else:
        direction = "worse" if delta_pct < 0 else "better"
        verb = "fell" if delta_pct < 0 else "rose"
        why = (f"{noun}/s {verb} {abs(delta_pct):.1f}% {span} while {batch} (step time "
               f"{_step_text(time)}): throughput, not step time, tells the speed")
    return dataclasses.replace(time, direction=direction, why=why)


def _step_text(time: TimeChange) -> str:
    if time.a_ms is None or time.b_ms is None:
        return "not compared"
    return f"{time.a_ms:.1f} -> {time.b_ms:.1f} ms"
