"""``traceml export --perfetto`` of a real 2-rank gloo DDP run: a trace both viewers'
importers accept (the format checked event by event, slices nested), every step's phases
where they ran, and the slices adding up to the summary's typical step."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_traceml, script
from tests.perfetto import opened
from tests.trace_events import check, load, self_times
from traceml.records import in_flight_spans
from traceml.report.session import load_run

STEPS = 30


def export(session_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "traceml", "export", str(session_dir),
                           "--perfetto", str(out), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A real 2-rank gloo DDP run and its export (``trace.json.gz``): r1 gets twice the
    rows, so twice the forward and backward, and r0 waits in the all-reduce."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    res = run_traceml(tmp_path, "run", "--nproc-per-node=2", script("ddp_real.py"),
                      "--case", "uneven", "--steps", str(STEPS), timeout=240)
    assert res.returncode == 0 and res.summary is not None, res.stderr[-3000:]
    done = export(res.session_dir, tmp_path / "trace.json.gz")
    assert done.returncode == 0, done.stderr
    assert f"steps 0-{STEPS - 1} of 2 rank(s) written to" in done.stderr
    return res, tmp_path


def window_of(summary: dict[str, Any], rank: int, step_ms: dict[int, float],
              counted: set[int]) -> list[float]:
    """The steps (ms by step) the summary's typical step of ``rank`` is the mean of: those
    in its window after the warm-up, less the steps the FLOP counter ran in, less its
    outliers (the slowest)."""
    scope = summary["step_time"]["scope"]
    rank_row = next(r for r in summary["step_time"]["ranks"] if r["rank"] == rank)
    sums = [ms for s, ms in step_ms.items()
            if scope["first_step"] <= s <= scope["last_step"] and s not in counted]
    return sorted(sums)[:len(sums) - rank_row["num_outlier_steps"]]


def test_a_ddp_runs_timeline_nests_its_phases_and_adds_up_to_the_typical_step(
        ddp_run: tuple[Any, Path]) -> None:
    res, tmp_path = ddp_run
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
        # summary's window to its typical step within 1 %.
        typical = summary_ranks[rank]["total_ms"]
        sums = {}
        for step in steps:
            s = step["args"]["step"]
            phase_us = sum(us for e, us in slices if e["cat"] == "phase"
                           and e["args"]["step"] == s)
            left_ms = sum(step["args"].get("not_drawn_ms", {}).values())
            total_ms = phase_us / 1e3 + left_ms + step["args"]["wait_ms"]
            # (positions are stored to the µs: each slice edge within half of one)
            assert total_ms * 1e3 == pytest.approx(step["dur"], rel=1e-6, abs=5.0), step
            sums[s] = total_ms
        kept = window_of(res.summary, rank, sums, counted)
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


def test_perfettos_own_importer_reads_the_export_as_traceml_wrote_it(
        ddp_run: tuple[Any, Path], browser: Any) -> None:
    """The gzip export opened in the Perfetto UI (its WebAssembly trace processor, in
    headless Chromium): no import error; one process for the node with a steps and an
    in-flight track per rank; every step a top-level slice with its phases nested in it;
    its drawn phases, wait and time not drawn (from the args as Perfetto stored them) make
    the step; and over the summary's window the steps Perfetto holds make each rank's
    typical step within 1 %."""
    res, tmp_path = ddp_run
    events = load(tmp_path / "trace.json.gz")["traceEvents"]
    with opened(browser, tmp_path / "trace.json.gz") as perfetto:
        assert perfetto.query("select name, value from stats where value > 0 and "
                              "severity in ('error', 'data_loss')") == []
        nodes = perfetto.query("select name from process where name is not null")
        assert [p["name"].split(" (")[0] for p in nodes] == ["node 0"], nodes
        threads = {t["name"] for t in perfetto.query(
            "select name from thread where name is not null")}
        assert threads == {"r0 steps", "r0 collectives in flight", "r1 steps",
                           "r1 collectives in flight"}
        assert perfetto.one("select count(*) from slice where category = 'phase' "
                            "and parent_id is null") == 0
        for rank in (0, 1):
            steps = perfetto.query(f"""
                select s.id, s.dur, extract_arg(s.arg_set_id, 'args.step') as step,
                       extract_arg(s.arg_set_id, 'args.wait_ms') as wait_ms,
                       (select sum(c.dur) from slice c where c.parent_id = s.id) as drawn_ns,
                       (select sum(cast(a.display_value as real)) from args a
                        where a.arg_set_id = s.arg_set_id
                          and a.key glob 'args.not_drawn_ms.*') as not_drawn_ms
                from slice s join thread_track tt on s.track_id = tt.id
                join thread t using (utid)
                where t.name = 'r{rank} steps' and s.depth = 0 and s.category = 'step'
                order by s.ts""")
            assert [s["step"] for s in steps] == list(range(STEPS)), steps
            for s in steps:  # Perfetto's ns; the file's µs, kept to a thousandth
                made_ns = s["drawn_ns"] + 1e6 * (s["wait_ms"] + (s["not_drawn_ms"] or 0.0))
                assert made_ns == pytest.approx(s["dur"], abs=5e3), s
            counted = {e["args"]["step"] for e in events if e.get("cat") == "step"
                       and e["args"].get("flops_counted")}
            kept = window_of(res.summary, rank, {s["step"]: s["dur"] / 1e6 for s in steps},
                             counted)
            typical = next(r for r in res.summary["step_time"]["ranks"]
                           if r["rank"] == rank)["total_ms"]
            assert len(kept) == typical["count"]
            assert statistics.fmean(kept) == pytest.approx(typical["mean"], rel=0.01)
            in_flight = perfetto.one(f"""
                select count(*) from slice s join thread_track tt on s.track_id = tt.id
                join thread t using (utid)
                where t.name = 'r{rank} collectives in flight' and s.dur > 0""")
            assert in_flight == sum(1 for e in events if e.get("cat") == "collective"
                                    and e["ph"] == "X" and e["tid"] == 2 * rank + 2)
            memory = perfetto.one(f"""
                select count(*) from counter c join counter_track ct on c.track_id = ct.id
                where ct.name glob 'r{rank} memory*'""")
            assert memory == sum(len(e["args"]) for e in events if e["ph"] == "C"
                                 and e["name"] == f"r{rank} memory MiB")
            assert memory > 0


def test_collectives_in_flight_with_a_gap_are_drawn_span_by_span(
        tmp_path: Path, browser: Any) -> None:
    """A real 2-rank DDP convnet with BatchNorm, r1 given twice the images: DDP
    broadcasts the statistics as each forward begins and all-reduces the gradients in
    backward, so its collectives are in flight twice a step with a gap between.  The
    export draws the two spans where they ran (the broadcast inside forward, the
    all-reduce ending where DDP's wait in backward ends); Perfetto reads them as two
    slices on the rank's in-flight track, and the HTML report's swimlanes draw them as
    two segments under each lane.  The ranks meet together at the broadcast; the
    summary's arrivals are at backward's first collective, where r1 comes last."""
    steps = 24  # (the first two, whose DDP spans are not timed yet, are the warm-up)
    res = run_traceml(tmp_path, "run", "--html", "--nproc-per-node=2", script("ddp_real.py"),
                      "--case", "conv", "--slow-rank", "1", "--steps", str(steps), timeout=240)
    assert res.returncode == 0 and res.summary is not None, res.stderr[-3000:]
    arrival = res.summary["step_time"]["arrival"]
    assert arrival is not None and arrival["last_rank"] == 1, arrival
    assert arrival["last_pct"] >= 80 and arrival["median_ms"] > 5, arrival
    done = export(res.session_dir, tmp_path / "conv.json.gz")
    assert done.returncode == 0, done.stderr
    events = load(tmp_path / "conv.json.gz")["traceEvents"]
    check(events)
    for rank in (0, 1):
        phase = {(e["name"], e["args"]["step"]): e for e in events
                 if e.get("cat") == "phase" and e["tid"] == 2 * rank + 1}
        flights: dict[int, list[dict[str, Any]]] = {}
        for e in events:
            if e.get("cat") == "collective" and e["tid"] == 2 * rank + 2:
                flights.setdefault(e["args"]["step"], []).append(e)
        two = [s for s, spans in flights.items()
               if [e["ph"] for e in spans] == ["X", "X"]]
        assert len(two) >= steps - 4, {s: [(e["ph"], e["name"]) for e in f]
                                       for s, f in flights.items()}
        for s in two:  # (positions to the µs: within 2 of each other)
            first, second = sorted(flights[s], key=lambda e: e["ts"])
            forward, wait = phase["forward", s], phase["communication", s]
            assert forward["ts"] - 2 <= first["ts"] < second["ts"] - first["dur"]
            assert first["ts"] + first["dur"] <= forward["ts"] + forward["dur"] + 2
            assert second["ts"] < wait["ts"]  # launched before backward's compute ended
            assert second["ts"] + second["dur"] == pytest.approx(wait["ts"] + wait["dur"],
                                                                 abs=2)
    with opened(browser, tmp_path / "conv.json.gz") as perfetto:
        assert perfetto.query("select name, value from stats where value > 0 and "
                              "severity in ('error', 'data_loss')") == []
        per_step = perfetto.query("""
            select t.name as track, extract_arg(s.arg_set_id, 'args.step') as step,
                   count(*) as n, min(s.depth) as depth
            from slice s join thread_track tt on s.track_id = tt.id join thread t using (utid)
            where s.category = 'collective' and s.dur > 0 group by track, step""")
        for rank in (0, 1):
            mine = [r for r in per_step if r["track"] == f"r{rank} collectives in flight"]
            assert sum(r["n"] == 2 and r["depth"] == 0 for r in mine) >= steps - 4, mine
    # The report's swimlanes draw the typical step's spans a segment each.
    page = browser.new_page()
    try:
        page.goto((res.session_dir / "final_summary.html").as_uri())
        drawn = page.wait_for_function("""() => {
            const step = document.querySelector('[data-chart=lane-step]');
            return step && {label: step.dataset.label, segments: Array.from(
                step.querySelectorAll('[data-lane]')).map((g) =>
                g.querySelectorAll('rect[data-phase=in-flight]').length)};
        }""").json_value()
    finally:
        page.close()
    step = int(drawn["label"].split()[-1])
    run, _ = load_run(res.session_dir)
    stored = [len(in_flight_spans(row)) for row in sorted(
        (row for row in run.steps if row.step == step), key=lambda row: row.rank)]
    assert drawn["segments"] == stored == [2, 2], (drawn, stored)
