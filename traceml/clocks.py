"""Clock offsets between nodes, from request/response exchanges (shared: a node's
launcher exchanges, node 0's collector answers and stores, the summary estimates).

Hosts' clocks disagree (NTP leaves milliseconds), so "r7 began 3 ms late" across
nodes can be the clocks.  A node other than node 0 measures its clock against node
0's over the join channel it already has: it sends at ``t1`` (its clock), node 0
stamps the request's arrival ``t2`` and its answer ``t3`` (node 0's clock), and the
answer arrives at ``t4``.  Then, as NTP reads its four times, the node's clock minus
node 0's is ``((t1 - t2) + (t4 - t3)) / 2``, and the true difference lies within half
the round trip ``(t4 - t1) - (t3 - t2)`` of it, whatever the two ways' delays: the
exchange with the least round trip bounds it best.  A burst of exchanges runs when a
node joins, then again at growing intervals (`SYNC_INTERVALS_S`); each burst's best
exchange is stored, and the summary fits the drift over them.

Standard library only.  A test-only skew (`traceml.environment.clock_skew_for_tests_s`)
shifts the clock of a launcher's exchanges and of its ranks' step times: two launchers
on one host then act as two nodes whose clocks disagree.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

EXCHANGES_PER_BURST = 8
SYNC_INTERVALS_S = (30.0, 60.0, 120.0, 300.0, 600.0)  # between bursts; then the last again
MIN_DRIFT_SPAN_S = 60.0
"""The drift is fitted once the bursts' best exchanges span this long (and there are
MIN_DRIFT_BURSTS of them); before, None."""


def wall_offset_s(skew_s: float = 0.0) -> float:
    """What to add to ``time.perf_counter()`` for this host's wall clock (unix seconds),
    read once: later readings follow the monotonic clock, not a step of NTP.  ``skew_s``:
    the test-only skew (`traceml.environment.clock_skew_for_tests_s`)."""
    return time.time() - time.perf_counter() + skew_s


def wall_clock(skew_s: float = 0.0) -> Callable[[], float]:
    """This host's wall clock as traceml reads it (unix seconds; see `wall_offset_s`)."""
    offset = wall_offset_s(skew_s)
    return lambda: time.perf_counter() + offset


@dataclass(frozen=True)
class Exchange:
    """One request and its answer: sent at ``t1`` and answered at ``t4`` (the node's
    clock), received at ``t2`` and answered at ``t3`` (node 0's)."""

    t1: float
    t2: float
    t3: float
    t4: float

    @property
    def offset_s(self) -> float:
        """The node's clock minus node 0's."""
        return ((self.t1 - self.t2) + (self.t4 - self.t3)) / 2

    @property
    def round_trip_s(self) -> float:
        """Time on the way there and back (node 0's own time taken out)."""
        return (self.t4 - self.t1) - (self.t3 - self.t2)

    def whole(self) -> bool:
        """Times in order on each side (a clock stepped mid-exchange is not)."""
        return self.t4 >= self.t1 and self.t3 >= self.t2 and self.round_trip_s >= 0


def best(exchanges: Sequence[Exchange]) -> Exchange | None:
    """The whole exchange with the least round trip (the first of equals); None without one."""
    whole = [e for e in exchanges if e.whole()]
    return min(whole, key=lambda e: e.round_trip_s) if whole else None


@dataclass(frozen=True)
class NodeClock:
    """A node's clock against the reference node's (the collector's) over a run."""

    offset_ms: float  # the node's clock minus the reference's, by the exchange with the
    # least round trip (the drift moves it from there)
    uncertainty_ms: float  # half that round trip: the offset then lay within offset ± this
    measured_at: float | None  # when (unix seconds, the reference's clock); None: the reference
    num_bursts: int  # bursts whose best exchange was stored
    drift_ppm: float | None  # the offset's change per second of the reference's clock, in
    # millionths, fitted over the bursts; None: under MIN_DRIFT_BURSTS bursts, or under
    # MIN_DRIFT_SPAN_S apart


REFERENCE = NodeClock(0.0, 0.0, None, 0, None)
"""The reference node's own clock."""

MIN_DRIFT_BURSTS = 3
DRIFT_MAX_TRIP = 3.0
"""Bursts whose best round trip is over this many times the least are left out of the
drift fit (a queued answer's offset is off by up to half its round trip)."""


def estimate(bursts: Sequence[Exchange]) -> NodeClock | None:
    """A node's clock from its bursts' best exchanges; None when none is whole."""
    whole = [e for e in bursts if e.whole()]
    chosen = best(whole)
    if chosen is None:
        return None
    drift = None
    fit = [e for e in whole if e.round_trip_s <= DRIFT_MAX_TRIP * chosen.round_trip_s]
    times = [e.t2 for e in fit]
    if len(fit) >= MIN_DRIFT_BURSTS and max(times) - min(times) >= MIN_DRIFT_SPAN_S:
        slope, _ = statistics.linear_regression(times, [e.offset_s for e in fit])
        drift = slope * 1e6
    return NodeClock(chosen.offset_s * 1e3, chosen.round_trip_s / 2 * 1e3, chosen.t2,
                     len(whole), drift)


UNKNOWN_DRIFT_PPM = 50.0
"""How far a clock may have drifted per second since its offset was measured, when its
drift was not measured (an undisciplined quartz clock's tolerance): it widens the
uncertainty with the time between that measurement and the window."""


def offset_at(clock: NodeClock, t: float) -> tuple[float, float]:
    """A node's offset (s) at ``t`` and its uncertainty (ms): the measured offset moved
    by the drift since, the uncertainty widened by the time since (`UNKNOWN_DRIFT_PPM`
    when the drift is not measured; a fifth of the drift's own move when it is)."""
    since = 0.0 if clock.measured_at is None else t - clock.measured_at
    if clock.drift_ppm is None:
        return clock.offset_ms / 1e3, clock.uncertainty_ms + UNKNOWN_DRIFT_PPM * abs(since) / 1e3
    moved = clock.drift_ppm * 1e-6 * since
    return clock.offset_ms / 1e3 + moved, clock.uncertainty_ms + 0.2 * abs(moved) * 1e3
