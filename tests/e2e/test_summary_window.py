"""The final summary of a real run reads only the window's rows, and says what reading
every stored row says."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_traceml, script
from traceml.launcher.ending import phase_table
from traceml.report.session import build_summary


def test_a_real_runs_bounded_summary_is_the_full_reads(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", "--summary-window-rows", "50",
                      script("loop.py"), "--steps", "300", "--eval-every", "100",
                      "--eval-batches", "2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.summary is not None
    full = build_summary(res.session_dir, full=True)
    bounded = build_summary(res.session_dir)
    assert res.summary == full.summary == bounded.summary  # what the launcher wrote, too
    assert bounded.text == full.text
    # the passes after steps 100 and 200, before the window: whole-run totals
    assert bounded.summary["step_time"]["stats"]["num_eval"]["median"] == 2
    assert phase_table(bounded.run) == phase_table(full.run)
    assert phase_table(full.run) in res.stderr
    assert len(full.run.steps) == 600
    assert len(bounded.run.steps) <= 2 * (50 + 60)
    # a window of its own (traceml report --summary-window-rows 20)
    assert (build_summary(res.session_dir, 20).summary
            == build_summary(res.session_dir, 20, full=True).summary)
