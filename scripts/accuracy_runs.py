"""What the accuracy scripts (``bench_*_accuracy.py``) share: one ``traceml run`` of a
test script, to its final summary.  Imported as ``accuracy_runs`` (scripts/ is on
the path of a script run from there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def run_summary(logs: Path, session: str, args: Sequence[str], timeout_s: float,
                what: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``traceml run --logs-dir LOGS --session-id SESSION ARGS`` (one thread per rank,
    ``env`` added to the environment); its final_summary.json.  A failed run ends the
    benchmark, saying ``what`` failed."""
    cmd = [sys.executable, "-m", "traceml", "run", "--logs-dir", str(logs), "--session-id",
           session, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads((logs / session / "final_summary.json").read_text())
    return summary
