"""COMMUNICATION-BOUND: how much of the step the collectives themselves cost, read at
each step from the rank that waited least (offline analysis, a Step Time rule that
`traceml.diagnosis.step_time` runs; SPEC R-COMM-3)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from traceml import phases
from traceml.diagnosis import thresholds
from traceml.diagnosis.finding import Finding, as_borderline, borderline, grade


class RankComm(Protocol):
    """What the rule reads of one rank's step times (`step_time.RankStepTimes`)."""

    def mean(self, phase: str) -> float: ...

    def per_step(self, phase: str) -> dict[int, float]: ...

    def communication_share_pct(self) -> float | None: ...


COMMUNICATION_NEXT = (
    "Overlap communication with compute (DDP bucket_cap_mb, gradient_as_bucket_view=True, "
    "static_graph=True), communicate less often (no_sync() with gradient accumulation, "
    "a larger batch) or less (a bf16/fp16 or PowerSGD DDP comm hook, fewer and larger "
    "collectives), and check the interconnect (NCCL_DEBUG=INFO, nccl-tests).")

HOOK_NEXT = ("Most of it is comm hooks' own work before they launch their collectives "
             "(on the training thread, inside backward): make the hook cheaper, compress "
             "less often, or use a lighter one (bf16 compression, a lower PowerSGD rank).")


def communication_bound(times: Mapping[int, RankComm]) -> list[Finding]:
    """COMMUNICATION-BOUND: communication (blocked on collectives, and comm hooks'
    own work) >= 10 % (crit >= 20 %) of the typical step, read at each step from
    the rank that waited least.

    A slow rank makes the others wait in their collectives while it waits on
    nobody: its communication is the collectives' own cost.  So at each step the
    least of the ranks' communication is taken (the straggler's, when there is
    one; whichever rank came last, when ranks take turns), and averaged over the
    steps: a straggler never hides a communication-bound job, and its victims
    never make one up (SPEC R-COMM-3)."""
    least = least_communication(times)
    if least is None:
        return []
    step = statistics.median(t.mean("total") for t in times.values())
    share = 100.0 * least.ms / step if step > 0 else 0.0
    levels = (thresholds.COMM_SHARE_WARN_PCT, thresholds.COMM_SHARE_CRIT_PCT)
    near = borderline(share, levels[0])
    severity = grade(share, *levels)
    if severity is None and not near:
        return []
    ms, hook = least.ms, least.hook_ms
    hooks = f", {hook:.1f} ms of it in comm hooks" if hook >= HOOK_SHOWN_FRACTION * ms else ""
    mostly = f" (mostly r{least.rank})" if least.rank_pct > 50.0 else ""
    where = ("" if len(times) < 2 else
             f" on the rank that waited least at each step{mostly}: the collectives' own "
             "cost, not waiting for a slower rank")
    why = f"Communication took {share:.1f}% of step time ({ms:.1f} of {step:.1f} ms{hooks}){where}."
    next_step = HOOK_NEXT if hook >= 0.5 * ms else COMMUNICATION_NEXT
    low = levels[0] * (1.0 - thresholds.BORDERLINE_MARGIN) if near else levels[0]
    shares = {r: s for r, t in times.items() if (s := t.communication_share_pct()) is not None}
    ranks = sorted((r for r, v in shares.items() if v >= low), key=lambda r: -shares[r])
    evidence = {"communication_share_pct": share, "communication_ms": ms, "hook_ms": hook,
                "step_ms": step, "rank": least.rank, "rank_pct": least.rank_pct}
    found = Finding("COMMUNICATION_BOUND", "COMMUNICATION-BOUND", severity or "warn", why,
                    next_step, tuple(ranks), evidence)
    return [as_borderline(found, levels[0]) if near else found]


@dataclass(frozen=True)
class LeastCommunication:
    """Communication of the rank that waited least at each step, over the steps."""

    ms: float  # mean over the steps (blocked on collectives, and comm hooks' own work)
    hook_ms: float  # ...of which comm hooks' own work
    rank: int  # the rank that waited least most often
    rank_pct: float  # ...at this % of the steps


def least_communication(times: Mapping[int, RankComm]) -> LeastCommunication | None:
    """At each typical step every rank had (a step some rank left out as an outlier
    would leave its victims to pick from), the communication of the rank that
    waited least; None without such steps."""
    ranks = sorted(times)
    per_rank: dict[int, dict[int, float]] = {}  # rank -> its communication at each step
    for r in ranks:
        columns = [times[r].per_step(name) for name in phases.collective_names()]
        per_rank[r] = dict(zip(columns[0], map(sum, zip(*(c.values() for c in columns)))))
    common = sorted(set.intersection(*map(set, per_rank.values()))) if per_rank else []
    if not common:
        return None
    hooks = {r: times[r].per_step("hook") for r in ranks}
    totals, hook_ms, wins = [], [], Counter[int]()
    # One step's communication on every rank at a time (ranks ascending): the least,
    # and the first rank that had it.
    by_step = zip(*(list(map(per_rank[r].__getitem__, common)) for r in ranks))
    for step, at_step in zip(common, by_step):
        ms = min(at_step)
        rank = ranks[at_step.index(ms)]
        totals.append(ms)
        hook_ms.append(hooks[rank][step])
        wins[rank] += 1
    rank, num = wins.most_common(1)[0]
    return LeastCommunication(statistics.fmean(totals), statistics.fmean(hook_ms), rank,
                              100.0 * num / len(totals))


HOOK_SHOWN_FRACTION = 0.25
"""COMMUNICATION-BOUND says how much of the communication was comm hooks' own work
when it is at least this fraction of it."""
