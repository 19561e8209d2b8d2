"""End to end: a short 2-rank gloo run has process samples for every rank, one
taken at the agent's start and one at its exit, and its Process section names
both ranks and no missing one."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tests.conftest import run_traceml, script


def process_times(store: Path) -> dict[int, list[float]]:
    """Each rank's process sample times, ascending."""
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT rank, t FROM process ORDER BY rank, t").fetchall()
    finally:
        db.close()
    times: dict[int, list[float]] = {}
    for rank, t in rows:
        times.setdefault(rank, []).append(t)
    return times


def test_a_short_two_rank_run_has_start_and_exit_samples_of_both_ranks(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", script("loop.py"), "--steps", "8")
    assert res.returncode == 0, res.stderr[-3000:]
    times = process_times(res.session_dir / "telemetry.sqlite")
    assert sorted(times) == [0, 1]
    hello = {s["rank"]: s["first_seen"] for s in res.senders if s["role"] == "rank"}
    for rank in (0, 1):
        steps = res.steps_of(rank)
        assert len(steps) == 8
        last_end = max(s["t_begin"] + s["total_ms"] / 1000.0 for s in steps)
        # The start sample comes a sender tick (0.1 s) after the rank's hello,
        # long before the first periodic one is due (1 s).
        assert len(times[rank]) >= 2, (rank, times[rank])
        assert times[rank][0] < hello[rank] + 0.5, (rank, times[rank], hello[rank])
        assert times[rank][-1] > last_end, (rank, times[rank], last_end)  # the exit sample
    assert res.summary is not None
    scope = res.summary["process"]["scope"]
    assert (scope["ranks"], scope["missing_ranks"]) == ([0, 1], [])
    # Both samples of each rank, unless the run outlasted the sample interval (a loaded
    # machine): a periodic sample taken inside the window is then that rank's only one.
    assert scope["num_samples"] >= 2
    assert "| missing" not in (res.session_dir / "final_summary.txt").read_text()
