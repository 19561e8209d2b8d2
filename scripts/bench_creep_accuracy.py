"""Is a steady memory creep found every time, and a flat run with noisy RSS never?

Runs tests/e2e/scripts/creep_cases.py under ``traceml run`` N times per case
(default 10), interleaved, and checks each summary's Step Memory findings:

  creep  every step keeps 1 MB alive, 300 steps -> HOST RSS CREEP
  flat   allocator noise (random buffers allocated and freed, a bounded cache
         evicted at random), 300 steps -> no HOST RSS CREEP

Prints one line per case (hits/runs, and the measured growth of the creep
runs) and exits 1 when any case misses.  About 6 s per run on 2 idle cores.

    python scripts/bench_creep_accuracy.py [--runs 10] [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from accuracy_runs import run_summary
from bench_options import parse

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "creep_cases.py"
CASES = ("creep", "flat")
MB = 1e6


def run_case(case: str, steps: int, logs: Path, n: int) -> dict[str, Any]:
    """One traceml run of one case; its final_summary.json."""
    return run_summary(logs, f"{case}-{n}", [str(SCRIPT), "--case", case, "--steps", str(steps)],
                       600, f"{case} run {n}")


def creep(summary: dict[str, Any]) -> dict[str, Any] | None:
    found = [f for f in summary["step_memory"]["findings"] if f["kind"] == "RSS_CREEP"]
    return found[0] if found else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs per case (default 10)")
    p.add_argument("--steps", type=int, default=300, help="training steps per run")
    args = parse(p, quick={"runs": 1}, limit_s=7200.0)
    hits = {case: 0 for case in CASES}
    growth_mb: list[float] = []
    misses: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.runs):  # cases interleaved: machine load hits them alike
            for case in CASES:
                found = creep(run_case(case, args.steps, Path(tmp), n))
                if found is not None and case == "creep":
                    growth_mb.append(found["evidence"]["growth_bytes"] / MB)
                if (found is not None) == (case == "creep"):
                    hits[case] += 1
                else:
                    misses.append(f"{case} run {n}: " + (found["why"] if found else "no creep"))
    print(f"memory creep accuracy, {args.steps} steps per run, {args.runs} runs per case")
    print(f"  creep  {hits['creep']}/{args.runs} found HOST RSS CREEP"
          + (f" | growth median {statistics.median(growth_mb):.0f} MB, range "
             f"{min(growth_mb):.0f}-{max(growth_mb):.0f} MB (kept: "
             f"{(args.steps - 1) * 1.0:.0f} MB over the window at most)" if growth_mb else ""))
    print(f"  flat   {args.runs - hits['flat']}/{args.runs} found HOST RSS CREEP")
    for miss in misses:
        print(f"    miss {miss}")
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
