"""``traceml export --perfetto`` of a real 2-rank gloo DDP run: a trace both viewers'
importers accept (the format checked event by event, slices nested), every step's phases
where they ran, and the slices adding up to the summary's typical step."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_traceml, script
from tests.trace_events import check, load, self_times

STEPS = 30


def export(session_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "traceml", "export", str(session_dir),
                           "--perfetto", str(out), *args], capture_output=True, text=True,
                          timeout=120)


def test_a_ddp_runs_timeline_nests_its_phases_and_adds_up_to_the_typical_step(
        tmp_path: Path) -> None:
    # r1 gets twice the rows: twice the forward and backward; r0 waits in the all-reduce.
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", script("ddp_real.py"),
                      "--case", "uneven", "--steps", str(STEPS), timeout=240)
    assert res.returncode == 0 and res.summary is not None, res.stderr[-3000:]
    done = export(res.session_dir, tmp_path / "trace.json.gz")
    assert done.returncode == 0, done.stderr
    assert f"steps 0-{STEPS - 1} of 2 rank(s) written to" in done.stderr
    document = load(tmp_path / "trace.json.gz")
    events = document["traceEvents"]
    check(events)
    summary_ranks = {r["rank"]: r for r in res.summary["step_time"]["ranks"]}
    counted = {e["args"]["step"] for e in events if e.get("cat") == "step"
               and e["args"].get("flops_counted")}  # left out of every rank's window
    for rank in (0, 1):
        slices = self_times(events, 1, 2 * rank + 1)
        steps = [e for e, _ in slices if e["cat"] == "step"]
        assert [e["args"]["step"] for e in steps] == list(range(STEPS))
        phases_of = {s: {e["name"]: e for e, _ in slices if e["cat"] == "phase"
                         and e["args"]["step"] == s} for s in range(STEPS)}
        for s in range(STEPS):  # each phase that ran once, drawn where it ran
            assert {"input", "forward", "backward", "optimizer"} <= set(phases_of[s]), s
            drawn = phases_of[s]
            assert drawn["input"]["ts"] < drawn["forward"]["ts"] < drawn["backward"]["ts"]
            assert drawn["backward"]["ts"] + drawn["backward"]["dur"] <= drawn["optimizer"]["ts"]
        # DDP waits for the last buckets at the end of backward: the wait nests in it.
        inside = sum(1 for s in range(STEPS) if "communication" in phases_of[s]
                     and phases_of[s]["communication"]["ts"] >= phases_of[s]["backward"]["ts"]
                     and phases_of[s]["communication"]["ts"] + phases_of[s]["communication"][
                         "dur"] <= phases_of[s]["backward"]["ts"] + phases_of[s]["backward"][
                         "dur"] + 1e-3)
        assert inside >= STEPS - 2, inside
        flights = [e for e in events if e.get("cat") == "collective" and e["tid"] == 2 * rank + 2]
        # (the first steps' collectives may go untimed while the timing hooks install)
        assert len({e["args"]["step"] for e in flights}) >= STEPS - 3
        # The slices' self times and what is not drawn add up to each step, and over the
        # summary's window (after its warm-up, without the steps the FLOP counter ran in
        # or its outliers, the slowest) to its typical step within 1 %.
        scope, typical = res.summary["step_time"]["scope"], summary_ranks[rank]["total_ms"]
        sums = {}
        for step in steps:
            s = step["args"]["step"]
            phase_us = sum(us for e, us in slices if e["cat"] == "phase"
                           and e["args"]["step"] == s)
            left_ms = sum(step["args"].get("not_drawn_ms", {}).values())
            total_ms = phase_us / 1e3 + left_ms + step["args"]["wait_ms"]
            # (positions are stored to the µs: each slice edge within half of one)
            assert total_ms * 1e3 == pytest.approx(step["dur"], rel=1e-6, abs=5.0), step
            if scope["first_step"] <= s <= scope["last_step"] and s not in counted:
                sums[s] = total_ms
        kept = sorted(sums.values())[:len(sums) - summary_ranks[rank]["num_outlier_steps"]]
        assert len(kept) == typical["count"]
        assert statistics.fmean(kept) == pytest.approx(typical["mean"], rel=0.01)

    # A few steps of one rank; bad arguments say what to give, in one line, and write nothing.
    done = export(res.session_dir, tmp_path / "r1.json", "--steps", "10:19", "--ranks", "1")
    assert done.returncode == 0, done.stderr
    part = load(tmp_path / "r1.json")["traceEvents"]
    check(part)
    assert sorted(e["args"]["step"] for e in part if e.get("cat") == "step") == list(range(10, 20))
    assert {e["args"]["rank"] for e in part if e.get("cat") == "step"} == {1}
    for bad, says in ((["--steps", "5"], "give A:B"), (["--ranks", "x"], "0,3,8-15"),
                      (["--steps", "9:3"], "A before B")):
        done = export(res.session_dir, tmp_path / "bad.json", *bad)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) <= 2, done.stderr  # usage + the error
    done = export(tmp_path / "nowhere", tmp_path / "bad.json")
    assert done.returncode != 0 and "not a folder" in done.stderr
    done = export(res.session_dir, tmp_path / "no" / "such" / "bad.json")
    assert done.returncode != 0 and "existing folder" in done.stderr
    assert not (tmp_path / "bad.json").exists()
