"""Straggler attribution and COMMUNICATION-BOUND on hand-built 1-, 2- and 8-rank
windows, with communication timed (DDP on gloo) and without it (SPEC R-COMM-2/3)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.rows import row_of
from traceml import phases
from traceml.diagnosis.communication import communication_bound, least_communication
from traceml.diagnosis.finding import Finding
from traceml.diagnosis.stats import distribution
from traceml.diagnosis.step_time import RankStepTimes, diagnose_step_time, rank_step_times
from traceml.diagnosis.stragglers import COMPUTE_PARTS, OWN_PARTS, Excess, attribute
from traceml.diagnosis.thresholds import STRAGGLER_EXPLAINS_FRACTION
from traceml.diagnosis.window import select_window

BASE = {"input": 2.0, "forward": 20.0, "backward": 40.0, "optimizer": 6.0,
        "communication": 10.0, "wait": 2.0}  # an 80 ms step


def times_of(world: int, parts: Callable[[int], dict[str, float]], timed: bool = True,
             num_steps: int = 20) -> dict[int, RankStepTimes]:
    """Every rank runs ``num_steps`` steps of ``BASE`` updated with ``parts(rank)``;
    ``timed``: collectives were timed end to end (in flight = exposed + 5 ms)."""
    rows = []
    for rank in range(world):
        p = BASE | parts(rank)
        total = sum(p.values())
        phase_ms = {phase.name: p.get(phase.name, 0.0) for phase in phases.PHASES}
        rows += [row_of(rank, s, phase_ms, total, p["wait"],
                         collective_ms=p["communication"] + 5.0 if timed else None)
                 for s in range(num_steps)]
    return rank_step_times(select_window(rows, 10_000, world), {})


def found(times: dict[int, RankStepTimes]) -> list[tuple[str, tuple[int, ...]]]:
    return [(f.kind, f.ranks) for f in diagnose_step_time(times) if f.measured]


def first(times: dict[int, RankStepTimes]) -> Finding:
    return diagnose_step_time(times)[0]


def slow_backward(slow: int, extra: float) -> Callable[[int], dict[str, float]]:
    """``slow`` computes ``extra`` ms more in backward; the others wait that long
    in their DDP all-reduce (timed: communication)."""
    def parts(rank: int) -> dict[str, float]:
        if rank == slow:
            return {"backward": 40.0 + extra}
        return {"communication": 10.0 + extra}
    return parts


def slow_between_steps(slow: int, extra: float, timed: bool = True
                       ) -> Callable[[int], dict[str, float]]:
    """``slow`` does ``extra`` ms of host work between steps; the others wait for
    it in their next all-reduce: communication when timed, backward when not."""
    def parts(rank: int) -> dict[str, float]:
        if rank == slow:
            return {"wait": 2.0 + extra}
        if timed:
            return {"communication": 10.0 + extra}
        return {"backward": 40.0 + extra, "communication": 0.0}
    return parts


@pytest.mark.parametrize("world", [2, 8])
def test_slow_backward_names_the_rank_and_the_phase(world: int) -> None:
    top = first(times_of(world, slow_backward(1, 15.0)))
    assert (top.kind, top.ranks) == ("COMPUTE_STRAGGLER", (1,))
    assert top.why.startswith("r1 backward was 55.0 ms vs 40.0 ms on the other ranks (+15.0 ms")
    assert top.evidence["excess_ms"] == pytest.approx(15.0)
    assert "backward" in top.next


@pytest.mark.parametrize("world", [2, 8])
def test_host_work_between_steps_names_the_slow_rank_not_the_waiting_ones(world: int) -> None:
    times = times_of(world, slow_between_steps(world - 1, 15.0))
    kinds = found(times)
    assert kinds[0] == ("HOST_STRAGGLER", (world - 1,)), kinds
    assert all(ranks == (world - 1,) for kind, ranks in kinds if "STRAGGLER" in kind)
    assert "untraced host work" in first(times).why


def test_without_communication_timing_the_waiting_rank_is_still_not_blamed() -> None:
    # r0's backward holds its wait for r1 (not timed): r1's host work explains it.
    times = times_of(2, slow_between_steps(1, 15.0, timed=False), timed=False)
    stragglers = [(k, r) for k, r in found(times) if "STRAGGLER" in k]
    assert stragglers == [("HOST_STRAGGLER", (1,))]
    assert "COMMUNICATION NOT MEASURED" in [f.label for f in diagnose_step_time(times)]


def test_a_backward_excess_with_a_smaller_explanation_is_unclear_not_blamed() -> None:
    # r0's backward is 13 ms over r1's while r1 does 7 ms more host work (below even
    # the borderline 7.2 ms itself), and collectives were not timed: r0 may be waiting.
    def parts(rank: int) -> dict[str, float]:
        return {"backward": 53.0, "communication": 0.0} if rank == 0 else {
            "wait": 9.0, "communication": 0.0}
    times = times_of(2, parts, timed=False)
    top = first(times)
    assert (top.kind, top.severity) == ("STRAGGLER_UNCLEAR", "info")
    assert "cannot be told" in top.why
    assert all("STRAGGLER" not in k or k == "STRAGGLER_UNCLEAR" for k, _ in found(times))


def test_the_same_excess_with_communication_timed_is_blamed() -> None:
    def parts(rank: int) -> dict[str, float]:
        return {"backward": 55.0} if rank == 0 else {"wait": 10.0, "communication": 25.0}
    assert found(times_of(2, parts))[0] == ("COMPUTE_STRAGGLER", (0,))


def test_every_rank_slow_in_the_all_reduce_is_communication_bound() -> None:
    times = times_of(8, lambda rank: {"communication": 25.0})
    top = first(times)
    assert (top.kind, top.severity) == ("COMMUNICATION_BOUND", "crit")
    assert top.evidence["communication_share_pct"] == pytest.approx(100 * 25 / 95)
    assert "bucket_cap_mb" in top.next
    assert not any("STRAGGLER" in k for k, _ in found(times))


@pytest.mark.parametrize(("comm_ms", "severity"),
                         [(6.0, None), (7.5, "info"), (9.0, "warn"), (22.0, "crit")])
def test_communication_bound_thresholds_one_rank(comm_ms: float, severity: str | None) -> None:
    # total = 70 + comm: 6 of 76 ms is 7.9 %, 7.5 of 77.5 ms 9.7 % (borderline),
    # 9 of 79 ms 11.4 %, 22 of 92 ms 23.9 %.
    times = times_of(1, lambda rank: {"communication": comm_ms})
    kinds = [f for f in diagnose_step_time(times) if f.kind == "COMMUNICATION_BOUND"]
    assert [f.severity for f in kinds] == ([severity] if severity else [])


def test_a_rank_just_below_the_straggler_limit_does_not_make_the_rest_communication_bound(
        ) -> None:
    # r7 does 8 ms more host work (limit 8.8 ms): the other seven wait that long in
    # their all-reduce, r7 itself hardly; that is r7's to fix, not the network's.
    def parts(rank: int) -> dict[str, float]:
        return {"wait": 10.0, "communication": 1.0} if rank == 7 else {"communication": 9.0}
    kinds = [k for k, _ in found(times_of(8, parts))]
    assert "COMMUNICATION_BOUND" not in kinds


def test_a_stragglers_victims_do_not_make_communication_bound_up() -> None:
    # Waiting for r3 makes every other rank's communication 40 of 110 ms; r3 itself
    # waits on nobody: its 10 ms (9.1 %) are the all-reduce's own cost, borderline.
    findings = diagnose_step_time(times_of(8, slow_backward(3, 30.0)))
    assert (findings[0].kind, findings[0].ranks) == ("COMPUTE_STRAGGLER", (3,))
    comm = next(f for f in findings if f.kind == "COMMUNICATION_BOUND")
    assert comm.evidence["rank"] == 3
    assert comm.evidence["communication_share_pct"] == pytest.approx(100 * 10 / 110)
    assert (comm.label, comm.severity) == ("BORDERLINE COMMUNICATION-BOUND", "info")
    assert "on the rank that waited least at each step (mostly r3)" in comm.why


@pytest.mark.parametrize("world", [2, 8])
def test_a_straggler_never_hides_a_communication_bound_job(world: int) -> None:
    # Every rank's all-reduce costs 30 ms; r1 also computes 12 ms more in backward,
    # so the others wait 42 ms: both hold, and the collectives' own 30 ms per step
    # is more to win back than r1's 12 ms, so communication is the verdict.
    def parts(rank: int) -> dict[str, float]:
        return {"backward": 52.0, "communication": 30.0} if rank == 1 else {
            "communication": 42.0}
    findings = [f for f in diagnose_step_time(times_of(world, parts)) if f.measured]
    assert [(f.kind, f.ranks[:1]) for f in findings[:2]] == [
        ("COMMUNICATION_BOUND", (0,)), ("COMPUTE_STRAGGLER", (1,))]
    assert findings[0].evidence["communication_ms"] == pytest.approx(30.0)
    assert findings[0].evidence["rank"] == 1
    assert findings[0].severity == "crit"


def test_balanced_ranks_with_timed_communication_have_no_straggler() -> None:
    kinds = found(times_of(8, lambda rank: {"forward": 20.0 + 0.1 * rank}))
    assert not any("STRAGGLER" in k for k, _ in kinds)
    assert kinds == [("COMMUNICATION_BOUND", tuple(range(8)))]


def test_one_rank_has_no_straggler_and_no_communication_abstention() -> None:
    findings = diagnose_step_time(times_of(1, lambda rank: {"communication": 0.0}, timed=False))
    assert [f.kind for f in findings] == ["COMPUTE_BOUND"]


def _attribute_by_definition(every: dict[tuple[int, str], Excess], limit_ms: float,
                             comm_measured: bool) -> tuple[set[tuple[int, str]],
                                                           set[tuple[int, str]]]:
    """attribute() as the module docstring states it, every pair compared."""
    def explains(by: Excess, e: Excess) -> bool:
        return by.rank != e.rank and by.excess_ms >= STRAGGLER_EXPLAINS_FRACTION * e.excess_ms
    found = [e for e in every.values() if e.excess_ms >= limit_ms]
    waits = [e for e in every.values() if e.part in ("input", "wait")]
    explained = [e for e in found if not comm_measured and e.part in COMPUTE_PARTS
                 and any(explains(w, e) for w in waits)]
    standing = [e for e in found if e not in explained]
    others = [e for e in standing if e.part != "wait"]
    explained += [e for e in standing if e.part == "wait" and any(explains(o, e) for o in others)]
    return ({(e.rank, e.part) for e in standing if e not in explained},
            {(e.rank, e.part) for e in explained})


@pytest.mark.parametrize("seed", range(40))
def test_attribution_at_many_ranks_is_the_pairwise_definition(seed: int) -> None:
    """The linear-time explanation check (thousands of ranks) decides exactly as
    comparing every pair of ranks does, ties and one-rank-explains-itself included."""
    rng = random.Random(seed)
    num_ranks = rng.choice([2, 3, 8, 40])
    every = {(r, part): Excess(r, part, 10.0 + rng.choice([0.0, 0.5, 1.0, 2.0, rng.random() * 3]),
                               10.0)
             for r in range(num_ranks) for part in OWN_PARTS}
    for comm_measured in (False, True):
        standing, explained = attribute(every, 0.5, comm_measured)
        assert ({(e.rank, e.part) for e in standing}, {(e.rank, e.part) for e in explained}) \
            == _attribute_by_definition(every, 0.5, comm_measured)


def test_without_communication_timing_a_sibling_that_may_be_waiting_is_not_added() -> None:
    # r1 is 15 ms slower in backward and 5 ms in forward; r0 loads 6 ms slower, and
    # collectives were not timed: r1's forward may hold waiting for r0 (6 >= half
    # of 5), its backward may not (6 < half of 15), so only backward is named.
    def parts(rank: int) -> dict[str, float]:
        if rank == 1:
            return {"forward": 25.0, "backward": 55.0, "communication": 0.0}
        return {"input": 8.0, "communication": 0.0}
    found = [f for f in diagnose_step_time(times_of(2, parts, timed=False))
             if "STRAGGLER" in f.kind]
    assert [(f.kind, f.ranks) for f in found] == [("COMPUTE_STRAGGLER", (1,))]
    assert found[0].why.startswith("r1 backward was "), found[0].why


@pytest.mark.parametrize(("comm_ms", "first"), [(16.0, "COMMUNICATION_BOUND"),
                                                 (11.0, "COMPUTE_STRAGGLER")])
def test_the_verdict_is_the_finding_with_more_to_win_back(comm_ms: float, first: str) -> None:
    # r1 computes 12 ms more in backward (warn) while every all-reduce costs
    # ``comm_ms`` (warn): the verdict is whichever costs more per step.
    def parts(rank: int) -> dict[str, float]:
        if rank == 1:
            return {"backward": 52.0, "communication": comm_ms}
        return {"communication": comm_ms + 12.0}
    findings = [f for f in diagnose_step_time(times_of(2, parts)) if f.actionable]
    assert sorted(f.severity for f in findings) == ["warn", "warn"]
    assert findings[0].kind == first


def _rank_times(rank: int, comm_by_step: dict[int, float]) -> RankStepTimes:
    """A rank whose typical steps are ``comm_by_step``'s (80 ms, communication as given)."""
    rows = tuple(row_of(rank, s, {"forward": 20.0, "backward": 40.0, "communication": c},
                         80.0, 80.0 - 60.0 - c) for s, c in sorted(comm_by_step.items()))
    dists = {p: distribution([r.ms(p) for r in rows]) for p in ("total", *OWN_PARTS,
                                                                  "communication", "hook")}
    return RankStepTimes(rank, 0, len(rows), dists, rows=rows)


def test_communication_is_read_only_at_steps_every_rank_kept() -> None:
    # r1 came last at every step (5 ms: the all-reduce's own cost); at step 3 its
    # row was left out as an outlier, where r0 waited 40 ms for it: that step is
    # not read, or r0's wait would count as the collectives' cost.
    r0 = {s: 40.0 if s == 3 else 15.0 for s in range(10)}
    r1 = {s: 5.0 for s in range(10) if s != 3}
    least = least_communication({0: _rank_times(0, r0), 1: _rank_times(1, r1)})
    assert least is not None
    assert (least.ms, least.rank, least.rank_pct) == (5.0, 1, 100.0)


def test_a_tie_at_the_least_goes_to_the_lowest_rank_whatever_the_order_given() -> None:
    # 8 ranks, given highest first: r5 and r2 tie at the least (6 ms) at every step
    # but step 4, where r7 alone has 3 ms.
    comm = {r: {s: 30.0 + r for s in range(10)} for r in range(7, -1, -1)}
    comm[5] = comm[2] = {s: 6.0 for s in range(10)}
    comm[7] = {**comm[7], 4: 3.0}
    least = least_communication({r: _rank_times(r, c) for r, c in comm.items()})
    assert least is not None
    assert (least.rank, least.rank_pct) == (2, 90.0)
    assert least.ms == pytest.approx((9 * 6.0 + 3.0) / 10)


def test_ranks_taking_turns_at_waiting_least_are_not_said_to_be_mostly_one() -> None:
    r0 = {s: 20.0 if s % 2 else 22.0 for s in range(10)}
    r1 = {s: 22.0 if s % 2 else 20.0 for s in range(10)}
    (found,) = communication_bound({0: _rank_times(0, r0), 1: _rank_times(1, r1)})
    assert found.evidence["rank_pct"] == 50.0 and found.evidence["communication_ms"] == 20.0
    assert "on the rank that waited least at each step: " in found.why
    r1 = {s: 19.0 for s in range(10)}
    (found,) = communication_bound({0: _rank_times(0, r0), 1: _rank_times(1, r1)})
    assert "at each step (mostly r1): " in found.why
