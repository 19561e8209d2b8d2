"""Does traceml name the slow rank and its cause?  Hit rates on real 2-rank gloo DDP.

Runs each case under ``traceml run --nproc-per-node 2`` N times (default 10),
interleaved so machine load hits every case alike, and checks each summary's
Step Time findings.

Injected with a sleep (tests/e2e/scripts/ddp_cases.py):

  backward   r1 spends 15 ms more inside backward, before its gradients are
             ready -> COMPUTE STRAGGLER naming r1 and backward, no other straggler
  between    r1 does 15 ms of host work between its steps -> HOST-WORK
             STRAGGLER naming r1; r0 (which waits for it) never named
  network    every rank's last all-reduce ends 15 ms late -> COMMUNICATION-BOUND
             diagnosis, no straggler
  balanced   nothing injected -> no straggler

From real causes, no sleep anywhere (tests/e2e/scripts/ddp_real.py):

  heavy      67 MB of gradients, 2 rows per batch, plain DDP: the all-reduce is
             most of the step -> COMMUNICATION-BOUND diagnosis, no rank named
  hook       the same with a compression-style comm hook that works before it
             launches -> COMMUNICATION-BOUND; each rank's stored hook_ms within
             +-(0.5 ms + 5 %) of the hook's own timing of itself in the same step
             (the median step)
  uneven     r1 gets twice the rows per batch -> COMPUTE STRAGGLER naming r1,
             forward and backward
  shared     r1 shares its core with a spinning process -> COMPUTE STRAGGLER
             naming r1 alone
  large      the heavy model with 1024 rows per batch -> COMPUTE-BOUND
             diagnosis, no rank named
  conv       a convnet with BatchNorm (DDP broadcasts its statistics as forward
             begins), r1 gets twice the images -> COMPUTE STRAGGLER naming r1,
             forward and backward, and the arrivals at backward's first
             collective name r1 last (not the broadcast, where the ranks meet)

For the injected straggler cases it also checks the measured excess against the
injected delay: within +-(1 ms + 15 %).  For ``network`` the excess is the
exposed communication over that of the balanced runs (medians).  Prints one
line per case (hits/runs, and the case's figures) and exits 1 when any case
misses.  About 15 minutes for 10 runs of every case on 2 cores.

    python scripts/bench_straggler_accuracy.py [--runs 10] [--delay-ms 15] [--cases ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accuracy_runs import run_summary
from bench_options import parse

from traceml.store import STORE_FILENAME, StoreReader

ROOT = Path(__file__).resolve().parent.parent
SLEEPS = ROOT / "tests" / "e2e" / "scripts" / "ddp_cases.py"
REAL = ROOT / "tests" / "e2e" / "scripts" / "ddp_real.py"
INJECTED = ("backward", "between", "network", "balanced")
REAL_STEPS = {"heavy": 30, "hook": 20, "uneven": 40, "shared": 40, "large": 16, "conv": 30}
CASES = (*INJECTED, *REAL_STEPS)

Summary = dict[str, Any]
Evidence = list[dict[str, Any]]  # each rank's rank<R>.json


@dataclass
class Tally:
    """One case's runs: hits, and the figure measured in each run."""

    hits: int = 0
    runs: int = 0
    excess_ms: list[float] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)


def run_case(case: str, delay_ms: float, steps: int, logs: Path, n: int) -> tuple[Summary, Evidence]:
    """One traceml run of one case; its final_summary.json and the ranks' evidence."""
    evidence = logs / f"{case}-{n}-evidence"
    evidence.mkdir()
    if case in INJECTED:
        args = [str(SLEEPS), "--case", case, "--delay-ms", str(delay_ms), "--steps", str(steps)]
    else:
        args = [str(REAL), "--case", case, "--steps", str(REAL_STEPS[case])]
    summary = run_summary(logs, f"{case}-{n}", ["--nproc-per-node", "2", *args], 300,
                          f"{case} run {n}", {"EVIDENCE_DIR": str(evidence)})
    ranks = [json.loads(p.read_text()) for p in sorted(evidence.glob("rank*.json"))]
    return summary, ranks


def stragglers(summary: Summary) -> list[dict[str, Any]]:
    return [f for f in summary["step_time"]["findings"] if "STRAGGLER" in f["kind"]]


def named(summary: Summary) -> list[tuple[str, list[int]]]:
    """The straggler findings that name a rank."""
    return [(f["kind"], f["ranks"]) for f in stragglers(summary) if f["ranks"]]


Check = Callable[[Summary, Evidence, Path], str]


def straggler_check(kind: str, why_prefix: str) -> Check:
    """A check that exactly one straggler finding, ``kind``, names r1 alone."""
    def check(summary: Summary, evidence: Evidence, session: Path) -> str:
        found = named(summary)
        if found != [(kind, [1])]:
            return f"stragglers {found}"
        why = next(f["why"] for f in stragglers(summary) if f["ranks"])
        return "" if why.startswith(why_prefix) else f"why {why!r}"
    return check


def arrival_check(check: Check) -> Check:
    """``check``, and the arrivals name r1 last at most steps, cited by its finding."""
    def checked(summary: Summary, evidence: Evidence, session: Path) -> str:
        miss = check(summary, evidence, session)
        arrival = summary["step_time"]["arrival"]
        if not miss and (arrival is None or arrival["last_rank"] != 1):
            return f"arrival {arrival}"
        return miss
    return checked


def diagnosis_check(kind: str) -> Check:
    """A check that Step Time's diagnosis is ``kind`` and no rank is named."""
    def check(summary: Summary, evidence: Evidence, session: Path | None = None) -> str:
        diagnosis = summary["step_time"]["diagnosis"]["kind"]
        found = named(summary)
        if diagnosis != kind or found:
            return f"diagnosis {diagnosis}, stragglers {found}"
        return ""
    return check


def balanced_check(summary: Summary, evidence: Evidence, session: Path) -> str:
    found = named(summary)
    return f"stragglers {found}" if found else ""


def hook_check(summary: Summary, evidence: Evidence, session: Path) -> str:
    """COMMUNICATION-BOUND, and each rank's hook_ms step by step (the stored steps,
    after warm-up, the FLOP-counting step left out) within +-(0.5 ms + 5 %) of the
    hook's own timing of itself in the same step, for the median step."""
    miss = diagnosis_check("COMMUNICATION_BOUND")(summary, evidence, session)
    if miss:
        return miss
    for rank, (error, truth) in hook_errors(evidence, session).items():
        if error is None or error > 0.5 + 0.05 * truth:
            return f"r{rank} hook_ms off its own timing by {error} ms (median step)"
    return ""


def hook_errors(evidence: Evidence, session: Path) -> dict[int, tuple[float | None, float]]:
    """Per rank: the median step's |stored hook_ms - the hook's own timing|, and the
    hook's own median ms per step."""
    stored = stored_steps(session)
    out: dict[int, tuple[float | None, float]] = {}
    for rank in evidence:
        own = rank["hook_ms"]
        errors = [abs(row.phase_ms["hook"] - own[row.step]) for row in stored
                  if row.rank == rank["rank"] and WARMUP <= row.step < len(own)
                  and not row.flops_counted]
        out[rank["rank"]] = (statistics.median(errors) if errors else None,
                             statistics.median(own[WARMUP:]))
    return out


WARMUP = 5
"""Steps of the hook case left out of its check: the first ones are slow."""


def stored_steps(session: Path) -> list[Any]:
    """Every step row a session's store holds."""
    reader = StoreReader(session / STORE_FILENAME)
    try:
        return list(reader.steps_after(0, 1_000_000).rows)
    finally:
        reader.close()


CHECKS: dict[str, Check] = {
    "backward": straggler_check("COMPUTE_STRAGGLER", "r1 backward"),
    "between": straggler_check("HOST_STRAGGLER", "r1 untraced host work"),
    "network": diagnosis_check("COMMUNICATION_BOUND"),
    "balanced": balanced_check,
    "heavy": diagnosis_check("COMMUNICATION_BOUND"),
    "hook": hook_check,
    "uneven": straggler_check("COMPUTE_STRAGGLER", "r1 forward and backward"),
    "shared": straggler_check("COMPUTE_STRAGGLER", "r1 "),
    "large": diagnosis_check("COMPUTE_BOUND"),
    "conv": arrival_check(straggler_check("COMPUTE_STRAGGLER", "r1 forward and backward")),
}


def figure(case: str, summary: Summary) -> str:
    """What one run measured, for the case's line: the excess, or the diagnosis's share."""
    step = summary["step_time"]
    diagnosis = step["diagnosis"]
    if case in ("uneven", "shared", "conv") and named(summary):
        found = next(f for f in stragglers(summary) if f["ranks"])
        arrival = step["arrival"] if case == "conv" else None
        return f"+{found['evidence']['excess_ms']:.1f} ms" + (
            f" (last {arrival['median_ms']:.0f} ms)" if arrival else "")
    share = diagnosis["evidence"].get("communication_share_pct") or diagnosis["evidence"].get(
        "compute_share_pct")
    return f"{share:.0f}%" if share is not None else diagnosis["kind"]


def exposed_ms(summary: Summary) -> float:
    return float(summary["step_time"]["stats"]["communication_ms"]["median"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs per case (default 10)")
    p.add_argument("--delay-ms", type=float, default=15.0, help="injected delay (default 15)")
    p.add_argument("--steps", type=int, default=30, help="training steps per injected run")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    args = parse(p, quick={"runs": 1, "cases": ["backward", "hook"], "steps": 20},
                 limit_s=7200.0)
    tallies = {case: Tally() for case in args.cases}
    exposed: dict[str, list[float]] = {case: [] for case in args.cases}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.runs):  # cases interleaved: machine load hits them alike
            for case in args.cases:
                summary, evidence = run_case(case, args.delay_ms, args.steps, Path(tmp), n)
                tally = tallies[case]
                tally.runs += 1
                miss = CHECKS[case](summary, evidence, Path(tmp) / f"{case}-{n}")
                found = named(summary)
                if found and case in ("backward", "between"):
                    tally.excess_ms.append(float(stragglers(summary)[0]["evidence"]["excess_ms"]))
                elif case not in INJECTED:
                    tally.figures.append(figure(case, summary))
                if case == "hook":
                    errors = hook_errors(evidence, Path(tmp) / f"{case}-{n}").values()
                    worst = max((e for e, _ in errors if e is not None), default=None)
                    tally.figures[-1] += f" ({worst:.2f} ms off)" if worst is not None else ""
                exposed[case].append(exposed_ms(summary))
                if miss:
                    tally.misses.append(f"run {n}: {miss}")
                else:
                    tally.hits += 1
    return report(tallies, exposed, args.delay_ms)


def report(tallies: dict[str, Tally], exposed: dict[str, list[float]], delay_ms: float) -> int:
    if "network" in tallies and exposed.get("balanced"):
        base = statistics.median(exposed["balanced"])
        tallies["network"].excess_ms = [e - base for e in exposed["network"]]
    tolerance = 1.0 + 0.15 * delay_ms
    print(f"straggler accuracy, 2-rank gloo DDP, injected {delay_ms:.0f} ms "
          f"(excess must be within +-{tolerance:.2f} ms)")
    ok = True
    for case, tally in tallies.items():
        line = f"  {case:9s} {tally.hits}/{tally.runs} hit"
        if tally.excess_ms:
            inside = sum(abs(e - delay_ms) <= tolerance for e in tally.excess_ms)
            line += (f" | excess median {statistics.median(tally.excess_ms):.1f} ms, range "
                     f"{min(tally.excess_ms):.1f}-{max(tally.excess_ms):.1f} ms, "
                     f"{inside}/{len(tally.excess_ms)} within tolerance")
            ok &= inside == len(tally.excess_ms)
        if tally.figures:
            line += " | " + " ".join(tally.figures)
        print(line)
        for miss in tally.misses:
            print(f"    miss {miss}")
        ok &= tally.hits == tally.runs
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
