"""Does ``traceml compare`` cry wolf?  And does it catch a real 15 % slowdown?

1. Runs the same healthy CPU script N times (default 8) under ``traceml run`` and
   compares every ordered pair of these baseline runs: prints how many said
   NO CHANGE (target: all).
2. Runs it N more times with the input pipeline slowed by 15 % of the baseline's
   step time and compares each slow run (B) against each baseline run (A):
   prints how many said REGRESSION (target: all).

The script is tests/e2e/scripts/compare_input.py: a small real MLP (CPU work)
plus a sleep standing in for device time. The slowdown is calibrated on a
calibration run, then baseline and slowed runs alternate, so a change in the
machine's load hits both groups alike. Each run takes a few seconds; the whole
benchmark a few minutes on 2 cores. Other load on the machine moves step times
from run to run, and no single run can show that: the host CPU column shows it.

    python scripts/bench_compare_noise.py [--runs 8] [--steps 120] [--slowdown-pct 15]
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench_options import parse as parse_options

from traceml.compare.build import compare_runs
from traceml.compare.load import load_side
from traceml.compare.model import Comparison
from traceml.compare.summary import RunSummary

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "compare_input.py"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=8, help="runs per group (default 8)")
    p.add_argument("--steps", type=int, default=120, help="training steps per run")
    p.add_argument("--input-sleep-ms", type=float, default=2.0, help="baseline input time")
    p.add_argument("--compute-sleep-ms", type=float, default=25.0,
                   help="stand-in for device time per step")
    p.add_argument("--width", type=int, default=64, help="MLP width (real CPU work)")
    p.add_argument("--slowdown-pct", type=float, default=15.0,
                   help="input slowdown of the second group, in %% of the baseline step")
    p.add_argument("--threshold-pct", type=float, default=5.0, help="compare's threshold")
    p.add_argument("--logs-dir", default=None, help="keep the sessions here (default: temp)")
    a = parse_options(p, quick={"runs": 2, "steps": 20}, limit_s=3600.0)
    if a.runs < 2:
        p.error("--runs must be at least 2")
    return a


def traced_run(a: argparse.Namespace, logs: Path, session: str, input_sleep_ms: float) -> Path:
    """One session of the script under ``traceml run``; its folder."""
    cmd = [sys.executable, "-m", "traceml", "run", "--logs-dir", str(logs),
           "--session-id", session, str(SCRIPT), "--steps", str(a.steps),
           "--input-sleep-ms", f"{input_sleep_ms:.3f}",
           "--compute-sleep-ms", str(a.compute_sleep_ms), "--width", str(a.width),
           "--batch-size", "64"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0 or not (logs / session / "final_summary.json").is_file():
        sys.exit(f"run {session} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    print(f"  {session}: {time.perf_counter() - start:.1f}s", flush=True)
    return logs / session


def step_ms(run: RunSummary) -> float:
    """The run's step time: median over ranks of the mean step."""
    section = run.section("step_time")
    value = section.stats.get("total_ms") if section else None
    if value is None:
        sys.exit(f"{run.path}: no step time in the summary")
    return value


def tally(pairs: list[tuple[RunSummary, RunSummary]], threshold_pct: float,
          expected: str) -> Counter[str]:
    """Compare every pair; print the ones that did not give ``expected``."""
    verdicts: Counter[str] = Counter()
    for a, b in pairs:
        result: Comparison = compare_runs(a, b, threshold_pct)
        verdicts[result.verdict.label] += 1
        if result.verdict.label != expected:
            print(f"    {a.label} vs {b.label}: {result.verdict.label}: {result.verdict.why}")
    return verdicts


def host_cpu_pct(run: RunSummary) -> float | None:
    """Host CPU average of the run's machine (all processes, not only the training)."""
    section = run.section("system")
    return section.stats.get("cpu_avg_pct") if section else None


def describe(name: str, runs: list[RunSummary]) -> None:
    times = [step_ms(r) for r in runs]
    cpu = [host_cpu_pct(r) for r in runs]
    print(f"{name}: step time per run (ms): {' '.join(f'{t:.2f}' for t in times)}  "
          f"(max/min {100 * (max(times) / min(times) - 1):.1f}%)")
    print(f"{name}: host CPU per run (%): {' '.join('-' if c is None else f'{c:.0f}' for c in cpu)}")


def main() -> int:
    a = parse()
    logs = Path(a.logs_dir or tempfile.mkdtemp(prefix="traceml-bench-compare-"))
    print(f"sessions in {logs}")
    calibration = load_side("A", str(traced_run(a, logs, "calibrate", a.input_sleep_ms)))
    slow_input_ms = a.input_sleep_ms + a.slowdown_pct / 100.0 * step_ms(calibration)
    print(f"baseline: {a.runs} runs, input {a.input_sleep_ms:g} ms; slowed: {a.runs} runs, "
          f"input {slow_input_ms:.2f} ms (+{a.slowdown_pct:g}% of the "
          f"{step_ms(calibration):.2f} ms calibration step)")
    base, slow = [], []
    for i in range(a.runs):  # alternate, so drifting load hits both groups alike
        base.append(load_side("A", str(traced_run(a, logs, f"base_{i}", a.input_sleep_ms))))
        slow.append(load_side("B", str(traced_run(a, logs, f"slow_{i}", slow_input_ms))))
    describe("baseline", base)
    describe("slowed", slow)
    same = tally(list(itertools.permutations(base, 2)), a.threshold_pct, "NO CHANGE")
    worse = tally(list(itertools.product(base, slow)), a.threshold_pct, "REGRESSION")
    print(f"identical runs: {same['NO CHANGE']}/{sum(same.values())} ordered pairs said "
          f"NO CHANGE {dict(same)}")
    print(f"input +{a.slowdown_pct:g}%: {worse['REGRESSION']}/{sum(worse.values())} "
          f"(baseline, slowed) pairs said REGRESSION {dict(worse)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
