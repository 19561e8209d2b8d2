"""Does traceml name the slow rank and its cause?  Hit rates on real 2-rank gloo DDP.

Runs tests/e2e/scripts/ddp_cases.py under ``traceml run --nproc-per-node 2`` N
times per case (default 10) and checks each summary's Step Time findings:

  backward   r1 spends 15 ms more inside backward, before its gradients are
             ready -> COMPUTE STRAGGLER naming r1 and backward, no other straggler
  between    r1 does 15 ms of host work between its steps -> HOST-WORK
             STRAGGLER naming r1; r0 (which waits for it) never named
  network    every rank's last all-reduce ends 15 ms late -> COMMUNICATION-BOUND
             diagnosis, no straggler
  balanced   nothing injected -> no straggler

For the straggler cases it also checks the measured excess against the
injected delay: within +-(1 ms + 15 %).  For ``network`` the excess is the
exposed communication over that of the balanced runs (medians).  Prints one
line per case (hits/runs, excess median and range) and exits 1 when any case
misses.  About 8 s per run on 2 cores.

    python scripts/bench_straggler_accuracy.py [--runs 10] [--delay-ms 15] [--cases ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accuracy_runs import run_summary

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "ddp_cases.py"
CASES = ("backward", "between", "network", "balanced")


@dataclass
class Tally:
    """One case's runs: hits, and the measured excess of each run."""

    hits: int = 0
    runs: int = 0
    excess_ms: list[float] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)


def run_case(case: str, delay_ms: float, steps: int, logs: Path, n: int) -> dict[str, Any]:
    """One traceml run of one case; its final_summary.json."""
    return run_summary(logs, f"{case}-{n}", ["--nproc-per-node", "2", str(SCRIPT), "--case", case,
                                             "--delay-ms", str(delay_ms), "--steps", str(steps)],
                       300, f"{case} run {n}")


def stragglers(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in summary["step_time"]["findings"] if "STRAGGLER" in f["kind"]]


def straggler_check(kind: str, why_prefix: str) -> Callable[[dict[str, Any]], str]:
    """A check that exactly one straggler finding, ``kind``, names r1 alone."""
    def check(summary: dict[str, Any]) -> str:
        found = [(f["kind"], f["ranks"]) for f in stragglers(summary)]
        if found != [(kind, [1])]:
            return f"stragglers {found}"
        why = stragglers(summary)[0]["why"]
        return "" if why.startswith(why_prefix) else f"why {why!r}"
    return check


def network_check(summary: dict[str, Any]) -> str:
    diagnosis = summary["step_time"]["diagnosis"]["kind"]
    found = [(f["kind"], f["ranks"]) for f in stragglers(summary)]
    if diagnosis != "COMMUNICATION_BOUND" or found:
        return f"diagnosis {diagnosis}, stragglers {found}"
    return ""


def balanced_check(summary: dict[str, Any]) -> str:
    found = [(f["kind"], f["ranks"]) for f in stragglers(summary)]
    return f"stragglers {found}" if found else ""


CHECKS: dict[str, Callable[[dict[str, Any]], str]] = {
    "backward": straggler_check("COMPUTE_STRAGGLER", "r1 backward"),
    "between": straggler_check("HOST_STRAGGLER", "r1 untraced host work"),
    "network": network_check,
    "balanced": balanced_check,
}


def exposed_ms(summary: dict[str, Any]) -> float:
    return float(summary["step_time"]["stats"]["communication_ms"]["median"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs per case (default 10)")
    p.add_argument("--delay-ms", type=float, default=15.0, help="injected delay (default 15)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    args = p.parse_args()
    tallies = {case: Tally() for case in args.cases}
    exposed: dict[str, list[float]] = {case: [] for case in args.cases}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.runs):  # cases interleaved: machine load hits them alike
            for case in args.cases:
                summary = run_case(case, args.delay_ms, args.steps, Path(tmp), n)
                tally = tallies[case]
                tally.runs += 1
                miss = CHECKS[case](summary)
                found = stragglers(summary)
                if found and case in ("backward", "between"):
                    tally.excess_ms.append(float(found[0]["evidence"]["excess_ms"]))
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
        print(line)
        for miss in tally.misses:
            print(f"    miss {miss}")
        ok &= tally.hits == tally.runs
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
