"""Does a profiler capture name the operators that cost the time?  Hit rates on real
2-rank gloo DDP, zero code (tests/e2e/scripts/capture_job.py, no sleep anywhere).

Runs each case under ``traceml run --nproc-per-node 2`` N times (default 5),
interleaved, each until its capture is written, and checks the summary:

  uneven   r1 gets twice the rows per batch -> a COMPUTE STRAGGLER capture of r1 against
           r0, the same steps on both (``--capture-steps``, traceml's default 4); a
           matmul (aten::mm or aten::addmm) on top of its compute operators (not those
           of a fetch or an optimizer step), larger on r1; the
           operators' excess within +-25 % of the compute excess traceml timed in those
           steps
  heavy    67 MB of gradients, 2 rows per batch: the all-reduce is most of the step ->
           a COMMUNICATION-BOUND capture whose top operator is the collective
           (gloo:all_reduce)

Every run must also exit 0 (the profiler never breaks the training) with each rank's
step count stored whole.  Prints one line per case (hits/runs, and the operators'
excess against the phase's) and the captured steps' cost, and exits 1 when a case
misses.  About 6 minutes for 5 runs of each case on 2 cores.

    python scripts/bench_capture_accuracy.py [--runs 5] [--cases uneven heavy]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from accuracy_runs import run_summary
from bench_options import parse

from traceml.config import DEFAULT_CAPTURE_STEPS
from traceml.launcher.args import capture_steps

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "e2e" / "scripts" / "capture_job.py"
KINDS = {"uneven": "compute_straggler", "heavy": "communication_bound"}

Summary = dict[str, Any]


def run_case(case: str, logs: Path, n: int, steps: int) -> tuple[Summary, Path, Path]:
    session = f"{case}-{n}"
    evidence = logs / f"{session}-evidence"
    evidence.mkdir()
    until = logs / session / "captures" / f"*{KINDS[case]}-r{{rank}}.pt.trace.json.gz"
    summary = run_summary(logs, session, ["--nproc-per-node", "2", "--capture-steps", str(steps),
                                          str(JOB), "--case", case, "--until", str(until)],
                          400, f"{case} run {n}",
                          {"EVIDENCE_DIR": str(evidence)})
    return summary, logs / session, evidence


def steps_whole(session: Path, evidence: Path) -> str:
    db = sqlite3.connect(f"file:{session / 'telemetry.sqlite'}?mode=ro", uri=True)
    try:
        stored = Counter(r for (r,) in db.execute("SELECT rank FROM steps"))
    finally:
        db.close()
    for path in evidence.glob("rank*.json"):
        ran = json.loads(path.read_text())
        if stored[ran["rank"]] != ran["steps"]:
            return f"r{ran['rank']} stored {stored[ran['rank']]} of {ran['steps']} steps"
    return ""


def check(case: str, summary: Summary, steps: int) -> tuple[str, float | None]:
    """What missed ('' for a hit), and the operators' excess as a share of the phase's."""
    kind = KINDS[case].upper()
    found = [c for c in summary["captures"] if c["trigger"] == kind]
    if len(found) != 1:
        return f"captures {[c['trigger'] for c in summary['captures']]}", None
    c = found[0]
    if c["num_steps"] != steps or c["notes"]:
        return f"{c['num_steps']} steps, notes {c['notes']}", None
    if case == "heavy":
        top = c["operators"][0]
        return ("" if top["name"] == "gloo:all_reduce" else f"top {top['name']}"), None
    # The compute operators, as the summary adds them up: not those inside a fetch's or
    # an optimizer step's profiler range ([input], [optimizer]); a slow fetch's are real
    # time, but not this straggler's (its line names them)
    compute = [o for o in c["operators"] if not o["communication"] and o["part"] == "compute"]
    if not compute:
        return "no compute operator listed", None
    if compute[0]["name"] not in ("aten::mm", "aten::addmm") or compute[0]["diff_ms"] <= 0:
        return f"top {compute[0]['name']} {compute[0]['diff_ms']:+.1f} ms", None
    excess = c["phase_ms"]["suspect"] - c["phase_ms"]["reference"]
    share = c["compute_diff_ms"] / excess if excess > 0 else None
    window = finding_excess(summary, c)
    # the fetch's operators among those listed (the top ones), not every one of them
    fetch = sum(o["diff_ms"] or 0.0 for o in c["operators"] if o["part"] == "input")
    print(f"    {case}: operators {c['compute_diff_ms']:+.1f} ms, the phase in the same steps "
          f"{excess:+.1f} ms, the finding's excess over the window {window} ms (the fetch's "
          f"operators {fetch:+.1f} ms)", flush=True)
    if share is None or abs(share - 1.0) > 0.25:
        return f"operators {c['compute_diff_ms']:+.1f} ms against {excess:+.1f} ms", share
    return "", share


def finding_excess(summary: Summary, c: dict[str, Any]) -> str:
    for f in summary["step_time"]["findings"]:
        if f["kind"] == c["trigger"] and f["ranks"][:1] == [c["suspect"]]:
            value = f["evidence"].get("excess_ms")
            return "-" if value is None else f"{value:+.1f}"
    return "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cases", nargs="+", choices=tuple(KINDS), default=list(KINDS))
    parser.add_argument("--capture-steps", type=capture_steps, default=DEFAULT_CAPTURE_STEPS,
                        help=f"steps each capture profiles (traceml's default, "
                             f"{DEFAULT_CAPTURE_STEPS})")
    args = parse(parser, quick={"runs": 1, "cases": ["uneven"]}, limit_s=3600.0)
    hits: Counter[str] = Counter()
    shares: dict[str, list[float]] = {c: [] for c in args.cases}
    misses: dict[str, list[str]] = {c: [] for c in args.cases}
    slowdown: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.runs):
            for case in args.cases:
                summary, session, evidence = run_case(case, Path(tmp), n, args.capture_steps)
                miss, share = check(case, summary, args.capture_steps)
                miss = miss or steps_whole(session, evidence)
                if share is not None:
                    shares[case].append(share)
                hits[case] += not miss
                if miss:
                    misses[case].append(f"run {n}: {miss}")
                slowdown += captured_cost(summary, session)
    print(f"profiler captures, {args.runs} runs per case, 2-rank gloo DDP")
    for case in args.cases:
        line = f"  {case:<7} {hits[case]}/{args.runs} hit"
        if shares[case]:
            line += (f" | operators' excess / the phase's in the same steps: median "
                     f"{statistics.median(shares[case]):.2f}, "
                     f"range {min(shares[case]):.2f}-{max(shares[case]):.2f}")
        print(line)
        for miss in misses[case]:
            print(f"    miss {miss}")
    if slowdown:
        print(f"captured steps: median {statistics.median(slowdown):.1f}x the run's typical "
              f"step (range {min(slowdown):.1f}-{max(slowdown):.1f}x), starting and stopping "
              "the profiler and writing the trace included")
    return 0 if all(hits[c] == args.runs for c in args.cases) else 1


def captured_cost(summary: Summary, session: Path) -> list[float]:
    """Each capture's profiled steps (and the one that wrote the trace) against the
    run's typical step: the ``total`` traceml timed in them over the window's median."""
    db = sqlite3.connect(f"file:{session / 'telemetry.sqlite'}?mode=ro", uri=True)
    try:
        out = []
        for c in summary["captures"]:
            rows = db.execute(
                "SELECT total_ms FROM steps WHERE rank = ? AND step BETWEEN ? AND ?",
                (c["suspect"], c["first_step"], c["first_step"] + c["num_steps"])).fetchall()
            typical = [r for (r,) in db.execute(
                "SELECT total_ms FROM steps WHERE rank = ? AND step < ?",
                (c["suspect"], c["first_step"] - 5))]
            if rows and typical:
                out.append(statistics.mean(r for (r,) in rows) / statistics.median(typical))
        return out
    finally:
        db.close()


if __name__ == "__main__":
    sys.exit(main())
