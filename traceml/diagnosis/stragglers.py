"""Straggler attribution: which rank's own work is slow, in which part (offline analysis).

Runs in the offline-analysis process (SPEC R-COMM-2).  Under synchronous data
parallelism every rank waits for the slowest one inside its next collective, so
step totals equalise and the waiting must never read as the waiting rank's own
slowness.  A rank's **own work** is each phase outside communication (input,
forward, backward compute, optimizer) and its untraced host work (``wait``);
exposed communication, measured as a phase of its own, is time spent waiting
for others and is never anyone's own work.

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
of it.  What remains names the rank, the part and the excess in ms.  When a
candidate was dropped and nothing remains, the rule says it cannot tell.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from traceml import phases
from traceml.diagnosis import thresholds
from traceml.diagnosis.finding import Finding, as_borderline, borderline, format_ranks, grade
from traceml.diagnosis.stats import medians_of_others

OWN_PARTS = (*(p.name for p in phases.PHASES if not p.collective), phases.WAIT.name)
"""The parts of a step that are a rank's own work: every non-collective phase, and wait."""

COMPUTE_PARTS = phases.compute_names()
INPUT_PART = "input"
UNTRACED_PART = phases.WAIT.name


class RankTimes(Protocol):
    """What attribution reads of one rank's step times (`step_time.RankStepTimes`)."""

    def mean(self, phase: str) -> float: ...


@dataclass(frozen=True)
class Excess:
    """How much one rank's own time in one part exceeds the other ranks' (ms)."""

    rank: int
    part: str  # one of OWN_PARTS, or "own work" (several parts together)
    value_ms: float
    reference_ms: float

    @property
    def excess_ms(self) -> float:
        """Own time beyond the reference; negative when faster."""
        return self.value_ms - self.reference_ms


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
              comm_measured: bool) -> tuple[list[Excess], list[Excess]]:
    """The candidates that stand (largest first) and those another rank explains."""
    found = [e for e in every.values() if e.excess_ms >= limit_ms]
    explained: list[Excess] = []
    if not comm_measured:
        by_wait = _explainer([e for e in every.values() if e.part in (INPUT_PART, UNTRACED_PART)])
        explained = [e for e in found if e.part in COMPUTE_PARTS and by_wait(e)]
    waiting = _keys(explained)
    standing = [e for e in found if (e.rank, e.part) not in waiting]
    by_other = _explainer([e for e in standing if e.part != UNTRACED_PART])
    explained += [e for e in standing if e.part == UNTRACED_PART and by_other(e)]
    dropped = _keys(explained)
    standing = [e for e in standing if (e.rank, e.part) not in dropped]
    return sorted(standing, key=lambda e: -e.excess_ms), explained


def _keys(excesses: Sequence[Excess]) -> set[tuple[int, str]]:
    return {(e.rank, e.part) for e in excesses}


_KINDS = {INPUT_PART: ("INPUT_STRAGGLER", "INPUT STRAGGLER"),
          UNTRACED_PART: ("HOST_STRAGGLER", "HOST-WORK STRAGGLER")}
_COMPUTE_KIND = ("COMPUTE_STRAGGLER", "COMPUTE STRAGGLER")
_COMBINED_KIND = ("STRAGGLER", "STRAGGLER")


def _kind(part: str) -> tuple[str, str]:
    if part == "own work":
        return _COMBINED_KIND
    return _KINDS.get(part, _COMPUTE_KIND)


def stragglers(times: Mapping[int, RankTimes], step_ms: float,
               comm_measured: bool, device: str = "cpu") -> list[Finding]:
    """INPUT / COMPUTE / HOST-WORK STRAGGLER, STRAGGLER (own work together), or
    UNCLEAR STRAGGLER: with >= 2 ranks, from each rank's own work."""
    if len(times) < 2 or step_ms <= 0:
        return []
    # Candidates from just below the limit: those near it are said as borderline.
    limit_ms = ((1.0 - thresholds.BORDERLINE_MARGIN) * thresholds.STRAGGLER_WARN_PCT
                * step_ms / 100.0)
    every = excesses(times)
    standing, explained = attribute(every, limit_ms, comm_measured)
    seen = {e.rank for e in standing + explained}
    standing += _combined(every, sorted(set(times) - seen), limit_ms, comm_measured)
    standing.sort(key=lambda e: -e.excess_ms)
    by_kind: dict[tuple[str, str], list[Excess]] = {}
    for excess in standing:
        by_kind.setdefault(_kind(excess.part), []).append(excess)
    found = [_straggler(kind, group, step_ms, device) for kind, group in by_kind.items()]
    if not found and explained:
        found.append(_unclear(explained, step_ms))
    return found


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
            out.append(Excess(rank, "own work", value, value - extra))
    return out


def _straggler(kind: tuple[str, str], found: list[Excess], step_ms: float,
               device: str) -> Finding:
    worst = found[0]
    excess_pct = 100.0 * worst.excess_ms / step_ms
    severity = grade(excess_pct, thresholds.STRAGGLER_WARN_PCT, thresholds.STRAGGLER_CRIT_PCT)
    near = borderline(excess_pct, thresholds.STRAGGLER_WARN_PCT)
    ranks = tuple(dict.fromkeys(e.rank for e in found))
    why = (f"r{worst.rank} {_part_text(worst.part)} was {worst.value_ms:.1f} ms vs "
           f"{worst.reference_ms:.1f} ms on the other ranks (+{worst.excess_ms:.1f} ms, "
           f"{excess_pct:.1f}% of the {step_ms:.1f} ms typical step).")
    if len(ranks) > 1:
        why = why[:-1] + f"; slow too: {format_ranks(ranks[1:])}."
    evidence = {"rank": worst.rank, "value_ms": worst.value_ms,
                "reference_ms": worst.reference_ms, "excess_ms": worst.excess_ms,
                "step_ms": step_ms, "excess_pct": excess_pct}
    finding = Finding(kind[0], kind[1], severity or "warn", why,
                      _next(kind[0], worst, device), ranks, evidence)
    if near:
        return as_borderline(finding, thresholds.STRAGGLER_WARN_PCT, "% of the step")
    return finding


def _part_text(part: str) -> str:
    if part == UNTRACED_PART:
        return "untraced host work (outside every phase)"
    return part


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


def _unclear(explained: list[Excess], step_ms: float) -> Finding:
    worst = max(explained, key=lambda e: e.excess_ms)
    why = (f"r{worst.rank} {_part_text(worst.part)} took +{worst.excess_ms:.1f} ms per step "
           f"over the other ranks ({100.0 * worst.excess_ms / step_ms:.1f}% of the "
           f"{step_ms:.1f} ms typical step), but another rank's slower input or host work "
           f"may explain it (r{worst.rank} may be waiting for that rank in a collective "
           "traceml did not time), so which rank is slow cannot be told.")
    return Finding("STRAGGLER_UNCLEAR", "UNCLEAR STRAGGLER", "info", why,
                   "Run with a backend whose collectives traceml times (gloo, or NCCL with "
                   "DDP/FSDP), or profile the ranks side by side with torch.profiler.",
                   (worst.rank,), {"excess_ms": worst.excess_ms, "step_ms": step_ms})
