"""Arrival skew at collectives (`traceml.diagnosis.arrival`) on hand-built 1-, 2- and
8-rank windows: who came last into each step's first collective and how late, across
nodes whose clocks disagree (offsets measured, or not: then not measured), and the
straggler finding that cites it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.rows import row_of
from traceml.clocks import REFERENCE, NodeClock
from traceml.diagnosis.arrival import arrival_skew
from traceml.diagnosis.window import select_window
from traceml.records import NodeInfo, RunData, RunMeta, StepRow
from traceml.report import build_report

T0 = 1_700_000_000.0
STEPS = 30


def rows(world: int, arrives_ms: Callable[[int, int], float | None],
         node_of: Callable[[int], int] = lambda r: 0, clock_ahead_s: Callable[[int], float] =
         lambda n: 0.0, backward_ms: Callable[[int], float] = lambda r: 40.0) -> list[StepRow]:
    """Every rank's steps begin together every 100 ms (on node 0's clock; a node's stored
    times read ``clock_ahead_s`` of it ahead) and launch their first collective
    ``arrives_ms(rank, step)`` later (None: none timed)."""
    out = []
    for r in range(world):
        node = node_of(r)
        for s in range(STEPS):
            at = arrives_ms(r, s)
            begin = T0 + s * 0.1 + clock_ahead_s(node)
            out.append(row_of(r, s, {"forward": 20.0, "backward": backward_ms(r)}, 100.0,
                              40.0 - backward_ms(r) + 40.0, t=begin + 0.1, node_rank=node,
                              collective_at_ms=at, collective_ms=10.0))
    return out


def skew(world: int, arrives_ms: Callable[[int, int], float | None],
         node_of: Callable[[int], int] = lambda r: 0,
         clocks: dict[int, NodeClock | None] | None = None,
         clock_ahead_s: Callable[[int], float] = lambda n: 0.0) -> object:
    window = select_window(rows(world, arrives_ms, node_of, clock_ahead_s), 10_000, world)
    return arrival_skew(window, clocks or {})


def test_one_rank_has_no_arrival_skew() -> None:
    assert skew(1, lambda r, s: 5.0) is None


def test_two_ranks_the_late_one_is_named_with_its_lateness() -> None:
    # r1 arrives 12 ms after r0, but at step 20 r0 is 3 ms late
    found = skew(2, lambda r, s: (8.0 if r == 0 else 5.0) if s == 20 else 5.0 + 12.0 * r)
    assert found is not None
    assert (found.last_rank, found.num_steps) == (1, 27)  # 30 steps less 3 of warm-up
    assert found.last_pct == pytest.approx(100.0 * 26 / 27)
    assert found.median_ms == pytest.approx(12.0, abs=1e-3)
    assert (found.worst_ms, found.worst_rank) == (pytest.approx(12.0, abs=1e-3), 1)
    assert found.uncertainty_ms == 0.0


def test_eight_ranks_on_two_nodes_are_aligned_by_the_measured_offset() -> None:
    """Ranks 4-7 on node 1, whose clock reads 250 ms ahead: r6 comes 8 ms late; without
    the offset every rank of node 1 would look 250 ms late."""
    def node_of(r: int) -> int:
        return r // 4

    def arrives(r: int, s: int) -> float:
        return 13.0 if r == 6 else 5.0 + 0.1 * r

    ahead = {0: 0.0, 1: 0.25}
    clocks: dict[int, NodeClock | None] = {0: REFERENCE, 1: NodeClock(250.0, 0.1, T0, 3, None)}
    found = skew(8, arrives, node_of, clocks, ahead.__getitem__)
    assert found is not None
    assert found.last_rank == 6 and found.last_pct == 100.0
    assert found.median_ms == pytest.approx(8.0, abs=1e-3)
    # 0.1 ms when measured, widened by 50 ppm over the ~1.7 s to the window's middle
    assert 0.1 < found.uncertainty_ms < 0.3
    # the clocks unmeasured: not measured, never "r4-r7 were 250 ms late"
    assert skew(8, arrives, node_of, {0: REFERENCE, 1: None}, ahead.__getitem__) is None
    # one node: no offset needed
    same = skew(8, arrives)
    assert same is not None and same.median_ms == pytest.approx(8.0, abs=1e-3)


def test_a_rank_later_than_the_clocks_can_tell_is_not_named() -> None:
    """Node 1's offset is known to +/- 5 ms: r6 arriving 3 ms late could be the clocks."""
    def arrives(r: int, s: int) -> float:
        return 8.0 if r == 6 else 5.0

    clocks: dict[int, NodeClock | None] = {0: REFERENCE, 1: NodeClock(250.0, 5.0, T0, 3, None)}
    found = skew(8, arrives, lambda r: r // 4, clocks, {0: 0.0, 1: 0.25}.__getitem__)
    assert found is not None and found.median_ms == pytest.approx(3.0, abs=1e-3)
    assert (found.last_rank, found.last_pct, found.worst_rank) == (None, 0.0, None)
    # the same 3 ms on one host (one clock): r6 is named
    same = skew(8, arrives)
    assert same is not None and (same.last_rank, same.last_pct) == (6, 100.0)


def test_equal_arrivals_name_no_rank() -> None:
    found = skew(2, lambda r, s: 5.0)
    assert found is not None and found.median_ms == 0.0 and found.last_rank is None


def test_steps_renumbered_on_one_rank_are_not_compared() -> None:
    """r1 lost an events batch: its step k is iteration k+1 (100 ms later), after r0's
    step k ended. Compared by index it would read 100 ms late at every step."""
    steps = rows(2, lambda r, s: 5.0 + 2.0 * r)
    shifted = [r.replace(step=r.step - 1) if r.rank == 1 else r for r in steps
               if not (r.rank == 1 and r.step == 0)]
    assert arrival_skew(select_window(shifted, 10_000, 2), {}) is None


def test_fewer_than_five_steps_are_not_measured() -> None:
    assert skew(2, lambda r, s: 5.0 + r if s < 7 else None) is None  # steps 3-6: four
    assert skew(2, lambda r, s: 5.0 + r if s < 8 else None) is not None


def test_steps_a_rank_timed_no_collective_in_are_left_out() -> None:
    found = skew(2, lambda r, s: None if (r == 1 and s % 2) else 5.0 + 3.0 * r)
    assert found is not None and found.num_steps == 13  # the even steps after warm-up
    assert skew(2, lambda r, s: None if r == 1 else 5.0) is None


def test_the_straggler_finding_cites_the_arrivals() -> None:
    """r1 computes 30 ms more in backward and so launches its first bucket 30 ms later;
    r0 waits for it in the all-reduce (communication)."""
    steps = tuple(row_of(r, s, {"forward": 20.0, "backward": 70.0 if r == 1 else 40.0,
                                "communication": 2.0 if r == 1 else 32.0}, 100.0, 8.0,
                         t=T0 + s * 0.1 + 0.1, collective_at_ms=35.0 + 30.0 * r,
                         collective_ms=40.0)
                  for r in range(2) for s in range(STEPS))
    meta = RunMeta(session_id="s", command=["train.py"], started_at=T0, ended_at=T0 + 10,
                   exit_code=0, partial=False, world_size=2, missing_ranks=(),
                   nodes=(NodeInfo(0, "h", (0, 1)),), device="cpu", versions={}, transport={})
    section = build_report(RunData(meta, steps, (), ()), 10_000).step_time
    assert section.arrival is not None and section.arrival.last_rank == 1
    straggler = section.diagnosis
    assert straggler.kind == "COMPUTE_STRAGGLER" and straggler.ranks[0] == 1
    assert "r1 entered the step's collectives last at 100% of 27 steps" in straggler.why
    assert straggler.evidence["arrival_skew_ms"] == pytest.approx(30.0, abs=1e-3)


def met_rows(first_ms: Callable[[int], float], gradient_ms: Callable[[int, int], float | None]
             ) -> list[StepRow]:
    """Two ranks that launch their step's first collective ``first_ms(rank)`` into every
    step and backward's first ``gradient_ms(rank, step)`` into it (None: not stored)."""
    return [row_of(r, s, {"forward": 20.0, "backward": 30.0}, 100.0, 50.0,
                   t=T0 + s * 0.1 + 0.1, collective_at_ms=first_ms(r), collective_ms=10.0,
                   gradient_at_ms=gradient_ms(r, s))
            for r in range(2) for s in range(STEPS)]


def test_a_broadcast_where_the_ranks_meet_before_backward_hides_no_straggler() -> None:
    """DDP's broadcast of BatchNorm's statistics begins every forward: the ranks meet
    there together; r1's slower forward shows at backward's first collective, 12 ms."""
    found = arrival_skew(select_window(met_rows(lambda r: 1.0, lambda r, s: 30.0 + 12.0 * r),
                                       10_000, 2), {})
    assert found is not None and (found.last_rank, found.last_pct, found.num_steps) == (
        1, 100.0, 27)
    assert found.median_ms == pytest.approx(12.0, abs=1e-3)


def test_a_metric_all_reduced_after_forward_shows_the_lateness_backward_then_hides() -> None:
    """r1's forward takes 20 ms more; both all-reduce the loss after forward (r1 20 ms
    late there), then meet again at backward's first collective together."""
    found = arrival_skew(select_window(met_rows(lambda r: 25.0 + 20.0 * r,
                                                lambda r, s: 60.0), 10_000, 2), {})
    assert found is not None and (found.last_rank, found.last_pct) == (1, 100.0)
    assert found.median_ms == pytest.approx(20.0, abs=1e-3)


def test_a_step_without_backwards_arrival_on_a_rank_is_read_at_its_first_collective() -> None:
    """No step is left out for want of backward's arrival (an old store, a rank whose
    backward launched none): its first collective still tells."""
    found = arrival_skew(select_window(met_rows(
        lambda r: 1.0 + 3.0 * r, lambda r, s: None if r == 0 and s % 2 else 30.0 + 12.0 * r),
        10_000, 2), {})
    assert found is not None and found.num_steps == 27 and found.last_rank == 1
    # 14 odd steps (3-29) read 3 ms at the first collective, 13 even ones 12 ms at backward's
    assert found.worst_ms == pytest.approx(12.0, abs=1e-3)
    assert found.median_ms == pytest.approx(3.0, abs=1e-3)


def test_steps_renumbered_are_not_compared_at_a_collective_right_after_the_begin() -> None:
    """As above, with a broadcast 0.3 ms into every step: r1's (shifted) arrival there
    falls within the slack of r0's step end, but backward's does not, so the step is not
    one iteration and is left out, not read as a 100 ms straggler."""
    steps = met_rows(lambda r: 0.3, lambda r, s: 30.0 + 2.0 * r)
    shifted = [r.replace(step=r.step - 1) if r.rank == 1 else r for r in steps
               if not (r.rank == 1 and r.step == 0)]
    assert arrival_skew(select_window(shifted, 10_000, 2), {}) is None


def test_the_window_is_read_at_one_point_not_at_each_steps_larger_noise() -> None:
    """Balanced ranks whose arrivals at both points differ by noise alone: reading each
    step at the larger of the two would double the median; one point per window keeps
    it at that point's own."""
    first = [0.4, 0.1, 0.3, 0.2, 0.5, 0.1, 0.2, 0.4, 0.3, 0.1]
    second = [0.1, 0.5, 0.2, 0.4, 0.1, 0.3, 0.5, 0.1, 0.2, 0.4]
    found = arrival_skew(select_window(met_rows(
        lambda r: 1.0, lambda r, s: 30.0 + (second[s % 10] if r else 0.0)), 10_000, 2), {})
    assert found is not None and found.median_ms == pytest.approx(
        sorted(second[s % 10] for s in range(3, STEPS))[13], abs=1e-3)
    both = met_rows(lambda r: 1.0, lambda r, s: 30.0 + (second[s % 10] if r else 0.0))
    both = [row.replace(collective_at_ms=1.0 + (first[row.step % 10] if row.rank else 0.0))
            for row in both]
    found = arrival_skew(select_window(both, 10_000, 2), {})
    per_step_larger = sorted(max(first[s % 10], second[s % 10]) for s in range(3, STEPS))[13]
    assert found is not None and found.median_ms < per_step_larger
