"""How often the stall and crash rules name the right rank, phase and line.

Runs ``tests/e2e/scripts/stall_cases.py`` (2-rank gloo DDP, never imports traceml)
under ``traceml run`` ``--runs`` times per case and checks the summary against
what the script did: the culprit (r1), the phase, the line of the script it
stopped on, and for stalls that r0 was found waiting in a collective.

    python scripts/bench_stall_accuracy.py [--runs 3] [--cases python gil ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_options import parse

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "stall_cases.py"
STALL_TIMEOUT_S = 3

# case -> (marker of the line it stops on, expected phase, headline, stops by itself)
CASES: dict[str, tuple[str, str | None, str, bool]] = {
    "python": ("BLOCK-PYTHON", "forward", "STALLED", False),
    "gil": ("BLOCK-GIL", None, "STALLED", False),
    "loader": ("", "input", "STALLED", False),
    "raise": ("RAISE", "forward", "CRASHED", True),
    "segv": ("SEGV", "forward", "CRASHED", True),
}


def line_of(marker: str) -> int | None:
    if not marker:
        return None
    lines = SCRIPT.read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}"))


def run_case(case: str, folder: Path) -> dict[str, Any] | None:
    """One run of ``case``; its final_summary.json (None when there is none)."""
    session = f"{case}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "traceml", "run", "--logs-dir", str(folder), "--session-id",
           session, "--stall-timeout", str(STALL_TIMEOUT_S), "--nproc-per-node=2", str(SCRIPT),
           "--case", case, "--at", "30", "--steps", "200"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    err_path = folder / f"{session}.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
        try:
            if CASES[case][3]:
                proc.wait(timeout=180)
            else:  # a stall: wait for node 0's alert, then Ctrl-C
                deadline = time.monotonic() + 120
                while "traceml: STALLED:" not in err_path.read_text():
                    if time.monotonic() > deadline or proc.poll() is not None:
                        break
                    time.sleep(0.2)
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(timeout=60)
        finally:  # the whole group: a hung DataLoader worker outlives its rank
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    path = folder / session / "final_summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def hit(case: str, summary: dict[str, Any] | None) -> tuple[bool, str]:
    """Whether the summary names what the script did; what it said otherwise."""
    if summary is None:
        return False, "no summary"
    marker, phase, label, _ = CASES[case]
    primary = summary["primary"]
    if (primary["label"], primary["ranks"]) != (label, [1]):
        return False, f"{primary['label']} {primary['ranks']}"
    kind = "stall" if label == "STALLED" else None
    mine = [i for i in summary["ending"]["incidents"] if i["rank"] == 1
            and (i["what"] == kind if kind else i["what"] in ("exception", "exit"))]
    if not mine or mine[0]["phase"] != phase:
        return False, f"phase {mine[0]['phase'] if mine else None}"
    expected = line_of(marker)
    if expected is not None and f"stall_cases.py:{expected} " not in primary["why"]:
        return False, "line not named"
    if kind and not any(i["rank"] == 0 and i["waiting_in_collective"]
                        for i in summary["ending"]["incidents"] if i["what"] == "stall"):
        return False, "r0 not seen waiting"
    return True, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parse(parser, quick={"runs": 1, "cases": ["raise"]}, limit_s=3600.0)
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            results = [hit(case, run_case(case, Path(tmp))) for _ in range(args.runs)]
            misses = [why for ok, why in results if not ok]
            print(f"{case:7s} {len(results) - len(misses)}/{len(results)}"
                  + (f"  misses: {misses}" if misses else ""), flush=True)


if __name__ == "__main__":
    main()
