"""Step Time rules: input-bound, wait-heavy, communication-bound, compute-bound,
stragglers (offline analysis).

Runs in the offline-analysis process. Works on per-rank phase distributions of
the step window's typical steps (the parts of `traceml.phases`): outlier steps
(`traceml.diagnosis.outliers`) are left out and reported on their own, and the
section's diagnosis is the finding with the most wall time to win back. Shares
are the median over ranks of part mean / step mean over the typical steps;
COMMUNICATION-BOUND reads, at each step, the rank that waited least instead (its
communication is the collectives' own cost: a slow rank makes every other rank wait
in theirs), and holds beside a straggler: the verdict is the actionable finding
with the most wall time to win back.
Stragglers are found from each rank's own work, never from time it waited in a
collective for another rank (`traceml.diagnosis.stragglers`).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from traceml import phases, step_fields
from traceml.diagnosis import stragglers as attribution
from traceml.diagnosis import thresholds
from traceml.diagnosis.communication import (
    communication_bound,
    gpu_communication_bound,
    gpu_step_ms,
    gpu_wait_measured,
)
from traceml.diagnosis.finding import (
    Finding,
    as_borderline,
    borderline,
    grade,
    not_measured,
    order_findings,
    severity_rank,
)
from traceml.diagnosis.outliers import RankOutliers, find_outliers, outlier_steps
from traceml.diagnosis.stats import Distribution, distribution
from traceml.diagnosis.window import StepWindow
from traceml.records import StepRow, column, gpu_column, ms_column

PHASES = tuple(p.name for p in phases.step_metrics())
"""What each rank row holds a distribution of: total, every phase, compute, wait."""

SHARES = tuple(p.name for p in phases.share_metrics())
"""The parts whose share of the step a rank row reports."""


@dataclass(frozen=True)
class RankStepTimes:
    """One rank's per-step time distributions (ms) over the window's typical steps."""

    rank: int
    node_rank: int | None
    num_steps: int  # window steps, outliers included
    dists: Mapping[str, Distribution]  # one of PHASES -> its distribution (outliers left out)
    # Each reported step column (`traceml.step_fields`: collectives in flight, ...) -> its
    # distribution; None: no step measured it.
    reported: Mapping[str, Distribution | None] = dataclasses.field(default_factory=dict)
    # CUDA: GPU time of the GPU-timed phases, over the steps that carry it (the
    # agent times a sample of steps); None off CUDA or when no step carries it.
    gpu_ms: Distribution | None = None
    num_gpu_timed_steps: int | None = None  # steps with GPU times; None off CUDA
    outliers: RankOutliers | None = None
    rows: tuple[StepRow, ...] = ()  # the typical steps, for step-by-step tests
    # CUDA: the mean GPU time of the timed phases, DDP's wait on collectives included,
    # over the typical steps that timed that wait; None where none did
    gpu_timed_step_ms: float | None = None

    def dist(self, phase: str) -> Distribution:
        """The distribution of one of PHASES."""
        return self.dists[phase]

    def mean(self, phase: str) -> float:
        """Mean ms of one of PHASES."""
        return self.dists[phase].mean

    def per_step(self, phase: str) -> dict[int, float]:
        """Ms of one of PHASES at each typical step, by step index (made once per phase:
        the straggler and communication rules ask each rank's again and again)."""
        by_step = self._per_step.get(phase)
        if by_step is None:
            by_step = self._per_step[phase] = dict(zip(column(self.rows, "step"),
                                                       ms_column(self.rows, phase)))
        return by_step

    @functools.cached_property  # a frozen instance's __dict__ takes it all the same
    def _per_step(self) -> dict[str, dict[int, float]]:
        return {}

    @property
    def communication_ms(self) -> float:
        """Mean ms of communication: blocked on collectives, and comm hooks' own work."""
        return sum(self.mean(name) for name in phases.collective_names())

    def communication_share_pct(self) -> float | None:
        """Communication as % of the step mean; None for a zero-length step."""
        total = self.total_ms.mean
        return 100.0 * self.communication_ms / total if total > 0 else None

    @property
    def total_ms(self) -> Distribution:
        """The step time distribution."""
        return self.dists["total"]

    def share_pct(self, phase: str) -> float | None:
        """Phase mean as % of the step mean; None for a zero-length step."""
        total = self.total_ms.mean
        return 100.0 * self.mean(phase) / total if total > 0 else None

    def json_fields(self) -> dict[str, object]:
        """The row as final_summary.json writes it: ``<phase>_ms`` distributions and
        ``<part>_share_pct`` shares."""
        outliers = self.outliers
        return {"rank": self.rank, "node_rank": self.node_rank, "num_steps": self.num_steps,
                "num_outlier_steps": len(outliers.steps) if outliers else 0,
                "outlier_total_ms": sum(outliers.outlier_ms) if outliers else 0.0,
                **{f"{p}_ms": self.dists[p] for p in PHASES},
                **{f.name: self.reported.get(f.name) for f in step_fields.reported()},
                **{f"{p}_share_pct": self.share_pct(p) for p in SHARES},
                "gpu_ms": self.gpu_ms, "num_gpu_timed_steps": self.num_gpu_timed_steps}


def rank_step_times(window: StepWindow, node_of: Mapping[int, int]) -> dict[int, RankStepTimes]:
    """Per-rank distributions of every phase over the typical steps (outlier steps
    left out); ranks without window steps are left out."""
    out = {}
    for rank, every in window.by_rank.items():
        if not every:
            continue
        outliers = find_outliers(rank, every)
        slow = set(outliers.steps)
        rows = [r for r in every if r.step not in slow] if slow else list(every)
        dists = {p: distribution(ms_column(rows, p)) for p in PHASES}
        reported = {f.name: reported_distribution(rows, f) for f in step_fields.reported()}
        gpu = gpu_column(every)
        on_cuda = bool(gpu) or column(every, "peak_allocated_bytes").count(None) < len(every)
        with_wait = gpu_column(rows, with_wait=True)
        out[rank] = RankStepTimes(
            rank, node_of.get(rank), len(every), dists, reported,
            distribution(gpu) if gpu else None, len(gpu) if on_cuda else None, outliers,
            tuple(rows), statistics.fmean(with_wait) if with_wait else None)
    return out


def reported_distribution(rows: Sequence[StepRow], field: step_fields.StepField
                          ) -> Distribution | None:
    """A reported column's distribution over ``rows``: measured once any step measured
    it (collectives in flight: a step without one had none in flight), over the steps
    that measured it where the column is ``sampled``; None if none did."""
    values = column(rows, field.name)
    measured = [v for v in values if v is not None]
    if not measured:
        return None
    return distribution(measured if field.sampled else [v or 0.0 for v in values])


def median_share_pct(times: Mapping[int, RankStepTimes], phase: str) -> float | None:
    """Median over ranks of the phase's share of step time."""
    shares = [s for t in times.values() if (s := t.share_pct(phase)) is not None]
    return statistics.median(shares) if shares else None


def median_mean_ms(times: Mapping[int, RankStepTimes], phase: str) -> float:
    """Median over ranks of the phase mean."""
    return statistics.median(t.mean(phase) for t in times.values())


NAMED_RANKS = 4
"""Up to this many ranks, a median over ranks names each rank's own value."""


def over_ranks(times: Mapping[int, RankStepTimes], phase: str) -> str:
    """What a median over ranks of ``phase`` is made of, since with an even number of
    ranks it is no rank's own value: ``, the median of r0 0.6 and r1 11.0 ms``, or
    the range over many ranks; nothing for one rank."""
    means = {r: t.mean(phase) for r, t in sorted(times.items())}
    if len(means) <= 1:
        return ""
    if len(means) <= NAMED_RANKS:
        said = [f"r{r} {ms:.1f}" for r, ms in means.items()]
        return f", the median of {', '.join(said[:-1])} and {said[-1]} ms"
    return (f", the median over {len(means)} ranks, which range "
            f"{min(means.values()):.1f} to {max(means.values()):.1f} ms")


INPUT_NEXT = {
    "cuda": ("Feed the GPU faster: raise DataLoader num_workers, set pin_memory=True and "
             "persistent_workers=True, or move preprocessing out of the training loop."),
    "cpu": ("Make batches faster: raise DataLoader num_workers if the host has idle cores, "
            "set persistent_workers=True, cache or pre-process the data once, or move "
            "preprocessing out of the training loop."),
}
"""INPUT-BOUND's advice by device: a CPU-only run has no GPU to feed."""


def input_bound(times: Mapping[int, RankStepTimes], device: str = "cpu") -> list[Finding]:
    """INPUT-BOUND: input share >= 10 % (crit >= 20 %)."""
    return _share_rule(
        times, "input", "INPUT_BOUND", "INPUT-BOUND",
        (thresholds.INPUT_SHARE_WARN_PCT, thresholds.INPUT_SHARE_CRIT_PCT),
        "Input (data loading) took {share:.1f}% of step time ({ms:.1f} of {step:.1f} ms"
        "{ranks}).",
        INPUT_NEXT.get(device, INPUT_NEXT["cpu"]),
    )


def wait_heavy(times: Mapping[int, RankStepTimes]) -> list[Finding]:
    """WAIT-HEAVY: untraced time (total - phases) share >= 10 % (crit >= 20 %)."""
    return _share_rule(
        times, "wait", "WAIT_HEAVY", "WAIT-HEAVY",
        (thresholds.WAIT_SHARE_WARN_PCT, thresholds.WAIT_SHARE_CRIT_PCT),
        f"Time outside {phases.describe(phases.PHASES)} took {{share:.1f}}% of step "
        "time ({ms:.1f} of {step:.1f} ms{ranks}).",
        "Look for work between steps: host syncs (.item(), .cpu(), printing tensors), "
        "logging, checkpointing or evaluation inside the loop; profile one step with "
        "torch.profiler.",
    )


def _share_rule(
    times: Mapping[int, RankStepTimes],
    phase: str,
    kind: str,
    label: str,
    levels: tuple[float, float],
    why: str,
    next_step: str,
) -> list[Finding]:
    """A share rule on the median rank."""
    share = median_share_pct(times, phase)
    if share is None:
        return []
    near = borderline(share, levels[0])
    severity = grade(share, *levels)
    if severity is None and not near:
        return []
    low = levels[0] * (1.0 - thresholds.BORDERLINE_MARGIN) if near else levels[0]
    ranks = [r for r, t in times.items() if (s := t.share_pct(phase)) is not None and s >= low]
    ranks.sort(key=lambda r: -(times[r].share_pct(phase) or 0.0))
    ms, step = median_mean_ms(times, phase), median_mean_ms(times, "total")
    evidence = {f"{phase}_share_pct": share, f"{phase}_ms": ms, "step_ms": step}
    said = why.format(share=share, ms=ms, step=step, ranks=over_ranks(times, phase))
    found = Finding(kind, label, severity or "warn", said, next_step, tuple(ranks), evidence)
    return [as_borderline(found, levels[0]) if near else found]


COMPUTE_NEXT = {
    "cuda": ("Expected for a healthy run. To go faster: bf16 autocast, torch.compile, fused "
             "optimizers, or a larger batch; torch.profiler shows the heaviest operators."),
    "cpu": ("Expected for a healthy run. To go faster on CPU: torch.compile, bf16 autocast "
            "where the CPU supports it, more intra-op threads per rank (torch.set_num_threads) "
            "or fewer ranks per host; torch.profiler shows the heaviest operators."),
}


def compute_bound(times: Mapping[int, RankStepTimes], device: str = "cpu") -> list[Finding]:
    """COMPUTE-BOUND (info): forward+backward+optimizer share >= 85 %.

    The caller uses it only when no other Step Time rule fired but an UNCLEAR
    STRAGGLER that names no rank (ranks that differ without a cause)."""
    share = median_share_pct(times, "compute")
    if share is None or share < thresholds.COMPUTE_SHARE_PCT:
        return []
    compute = phases.describe(tuple(p for p in phases.PHASES if p.compute))
    why = (
        f"{compute.capitalize()} took {share:.1f}% of step time "
        f"({median_mean_ms(times, 'compute'):.1f} of {median_mean_ms(times, 'total'):.1f} ms"
        f"{over_ranks(times, 'compute')}); the rest is small."
    )
    next_step = COMPUTE_NEXT.get(device, COMPUTE_NEXT["cpu"])
    return [Finding("COMPUTE_BOUND", "COMPUTE-BOUND", "info", why, next_step, (),
                    {"compute_share_pct": share})]


def balanced(times: Mapping[int, RankStepTimes]) -> Finding:
    """BALANCED: no Step Time rule fired."""
    shares = {p: median_share_pct(times, p) or 0.0 for p in SHARES}
    parts = ", ".join(f"{p} {share:.1f}%" for p, share in shares.items())
    why = f"No phase dominates and no rank straggles: {parts} of step time."
    next_step = "Nothing stands out; use torch.profiler for operator-level detail."
    evidence = {f"{p}_share_pct": v for p, v in shares.items()}
    return Finding("BALANCED", "BALANCED", "info", why, next_step, (), evidence)


def stragglers(times: Mapping[int, RankStepTimes], device: str = "cpu") -> list[Finding]:
    """INPUT / COMPUTE / HOST-WORK STRAGGLER and STRAGGLER, from each rank's own work
    (`traceml.diagnosis.stragglers`); on CUDA, compute from the GPU's times when every
    rank has enough of them (`GpuOwnWork`)."""
    if len(times) < 2:
        return []
    gpu = gpu_own_work(times) if device == "cuda" else None
    if gpu is not None:
        step_ms = statistics.median(gpu_step_ms(t) for t in times.values())
        return attribution.stragglers(gpu, step_ms, False, device, on_gpu=True)
    return attribution.stragglers(times, median_mean_ms(times, "total"), comm_measured(times),
                                  device)


@dataclass(frozen=True)
class GpuOwnWork:
    """One rank's own work for straggler attribution on CUDA.

    On CUDA the host's compute phases time launches, and wherever the host blocks
    on its GPU (a full launch queue, a copy), which may be waiting for another rank:
    host time cannot tell a slow GPU from a waiting one.  The GPU's time of each
    compute phase can, on the steps the CUDA path times: its kernels, and the GPU
    idle inside the phase waiting for the host's launches, with DDP's wait on
    the other ranks taken out of backward (``gpu_communication_ms``).  Input and
    untraced work stay the host's, on every typical step.  Each rank times its own
    sample of steps, so compute parts are held against the other ranks' typical
    value (`steadiness.StepSeries.pooled`); communication stays unmeasured for the
    attribution (a forward collective, DDP's buffer broadcast or FSDP's
    all-gathers, can hold waiting in the GPU's forward)."""

    host: RankStepTimes
    gpu: Mapping[str, Mapping[int, float]]  # compute part -> its GPU ms at each timed step

    def mean(self, part: str) -> float:
        values = self.gpu.get(part)
        return statistics.fmean(values.values()) if values is not None else self.host.mean(part)

    def per_step(self, part: str) -> Mapping[int, float]:
        values = self.gpu.get(part)
        return values if values is not None else self.host.per_step(part)


def gpu_own_work(times: Mapping[int, RankStepTimes]) -> dict[int, GpuOwnWork] | None:
    """Every rank's `GpuOwnWork`, when DDP's wait was timed on the GPU on every rank
    (`gpu_wait_measured`: otherwise the GPU's compute phases may hold a wait that was
    not taken out) and every rank has GPU times on at least
    `thresholds.GPU_MIN_TIMED_STEPS` typical steps; None otherwise (host time, as
    off CUDA)."""
    if not gpu_wait_measured(times):
        return None
    names = tuple(p.name for p in phases.gpu_compute())
    out = {}
    for rank, t in times.items():
        steps = column(t.rows, "step")
        columns = [column(t.rows, p.gpu_column) for p in phases.gpu_compute()]
        timed = [(s, v) for s, *v in zip(steps, *columns) if None not in v]
        if len(timed) < thresholds.GPU_MIN_TIMED_STEPS:
            return None
        out[rank] = GpuOwnWork(t, {name: {s: float(v[i]) for s, v in timed}
                                   for i, name in enumerate(names)})
    return out or None


def comm_measured(times: Mapping[int, RankStepTimes]) -> bool:
    """Whether every rank's collectives were timed: time spent waiting in them is
    then its communication, never its compute."""
    return bool(times) and all(t.communication_ms > 0 for t in times.values())


def diagnose_step_time(
    times: Mapping[int, RankStepTimes],
    unmeasured_why: str = "No step was completed by every rank after warm-up.",
    device: str = "cpu",
) -> tuple[Finding, ...]:
    """The Step Time findings, diagnosis first: stragglers, input-bound, wait-heavy and
    communication-bound (the most wall time to win back first); else COMPUTE-BOUND
    (also beside an UNCLEAR STRAGGLER that names no rank); else BALANCED.  OUTLIER
    STEPS, when actionable, takes its place among them by the wall time it would win
    back (its ``win_back_ms``)."""
    if not times:
        return (not_measured("STEP TIME", unmeasured_why),)
    measured = comm_measured(times)
    on_gpu = gpu_wait_measured(times)  # CUDA: the GPU's wait on DDP's collectives
    found = stragglers(times, device)
    found += input_bound(times, device) + wait_heavy(times)
    found += gpu_communication_bound(times) if on_gpu else communication_bound(times)
    if len(times) >= 2 and not measured and not on_gpu:
        found.append(not_measured(
            "COMMUNICATION", "Collectives were not timed end to end (CUDA/NCCL, a hook or "
            "backend traceml cannot time, or none ran), so a rank waiting for another may "
            "read as its own compute."))
    if not any(f.measured and f.kind != attribution.UNSTEADY_KIND for f in found):
        # Ranks that differ without a cause do not make a compute-bound job less so.
        found = compute_bound(times, device) + found
    typical = by_win_back(order_findings(found, balanced(times)), times)
    outliers = outlier_steps({r: t.outliers for r, t in times.items() if t.outliers})
    if not outliers:
        return typical
    # Every actionable finding by the wall time it would win back; the rest after.
    def gain(f: Finding) -> float:
        return (f.evidence.get("win_back_ms") or 0.0) if f in outliers else win_back_ms(f, times)
    head = sorted((f for f in (*typical, *outliers) if f.actionable), key=lambda f: -gain(f))
    if not head:
        return (typical[0], *outliers, *typical[1:])
    return (*head, *(f for f in (*typical, *outliers) if not f.actionable))


def by_win_back(findings: tuple[Finding, ...], times: Mapping[int, RankStepTimes]
                ) -> tuple[Finding, ...]:
    """The actionable findings first, the one with the most wall time to win back
    first (severity breaks ties), then the rest as they were."""
    actionable = sorted((f for f in findings if f.actionable),
                        key=lambda f: (-win_back_ms(f, times), severity_rank(f.severity)))
    return (*actionable, *(f for f in findings if not f.actionable))


def win_back_ms(finding: Finding, times: Mapping[int, RankStepTimes]) -> float:
    """The wall time over the window's typical steps an actionable Step Time
    finding would win back if fixed: its per-step excess (a straggler's) or
    phase time (input, wait, communication) times the typical steps; 0 for
    info findings (a healthy COMPUTE-BOUND)."""
    if not finding.actionable:
        return 0.0
    per_step = next((v for k in ("excess_ms", "input_ms", "wait_ms", "communication_ms")
                     if (v := finding.evidence.get(k)) is not None), 0.0)
    return per_step * statistics.median(t.total_ms.count for t in times.values())
