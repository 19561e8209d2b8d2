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
from traceml.diagnosis.stats import Distribution


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
    ms, hook = least.ms, least.hook_ms
    hooks = f", {hook:.1f} ms of it in comm hooks" if hook >= HOOK_SHOWN_FRACTION * ms else ""
    mostly = f" (mostly r{least.rank})" if least.rank_pct > 50.0 else ""
    where = ("" if len(times) < 2 else
             f" on the rank that waited least at each step{mostly}: the collectives' own "
             "cost, not waiting for a slower rank")
    shares = {r: s for r, t in times.items() if (s := t.communication_share_pct()) is not None}
    evidence = {"communication_ms": ms, "hook_ms": hook, "step_ms": step, "rank": least.rank,
                "rank_pct": least.rank_pct}
    return _bound(ms, step, f"{hooks}){where}.", shares, evidence,
                  HOOK_NEXT if hook >= 0.5 * ms else COMMUNICATION_NEXT)


class RankGpuWait(RankComm, Protocol):
    """What the CUDA rule reads of one rank (`step_time.RankStepTimes`)."""

    @property
    def communication_ms(self) -> float: ...

    @property
    def reported(self) -> Mapping[str, Distribution | None]: ...

    @property
    def gpu_timed_step_ms(self) -> float | None: ...


GPU_WAIT = next(p.gpu_column for p in phases.gpu_timed() if p.waits)
"""The reported step column of the compute stream's wait on collectives (CUDA, DDP)."""


def gpu_wait(t: RankGpuWait) -> Distribution | None:
    """A rank's GPU wait on collectives over its typical steps that timed it."""
    return t.reported.get(GPU_WAIT)


def gpu_wait_measured(times: Mapping[int, RankGpuWait]) -> bool:
    """Whether every rank's compute stream's wait on collectives was timed on at least
    `thresholds.GPU_MIN_TIMED_STEPS` typical steps (CUDA, DDP): what the rules read
    there."""
    return bool(times) and all((w := gpu_wait(t)) is not None
                               and w.count >= thresholds.GPU_MIN_TIMED_STEPS
                               for t in times.values())


def gpu_step_ms(t: RankGpuWait) -> float:
    """A CUDA rank's typical step: the longer of the host's and the GPU time of its
    timed phases (a host that queues work ahead of its GPU has shorter steps than
    the GPU's; one that is itself the bottleneck, longer ones)."""
    return max(t.mean("total"), t.gpu_timed_step_ms or 0.0)


def gpu_communication_bound(times: Mapping[int, RankGpuWait]) -> list[Finding]:
    """COMMUNICATION-BOUND on CUDA, with the thresholds of `communication_bound`:
    the time the compute stream waited on collectives (``gpu_communication_ms``, CUDA
    events on the steps the CUDA path times), plus any host collectives, over the
    typical step.

    NCCL's collectives return once queued: the host's time says nothing of them,
    the GPU's does.  A rank's timed steps are a random sample of its own, not the
    same steps as the other ranks', so the least is taken of the ranks' means rather
    than at each step: the rank that waited least on average, whose wait is the
    collectives' own cost (a straggler's victims wait longer).  A collective the host
    timed (one without a tensor, a barrier) overlaps the GPU's wait: the longer of
    the two counts.  The step is `gpu_step_ms`.  Silent unless every rank has
    `thresholds.GPU_MIN_TIMED_STEPS` timed steps."""
    if not gpu_wait_measured(times):
        return []
    waits = {r: w for r, t in times.items() if (w := gpu_wait(t)) is not None}
    def ms_of(r: int) -> float:
        return max(waits[r].mean, times[r].communication_ms)
    least = min(times, key=lambda r: (ms_of(r), r))
    steps = {r: gpu_step_ms(t) for r, t in times.items()}
    step = statistics.median(steps.values())
    ms, timed = ms_of(least), waits[least]
    where = ("" if len(times) < 2 else
             f" on the rank that waited least on average (r{least}): the collectives' own "
             "cost, not waiting for a slower rank")
    why = (f"; the GPU waited on collectives at the end of backward, CUDA events on "
           f"{timed.count} timed steps){where}.")
    shares = {r: 100.0 * ms_of(r) / steps[r] for r in times if steps[r] > 0}
    evidence = {"communication_ms": ms, "hook_ms": 0.0, "step_ms": step, "rank": least,
                "gpu_wait_ms": timed.mean, "num_gpu_timed_steps": timed.count}
    return _bound(ms, step, why, shares, evidence, COMMUNICATION_NEXT)


def _bound(ms: float, step: float, tail: str, shares: Mapping[int, float],
           evidence: dict[str, float | int], next_step: str) -> list[Finding]:
    """The COMMUNICATION-BOUND finding for ``ms`` of a ``step`` ms typical step, if
    its share reaches the threshold (or is near it); ``tail`` ends its why, the
    ranks listed are those whose own share reaches it."""
    share = 100.0 * ms / step if step > 0 else 0.0
    levels = (thresholds.COMM_SHARE_WARN_PCT, thresholds.COMM_SHARE_CRIT_PCT)
    near = borderline(share, levels[0])
    severity = grade(share, *levels)
    if severity is None and not near:
        return []
    why = f"Communication took {share:.1f}% of step time ({ms:.1f} of {step:.1f} ms{tail}"
    low = levels[0] * (1.0 - thresholds.BORDERLINE_MARGIN) if near else levels[0]
    ranks = sorted((r for r, v in shares.items() if v >= low), key=lambda r: -shares[r])
    found = Finding("COMMUNICATION_BOUND", "COMMUNICATION-BOUND", severity or "warn", why,
                    next_step, tuple(ranks), {"communication_share_pct": share, **evidence})
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
