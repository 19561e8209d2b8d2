"""End to end: two real `traceml run`s of the same CPU script, one with a slow input
pipeline and one with a fast one, then `python -m traceml compare` both ways."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import RunResult, run_traceml, script

SCRIPT = script("compare_input.py")


def traced(tmp_path: Path, session: str, input_sleep_ms: int) -> RunResult:
    res = run_traceml(tmp_path, "run", SCRIPT, "--input-sleep-ms", str(input_sleep_ms),
                      session=session)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (res.session_dir / "final_summary.json").is_file(), res.stderr[-3000:]
    return res


def compare(tmp_path: Path, a: Path, b: Path, name: str) -> tuple[int, str, Any]:
    base = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "traceml", "compare", str(a), str(b), "--output", str(base),
         "--fail-on", "regression"],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode in (0, 1), proc.stderr
    assert (base.with_suffix(".txt")).read_text() == proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80, proc.stdout
    # the card's prose without its frame, wrapped lines joined
    text = " ".join(line.strip("|+- ") for line in proc.stdout.splitlines())
    return proc.returncode, " ".join(text.split()), json.loads(
        base.with_suffix(".json").read_text())


def test_slow_input_against_fast_input_both_ways(tmp_path: Path) -> None:
    slow = traced(tmp_path, "input_slow", 25)
    fast = traced(tmp_path, "input_fixed", 2)

    code, text, doc = compare(tmp_path, slow.session_dir, fast.session_dir, "fixed")
    assert code == 0, text
    assert doc["verdict"] == "IMPROVEMENT", text
    assert (doc["step_time"]["direction"], doc["step_time"]["phase"]) == ("better", "input")
    assert "Verdict: IMPROVEMENT" in text and "most of it is input time (-" in text
    assert doc["a"]["label"] == "input_slow" and doc["b"]["label"] == "input_fixed"

    code, text, doc = compare(tmp_path, fast.session_dir / "final_summary.json",
                              slow.session_dir, "broke")
    assert code == 1, text  # --fail-on regression
    assert doc["verdict"] == "REGRESSION", text
    assert (doc["step_time"]["direction"], doc["step_time"]["phase"]) == ("worse", "input")
    assert "Verdict: REGRESSION" in text and "most of it is input time (+" in text
    input_row = doc["sections"]["step_time"]["metrics"][1]
    assert input_row["key"] == "input_ms" and input_row["delta"] > 15.0
