"""End to end: the demo's job (examples/train.py, 2 gloo ranks) with rank 1's loader
slowed is an INPUT STRAGGLER naming r1; the same job without the slowdown compares
as an IMPROVEMENT, most of it input (what scripts/demo.sh shows)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ROOT, RunResult, run_traceml
from traceml.compare import compare_runs, load_side
from traceml.compare.verdict import STEP_TIME_THRESHOLD_PCT

TRAIN = str(ROOT / "examples" / "train.py")


def train(tmp_path: Path, session: str, *options: str) -> RunResult:
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", TRAIN, "--steps", "30", *options,
                      session=session)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.summary is not None, res.stderr[-3000:]
    assert {s["rank"] for s in res.steps} == {0, 1}
    return res


def test_slowed_rank_is_named_and_its_fix_is_an_improvement(tmp_path: Path) -> None:
    slow = train(tmp_path, "demo-slow", "--slow-rank", "1", "--slow-input-ms", "10")
    assert slow.summary is not None
    found = slow.summary["step_time"]["diagnosis"]
    assert (found["label"], found["ranks"]) == ("INPUT STRAGGLER", [1]), slow.summary["step_time"]
    assert 8.0 < found["evidence"]["excess_ms"] < 13.0, found
    assert "Verdict: INPUT STRAGGLER" in slow.stdout and "(Step Time, r1)" in slow.stdout

    fixed = train(tmp_path, "demo-fixed")
    assert fixed.summary is not None
    labels = [f["label"] for f in fixed.summary["step_time"]["findings"]]
    assert not any("STRAGGLER" in label for label in labels), labels

    comparison = compare_runs(load_side("A", str(slow.session_dir)),
                              load_side("B", str(fixed.session_dir)), STEP_TIME_THRESHOLD_PCT)
    assert comparison.verdict.label == "IMPROVEMENT", comparison.verdict.why
    assert comparison.time.phase == "input", comparison.verdict.why
