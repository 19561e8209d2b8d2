"""Straggler attribution: which rank's own work is slow, in which part (offline analysis).

Runs in the offline-analysis process (SPEC R-COMM-2).  Under synchronous data
parallelism every rank waits for the slowest one inside its next collective, so
step totals equalise and the waiting must never read as the waiting rank's own
slowness.  A rank's **own work** is each phase outside communication (input,
forward, backward compute, optimizer) and its untraced host work (``wait``);
exposed communication, measured as a phase of its own, is time spent waiting
for others and is never anyone's own work.  A comm hook's own work (``hook``)
is left out too, though it is mostly the rank's: a hook may block in a
collective, and a wait must never be blamed; a slower hook shows in
COMMUNICATION-BOUND instead.

For each rank and part, the **excess** is the rank's mean minus the median of
the other ranks' means (with 2 ranks: the other rank).  A part whose excess
reaches ``STRAGGLER_WARN_PCT`` of the median step is a candidate.  A
candidate is dropped when another rank's excess **explains** it, i.e. the
candidate's time may itself be waiting for that rank:

* untraced work (``wait``) can hold waiting in a sync traceml does not time
  (a ``.item()`` after a collective, a C++ barrier): it is explained by another
  rank's unexplained excess in any other part;
* compute phases can hold waiting only when communication was not measured
  (DDP's all-reduce then runs inside backward, FSDP's all-gather inside
  forward): then they are explained by another rank's input or untraced excess;
* input never holds waiting.

An excess explains another when it is at least ``STRAGGLER_EXPLAINS_FRACTION``
of it.  What remains must also **hold step by step**, since a mean can come
from a coin toss (`traceml.diagnosis.steadiness`, SPEC R-COMM-4).

What remains names the rank, the part (a rank slow in several compute phases has
them named together: "forward and backward") and the excess in ms.  When nothing
remains, the rule says it cannot tell, and why: UNCLEAR STRAGGLER, either
``STRAGGLER_UNSTEADY`` (an excess that does not hold step by step; no rank is
named) or ``STRAGGLER_UNCLEAR`` (an excess another rank's may explain).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from traceml import phases
from traceml.diagnosis import thresholds
from traceml.diagnosis.finding import Finding, as_borderline, borderline, format_ranks, grade
from traceml.diagnosis.stats import medians_of_others
from traceml.diagnosis.steadiness import Consistency, StepSeries

OWN_PARTS = (*(p.name for p in phases.PHASES if not p.collective), phases.WAIT.name)
"""The parts of a step that are a rank's own work: every non-collective phase, and wait."""

COMPUTE_PARTS = phases.compute_names()
INPUT_PART = "input"
FORWARD_PART = "forward"
UNTRACED_PART = phases.WAIT.name


class RankTimes(Protocol):
    """What attribution reads of one rank's step times (`step_time.RankStepTimes`)."""

    def mean(self, phase: str) -> float: ...

    def per_step(self, phase: str) -> Mapping[int, float]: ...


@dataclass(frozen=True)
class Excess:
    """How much one rank's own time in one part exceeds the other ranks' (ms)."""

    rank: int
    part: str  # one of OWN_PARTS; "own work" or "forward and backward": several together
    value_ms: float
    reference_ms: float
    members: tuple[str, ...] = ()  # the OWN_PARTS a combined part adds up; () for one part

    @property
    def excess_ms(self) -> float:
        """Own time beyond the reference; negative when faster."""
        return self.value_ms - self.reference_ms

    @property
    def parts(self) -> tuple[str, ...]:
        """The OWN_PARTS whose time this is."""
        return self.members or (self.part,)


def excesses(times: Mapping[int, RankTimes]) -> dict[tuple[int, str], Excess]:
    """Every rank's excess in every own part (needs >= 2 ranks)."""
    out = {}
    for part in OWN_PARTS:
        means = {r: t.mean(part) for r, t in times.items()}
        for rank, reference in medians_of_others(means).items():
            out[rank, part] = Excess(rank, part, means[rank], reference)
    return out


def _explains(by: Excess, excess: Excess) -> bool:
    return (by.rank != excess.rank
            and by.excess_ms >= thresholds.STRAGGLER_EXPLAINS_FRACTION * excess.excess_ms)


def _explainer(by: Sequence[Excess]) -> Callable[[Excess], bool]:
    """Whether any of ``by`` explains an excess, in constant time per question: of
    another rank's excesses only the largest can matter, so the two largest of
    different ranks are kept (thousands of ranks ask it of each other)."""
    ordered = sorted(by, key=lambda e: -e.excess_ms)
    first = ordered[0] if ordered else None
    second = next((e for e in ordered if first is not None and e.rank != first.rank), None)

    def explained(excess: Excess) -> bool:
        other = first if first is not None and first.rank != excess.rank else second
        return other is not None and _explains(other, excess)
    return explained


def attribute(every: Mapping[tuple[int, str], Excess], limit_ms: float,
              comm_measured: bool, forward_waits: bool = False
              ) -> tuple[list[Excess], list[Excess]]:
    """The candidates that stand (largest first) and those another rank explains.
    ``forward_waits``: forward may hold waiting for another rank's any part (on the
    GPU: DDP's buffer broadcast or FSDP's all-gathers make the GPU wait there)."""
    found = [e for e in every.values() if e.excess_ms >= limit_ms]
    explained: list[Excess] = []
    if not comm_measured:
        by_wait = _explainer([e for e in every.values() if e.part in (INPUT_PART, UNTRACED_PART)])
        explained = [e for e in found if e.part in COMPUTE_PARTS and by_wait(e)]
    if forward_waits:
        by_any = _explainer([e for e in every.values() if e.part != FORWARD_PART])
        explained += [e for e in found if e.part == FORWARD_PART and e not in explained
                      and by_any(e)]
    waiting = _keys(explained)
    standing = [e for e in found if (e.rank, e.part) not in waiting]
    by_other = _explainer([e for e in standing if e.part != UNTRACED_PART])
    explained += [e for e in standing if e.part == UNTRACED_PART and by_other(e)]
    dropped = _keys(explained)
    standing = [e for e in standing if (e.rank, e.part) not in dropped]
    return sorted(standing, key=lambda e: -e.excess_ms), explained


def _keys(excesses: Sequence[Excess]) -> set[tuple[int, str]]:
    return {(e.rank, e.part) for e in excesses}


UNCLEAR_KIND = "STRAGGLER_UNCLEAR"
"""UNCLEAR STRAGGLER (info): a rank's excess another rank's may explain (collectives
not timed): which rank is slow cannot be told."""

UNSTEADY_KIND = "STRAGGLER_UNSTEADY"
"""UNCLEAR STRAGGLER (info): ranks differ on the mean, but no rank's excess holds
step by step: no single rank is the cause, and none is named."""

_KINDS = {INPUT_PART: ("INPUT_STRAGGLER", "INPUT STRAGGLER"),
          UNTRACED_PART: ("HOST_STRAGGLER", "HOST-WORK STRAGGLER")}
_COMPUTE_KIND = ("COMPUTE_STRAGGLER", "COMPUTE STRAGGLER")
_COMBINED_KIND = ("STRAGGLER", "STRAGGLER")
STRAGGLER_KINDS = frozenset(k for k, _ in (*_KINDS.values(), _COMPUTE_KIND, _COMBINED_KIND))
"""The findings that name one slow rank."""


def _kind(part: str) -> tuple[str, str]:
    if part == "own work":
        return _COMBINED_KIND
    return _KINDS.get(part, _COMPUTE_KIND)


def stragglers(times: Mapping[int, RankTimes], step_ms: float,
               comm_measured: bool, device: str = "cpu", on_gpu: bool = False
               ) -> list[Finding]:
    """INPUT / COMPUTE / HOST-WORK STRAGGLER, STRAGGLER (own work together), or
    UNCLEAR STRAGGLER: with >= 2 ranks, from each rank's own work, named only when
    its excess holds step by step.  ``on_gpu``: the compute parts are GPU times on
    each rank's own sample of steps (CUDA), held against the other ranks' typical
    value sample by sample rather than step by step."""
    if len(times) < 2 or step_ms <= 0:
        return []
    # Candidates from just below the limit: those near it are said as borderline.
    limit_ms = ((1.0 - thresholds.BORDERLINE_MARGIN) * thresholds.STRAGGLER_WARN_PCT
                * step_ms / 100.0)
    every = excesses(times)
    standing, explained = attribute(every, limit_ms, comm_measured, forward_waits=on_gpu)
    seen = {e.rank for e in standing + explained}
    standing += _combined(every, sorted(set(times) - seen), limit_ms, comm_measured)
    siblings = _siblings(every, limit_ms, comm_measured)
    series = StepSeries(times, frozenset(COMPUTE_PARTS) if on_gpu else frozenset())
    held, unsteady = _steady(_together(standing, siblings), series)
    named = sorted(held, key=lambda e: -e.excess_ms)
    by_kind: dict[tuple[str, str], list[Excess]] = {}
    for excess in named:
        by_kind.setdefault(_kind(excess.part), []).append(excess)
    found = [_straggler(kind, group, step_ms, device, min(held[group[0]].slower_pct), on_gpu)
             for kind, group in by_kind.items()]
    if not found and unsteady:
        found.append(_unsteady(*max(unsteady, key=lambda ec: ec[0].excess_ms), step_ms,
                               on_gpu))
    elif not found and explained:
        found.append(_unclear(explained, step_ms, device, on_gpu))
    return found


def _steady(candidates: list[tuple[Excess, list[Excess]]], series: StepSeries
            ) -> tuple[dict[Excess, Consistency], list[tuple[Excess, Consistency]]]:
    """The candidates whose excess holds step by step, and those that do not.  A
    candidate that does not hold has its parts tried one by one (a rank's compute
    phases together: its backward alone may still hold)."""
    held: dict[Excess, Consistency] = {}
    unsteady = []
    for excess, parts in candidates:
        tried = series.consistency(excess.rank, excess.parts)
        if tried.holds:
            held[excess] = tried
            continue
        unsteady.append((excess, tried))
        for part in parts:
            alone = series.consistency(part.rank, part.parts)
            if alone.holds:
                held[part] = alone
    return held, unsteady


def _siblings(every: Mapping[tuple[int, str], Excess], limit_ms: float,
              comm_measured: bool) -> list[Excess]:
    """Compute excesses at least `STRAGGLER_SIBLING_FRACTION` of the limit, less any
    another rank's input or untraced excess may explain (communication not
    measured: the phase may hold waiting), as in `_combined`."""
    found = [e for e in every.values() if e.part in COMPUTE_PARTS
             and e.excess_ms >= thresholds.STRAGGLER_SIBLING_FRACTION * limit_ms]
    if comm_measured:
        return found
    by_wait = _explainer([e for e in every.values() if e.part in (INPUT_PART, UNTRACED_PART)])
    return [e for e in found if not by_wait(e)]


def _together(found: list[Excess], siblings: list[Excess]
              ) -> list[tuple[Excess, list[Excess]]]:
    """The candidates to test, each with the parts to fall back on: a rank with a
    standing compute phase is one candidate with its ``siblings`` (its other
    compute phases at least `STRAGGLER_SIBLING_FRACTION` of the limit slower:
    "forward and backward"), since the rank does more of the same work (a
    larger shard, a busier core)."""
    compute: dict[int, list[Excess]] = {}
    out: list[tuple[Excess, list[Excess]]] = []
    for excess in found:
        if excess.part in COMPUTE_PARTS:
            compute.setdefault(excess.rank, []).append(excess)
        else:
            out.append((excess, []))
    for rank, standing in compute.items():
        group = sorted({*standing, *(e for e in siblings if e.rank == rank)},
                       key=lambda e: COMPUTE_PARTS.index(e.part))
        if len(group) == 1:
            out.append((group[0], []))
            continue
        names = tuple(e.part for e in group)
        together = Excess(rank, phases.describe(tuple(p for p in phases.PHASES
                                                      if p.name in names)),
                          sum(e.value_ms for e in group), sum(e.reference_ms for e in group),
                          names)
        out.append((together, standing))
    return out


def _combined(every: Mapping[tuple[int, str], Excess], ranks: list[int], limit_ms: float,
              comm_measured: bool) -> list[Excess]:
    """Ranks whose own parts are each below the limit but together reach it
    (signed: noise in one part is not added up, it cancels): input and compute,
    less any compute another rank's input or untraced excess may explain
    (communication not measured); untraced work never, as it may be waiting."""
    by_wait = _explainer([e for e in every.values() if e.part in (INPUT_PART, UNTRACED_PART)])
    out = []
    for rank in ranks:
        parts = [every[rank, part] for part in (INPUT_PART, *COMPUTE_PARTS)]
        if not comm_measured:
            parts = [e for e in parts if e.part == INPUT_PART or not by_wait(e)]
        extra = sum(e.excess_ms for e in parts)
        if extra >= limit_ms:
            value = sum(e.value_ms for e in parts)
            out.append(Excess(rank, "own work", value, value - extra,
                              tuple(e.part for e in parts)))
    return out


def _straggler(kind: tuple[str, str], found: list[Excess], step_ms: float,
               device: str, slower_pct: float, on_gpu: bool = False) -> Finding:
    worst = found[0]
    excess_pct = 100.0 * worst.excess_ms / step_ms
    severity = grade(excess_pct, thresholds.STRAGGLER_WARN_PCT, thresholds.STRAGGLER_CRIT_PCT)
    near = borderline(excess_pct, thresholds.STRAGGLER_WARN_PCT)
    ranks = tuple(dict.fromkeys(e.rank for e in found))
    verb = "were" if " and " in worst.part else "was"
    why = (f"r{worst.rank} {_part_text(worst.part, on_gpu)} {verb} {worst.value_ms:.1f} ms "
           f"vs {worst.reference_ms:.1f} ms on the other ranks (+{worst.excess_ms:.1f} ms, "
           f"{excess_pct:.1f}% of the {step_ms:.1f} ms typical step; slower in "
           f"{slower_pct:.0f}% of {_steps_text(worst, on_gpu)}).")
    if len(ranks) > 1:
        why = why[:-1] + f"; slow too: {format_ranks(ranks[1:])}."
    evidence = {"rank": worst.rank, "value_ms": worst.value_ms,
                "reference_ms": worst.reference_ms, "excess_ms": worst.excess_ms,
                "step_ms": step_ms, "excess_pct": excess_pct, "slower_pct": slower_pct}
    finding = Finding(kind[0], kind[1], severity or "warn", why,
                      _next(kind[0], worst, device), ranks, evidence)
    if near:
        return as_borderline(finding, thresholds.STRAGGLER_WARN_PCT, "% of the step")
    return finding


def _part_text(part: str, on_gpu: bool = False) -> str:
    if part == UNTRACED_PART:
        return "untraced host work (outside every phase)"
    if on_gpu and part == "own work":
        return "own work (input on the host, compute on the GPU)"
    if on_gpu and part != INPUT_PART:
        return f"{part} on the GPU"
    return part


def _steps_text(excess: Excess, on_gpu: bool) -> str:
    """The steps an excess was held at: the rank's GPU-timed ones for a GPU time."""
    if on_gpu and any(p in COMPUTE_PARTS for p in excess.parts):
        return "its GPU-timed steps"
    return "the steps"


def _next(kind: str, worst: Excess, device: str) -> str:
    rank = f"r{worst.rank}"
    if kind == "INPUT_STRAGGLER":
        return (f"Check {rank}'s data path: its shard size, DataLoader num_workers, and storage "
                "or preprocessing load on its node; every rank should load alike.")
    if kind == "HOST_STRAGGLER":
        return (f"Look at what {rank} does between its steps that the others do not: "
                "rank-only logging, checkpointing or evaluation, host syncs (.item(), "
                ".cpu()), file I/O; py-spy dump or torch.profiler on that rank shows it.")
    if kind == "COMPUTE_STRAGGLER" and device == "cuda":
        return (f"Check {rank}'s {worst.part}: its GPU and node (clocks, temperature, other "
                "processes) and its batch shapes; uneven sequence lengths or rank-only work "
                "slow one rank.")
    if kind == "COMPUTE_STRAGGLER":
        return (f"Check {rank}'s {worst.part}: other processes or threads on its cores "
                "(OMP_NUM_THREADS, taskset), its node's load, and its batch shapes; uneven "
                "sequence lengths or rank-only work slow one rank.")
    return f"Profile {rank} with torch.profiler: several parts of its own work run slower."


def _unsteady(excess: Excess, held: Consistency, step_ms: float, on_gpu: bool = False
              ) -> Finding:
    """UNCLEAR STRAGGLER (info): ranks differ on the mean, but no rank is slower
    step by step; no rank is named."""
    excess_pct = 100.0 * excess.excess_ms / step_ms
    first, second = held.slower_pct
    if held.decided:
        how = (f"r{excess.rank} was slower in {first:.0f}% and {second:.0f}% of "
               f"{_steps_text(excess, on_gpu)} "
               f"of the window's two halves, typically by {held.median_excess_ms:.1f} ms "
               f"against {held.noise_ms:.1f} ms of step-to-step noise")
    else:
        how = (f"{held.num_steps} steps are too few to tell whether r{excess.rank} is "
               "slower step by step")
    why = (f"Ranks differ by {excess.excess_ms:.1f} ms per step in "
           f"{_part_text(excess.part, on_gpu)} "
           f"(r{excess.rank} {excess.value_ms:.1f} ms vs {excess.reference_ms:.1f} ms on the "
           f"other ranks, {excess_pct:.1f}% of the {step_ms:.1f} ms typical step), but not "
           f"consistently: {how}, so no single rank is the cause.")
    next_step = ("Nothing to fix on one rank: the difference moves between ranks from step "
                 "to step. On a shared host give each rank its own cores (taskset, "
                 "OMP_NUM_THREADS), so communication threads and compute do not compete; "
                 "if one rank stays slower over a longer run, profile it beside another "
                 "with torch.profiler.")
    evidence = {"rank": excess.rank, "excess_ms": excess.excess_ms, "step_ms": step_ms,
                "excess_pct": excess_pct, "num_steps": held.num_steps,
                "slower_pct_first_half": first, "slower_pct_second_half": second,
                "median_excess_ms": held.median_excess_ms, "noise_ms": held.noise_ms}
    return Finding(UNSTEADY_KIND, "UNCLEAR STRAGGLER", "info", why, next_step, (),
                   evidence)


def _unclear(explained: list[Excess], step_ms: float, device: str, on_gpu: bool = False
             ) -> Finding:
    worst = max(explained, key=lambda e: e.excess_ms)
    why = (f"r{worst.rank} {_part_text(worst.part, on_gpu)} took +{worst.excess_ms:.1f} ms "
           "per step "
           f"over the other ranks ({100.0 * worst.excess_ms / step_ms:.1f}% of the "
           f"{step_ms:.1f} ms typical step), but another rank's slower "
           f"{'work' if on_gpu else 'input or host work'} may explain it (r{worst.rank} may "
           "be waiting for that rank in a collective traceml did not time), so which rank "
           "is slow cannot be told.")
    next_step = UNCLEAR_NEXT.get(device, UNCLEAR_NEXT["cpu"])
    return Finding(UNCLEAR_KIND, "UNCLEAR STRAGGLER", "info", why, next_step,
                   (worst.rank,), {"excess_ms": worst.excess_ms, "step_ms": step_ms})


UNCLEAR_NEXT = {
    "cpu": ("Run with a backend whose collectives traceml times (gloo, or NCCL with "
            "DDP/FSDP), or profile the ranks side by side with torch.profiler."),
    "cuda": ("On CUDA a rank's compute can hold waiting for another rank: its host's time "
             "waits on its GPU, and its GPU's forward on a collective there (DDP's buffer "
             "broadcast, FSDP's all-gathers). Profile the ranks side by side (traceml "
             "capture, or torch.profiler)."),
}
"""UNCLEAR STRAGGLER's advice (collectives not timed) by device."""
