"""Does scripts/demo.sh show the same result every time?  Runs it N times in a row.

Each run (set-up skipped, sessions in a temporary folder) must give the verdicts
the README shows: the slowed run's INPUT STRAGGLER naming r1, the fixed run's
COMPUTE-BOUND (each the card's top verdict, from Step Time), and ``traceml compare``
IMPROVEMENT with input as the phase that moved most.  ``--busy N`` runs N processes
that keep a core busy beside it, as on a loaded host.  Prints one line per run and
exits 1 when any run differs.  About 20 s per run on 2 cores.

    python scripts/check_demo.py [--runs 5] [--busy 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_options import parse

ROOT = Path(__file__).resolve().parent.parent


def run_demo(logs: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One demo: the slowed run's and the fixed run's summaries, and the comparison."""
    env = dict(os.environ, SKIP_SETUP="1", DEMO_LOGS_DIR=str(logs), PYTHON=sys.executable)
    done = subprocess.run([str(ROOT / "scripts" / "demo.sh")], capture_output=True, text=True,
                          env=env, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"demo.sh exited {done.returncode}:\n{done.stderr[-3000:]}")

    def read(name: str) -> dict[str, Any]:
        return json.loads((logs / name).read_text())  # type: ignore[no-any-return]
    return (read("demo-slow/final_summary.json"), read("demo-fixed/final_summary.json"),
            read("demo-compare.json"))


def spin() -> None:
    """Keeps one core busy until killed."""
    while True:
        pass


def verdicts(slow: dict[str, Any], fixed: dict[str, Any], comparison: dict[str, Any]) -> str:
    """``INPUT STRAGGLER r1 (+20.4 ms, 30.9%) | COMPUTE-BOUND (compute 93%, communication
    4.1%) | IMPROVEMENT, input -10.2 ms``"""
    found = slow["primary"]
    ranks = ",".join(f"r{r}" for r in found["ranks"])
    evidence = found["evidence"]
    excess = (f" (+{evidence['excess_ms']:.1f} ms, {evidence['excess_pct']:.1f}%)"
              if "excess_ms" in evidence else "")
    shares = fixed["step_time"]["stats"]
    compute, comm = (shares[f"{part}_share_pct"]["median"] for part in ("compute", "communication"))
    time = comparison["step_time"]
    return (f"{found['label']} {ranks}{excess} | {fixed['primary']['label']} "
            f"(compute {compute:.0f}%, communication {comm:.1f}%) | "
            f"{comparison['verdict']}, {time['phase']} {time['phase_delta_ms']:+.1f} ms")


def expected(slow: dict[str, Any], fixed: dict[str, Any], comparison: dict[str, Any]) -> bool:
    """The README's verdicts: each card's top line, and the comparison's."""
    found, healthy = slow["primary"], fixed["primary"]
    return (found["label"] == "INPUT STRAGGLER" and found["ranks"] == [1]
            and found["section"] == "step_time"
            and healthy["label"] == "COMPUTE-BOUND" and healthy["section"] == "step_time"
            and comparison["verdict"] == "IMPROVEMENT"
            and comparison["step_time"]["phase"] == "input")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0,
                        help="processes that each keep a core busy while the demo runs")
    args = parse(parser, quick={"runs": 1}, limit_s=3600.0)
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    misses = 0
    try:
        for n in range(1, args.runs + 1):
            with tempfile.TemporaryDirectory(prefix="traceml-demo-") as tmp:
                result = run_demo(Path(tmp))
            ok = expected(*result)
            misses += not ok
            print(f"run {n}: {verdicts(*result)}{'' if ok else '  <- MISS'}", flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
    print(f"{args.runs - misses}/{args.runs} as expected"
          f"{f', beside {args.busy} busy process(es)' if args.busy else ''}")
    sys.exit(1 if misses else 0)


if __name__ == "__main__":
    main()
