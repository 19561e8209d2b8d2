"""Are traceml's samples/s, tokens/s and FLOPs per step right?  Hit rates on real runs.

Runs tests/e2e/scripts/throughput.py (which counts its own samples and tokens and
times its own steps, and never imports traceml) under ``traceml run`` N times per
case (default 5) and compares each summary's Throughput rows with the script's own
count over its own timer, over the same window steps (the FLOP-counting step left
out):

  mlp       a DataLoader of (x, y) tensors, the last batch short; 2 gloo DDP ranks
  lm        token ids in a dict batch (samples/s and tokens/s)
  noloader  tensors made in the loop, no DataLoader

A run hits when every rate is within 2 % of the script's, FLOPs per step equal the
hand count (2*m*n*k per matmul) within 2 % (mlp, lm), the step count is exact and
the counted step is out of the window.  Prints one line per case (hits/runs, the
largest rate error) and exits 1 when any run misses.  About 10 s per run on 2 cores.

    python scripts/bench_throughput_accuracy.py [--runs 5] [--cases mlp lm noloader]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_options import parse

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "throughput.py"
CASES = {"mlp": 2, "lm": 1, "noloader": 1}  # case -> ranks
STEPS, BATCH, TOLERANCE = 40, 16, 0.02


def hand_flops(case: str, shapes: dict[str, int]) -> int | None:
    """2*m*n*k per matmul: the MLP's first layer has no input gradient; the LM's
    embedding is a lookup."""
    if case == "lm":
        tokens = BATCH * shapes["seq"]
        return 3 * 2 * tokens * (shapes["dim"] ** 2 + shapes["dim"] * shapes["vocab"])
    if case == "mlp":
        first, second = shapes["in"] * shapes["hidden"], shapes["hidden"] * shapes["out"]
        return 4 * BATCH * first + 6 * BATCH * second
    return None


def run_once(case: str, folder: Path) -> tuple[bool, float, str]:
    """(hit, largest relative rate error, why it missed)."""
    evidence = folder / "evidence"
    evidence.mkdir(parents=True)
    ranks = CASES[case]
    cmd = [sys.executable, "-m", "traceml", "run", "--logs-dir", str(folder / "logs"),
           "--session-id", "s", f"--nproc-per-node={ranks}", str(SCRIPT), "--case", case,
           "--steps", str(STEPS), "--batch", str(BATCH), *(["--ddp"] if ranks > 1 else [])]
    env = dict(os.environ, EVIDENCE_DIR=str(evidence), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        return False, 0.0, f"exit {proc.returncode}"
    session = folder / "logs" / "s"
    tp = json.loads((session / "final_summary.json").read_text())["throughput"]
    db = sqlite3.connect(session / "telemetry.sqlite")
    rows = db.execute("SELECT rank, step, flops_counted FROM steps").fetchall()
    counted = {step for _, step, flag in rows if flag}
    kept = [s for s in range(tp["scope"]["num_warmup_steps"], STEPS) if s not in counted]
    worst = 0.0
    for row in tp["ranks"]:
        own: Any = json.loads((evidence / f"rank{row['rank']}.json").read_text())
        if sorted(step for rank, step, _ in rows if rank == row["rank"]) != list(range(STEPS)):
            return False, worst, "step count"
        bounds = [s["t"] for s in own["steps"]] + [own["end"]]
        seconds = sum(bounds[i + 1] - bounds[i] for i in kept)
        for key in ("samples", "tokens"):
            if own["steps"][0][key] is None:
                continue
            mine = sum(own["steps"][i][key] for i in kept) / seconds
            error = abs(row[f"{key}_per_s"] / mine - 1)
            worst = max(worst, error)
            if error > TOLERANCE:
                return False, worst, f"{key}/s off by {100 * error:.1f}%"
        flops = hand_flops(case, own["shapes"])
        if flops is not None and abs((row["flops_per_step"] or 0) / flops - 1) > TOLERANCE:
            return False, worst, f"FLOPs {row['flops_per_step']} vs {flops}"
    if tp["scope"]["num_steps"] != len(kept) or (case != "noloader" and not counted):
        return False, worst, "window"
    return True, worst, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parse(parser, quick={"runs": 1, "cases": ["noloader"]}, limit_s=3600.0)
    print(f"throughput accuracy: rates within {100 * TOLERANCE:.0f}% of the script's own "
          "count over its own timer, FLOPs per step within 2% of the hand count")
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            results = [run_once(case, Path(tmp) / f"{case}-{i}") for i in range(args.runs)]
            hits = sum(hit for hit, _, _ in results)
            missed += args.runs - hits
            why = "; ".join(sorted({w for hit, _, w in results if not hit}))
            worst = max(err for _, err, _ in results)
            print(f"  {case:<9} {hits}/{args.runs} hit | largest rate error "
                  f"{100 * worst:.2f}% | {CASES[case]} rank(s){' | ' + why if why else ''}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
