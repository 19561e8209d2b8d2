"""The dashboard and final_summary.html in a real headless Chromium (Playwright)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.live.conftest import (
    LIVE_SCRIPTS,
    ROOT,
    artifact,
    assert_every_rank_charted,
    chart_facts,
    open_page,
    wait_for,
)
from traceml.records_json import from_jsonable
from traceml.report import build_report
from traceml.report.html import write_html

SCENARIOS = ROOT / "tests" / "fixtures" / "scenarios"


def test_html_report_of_an_eight_rank_run(tmp_path: Path, browser: Any) -> None:
    run = from_jsonable(json.loads((SCENARIOS / "compute_straggler_8r" / "run.json").read_text()))
    report = build_report(run, 10000)
    path = write_html(tmp_path / "final_summary.html", report, run)
    page, watch = open_page(browser, "file://")
    page.goto(path.as_uri())
    facts = wait_for(lambda: (f := chart_facts(page))["renders"] and f, 20, "the page to render")
    assert_every_rank_charted(facts, list(range(8)))
    assert facts["verdict"] == report.primary.finding.label == "COMPUTE STRAGGLER"
    assert facts["final"]
    page.select_option("#heat-phase", "forward_ms")
    assert page.eval_on_selector("#heatmap", "c => c.dataset.ranks") == "0,1,2,3,4,5,6,7"
    page.screenshot(path=str(artifact("html-report-8-ranks.png")), full_page=True)
    assert watch.errors == [] and watch.outside_requests == []
    page.close()


def test_html_report_shows_throughput_and_where_the_peak_came_from(tmp_path: Path,
                                                                   browser: Any) -> None:
    from tests.unit.test_throughput import run

    data = run(2)
    path = write_html(tmp_path / "final_summary.html", build_report(data, 10000), data)
    page, watch = open_page(browser, "file://")
    page.goto(path.as_uri())
    wait_for(lambda: chart_facts(page)["renders"], 20, "the page to render")
    job = page.inner_text("#throughput tr[data-job]").split("\t")
    assert job == ["job", "1,280", "–", "600", "30.3%"]
    assert page.inner_text("#throughput [data-source=peak]").startswith(
        "Peak: H100 SXM dense bf16 989.4 TFLOP/s")
    assert "FlopCounterMode" in page.inner_text("#throughput [data-source=flops]")
    assert page.locator("#findings [data-kind=THROUGHPUT]").count() == 1
    assert watch.errors == [] and watch.outside_requests == []
    page.close()


def _start_run(tmp_path: Path, port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_NUM_THREADS="1", LIVE_STOP_FILE=str(tmp_path / "stop"),
               LIVE_MAX_S="150")
    cmd = [sys.executable, "-m", "traceml", "run", "--logs-dir", str(tmp_path / "logs"),
           "--session-id", "dash", "--mode", "dashboard", "--dashboard-port", str(port), "--html",
           "--nproc-per-node", "2", str(LIVE_SCRIPTS / "gated.py"), "--slow-rank", "1",
           "--slow-ms", "8"]
    with (tmp_path / "out.txt").open("wb") as out, (tmp_path / "err.txt").open("wb") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=tmp_path)


def _dashboard_url(tmp_path: Path, taken_port: int) -> str:
    pattern = re.compile(rf"dashboard port {taken_port} is in use; dashboard at "
                         r"(http://127\.0\.0\.1:\d+/[A-Za-z0-9_-]{32}/) instead")

    def printed() -> str | None:
        found = pattern.search((tmp_path / "err.txt").read_text())
        return found.group(1) if found else None

    return wait_for(printed, 90, "the dashboard URL on stderr")


def _ranks_drawn(page: Any) -> dict[str, Any] | None:
    facts = chart_facts(page)
    points = [p["points"] for p in facts["phases"]]
    return facts if len(points) == 2 and min(points) > 0 else None


def test_dashboard_follows_a_two_rank_run_to_its_verdict(tmp_path: Path, browser: Any) -> None:
    with socket.socket() as taken:  # the asked port is in use: traceml says so, takes another
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _start_run(tmp_path, port)
        try:
            url = _dashboard_url(tmp_path, port)
        except AssertionError:
            proc.kill()
            raise
    page, watch = open_page(browser, url.rstrip("/"))
    try:
        page.goto(url)
        first = wait_for(lambda: _ranks_drawn(page), 60, "charts for both ranks")
        assert not first["final"]
        later = wait_for(lambda: (f := chart_facts(page))["renders"] > first["renders"] + 1 and all(
            b["last"] > a["last"] for a, b in zip(first["phases"], f["phases"])) and f,
            30, "the live page to show new steps")
        assert_every_rank_charted(later, [0, 1])
        page.screenshot(path=str(artifact("dashboard-live.png")), full_page=True)
        (tmp_path / "stop").touch()
        final = wait_for(lambda: (f := chart_facts(page))["final"] and f, 90, "the final verdict")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    page.screenshot(path=str(artifact("dashboard-final.png")), full_page=True)
    summary = json.loads((tmp_path / "logs" / "dash" / "final_summary.json").read_text())
    assert final["verdict"] == summary["primary"]["label"]
    assert_every_rank_charted(final, [0, 1])
    assert watch.errors == [] and watch.outside_requests == []
    page.close()
    _check_html_reports(tmp_path, browser, summary["primary"]["label"])


def _report_facts(browser: Any, path: Path) -> dict[str, Any]:
    """What an HTML report file draws; it must not err nor reach out."""
    page, watch = open_page(browser, "file://")
    page.goto(path.as_uri())
    facts = wait_for(lambda: (f := chart_facts(page))["renders"] and f, 20, f"{path.name}")
    assert watch.errors == [] and watch.outside_requests == []
    page.close()
    return facts


def _check_html_reports(tmp_path: Path, browser: Any, verdict: str) -> None:
    """--html on run wrote final_summary.html; traceml report --html OUT writes another."""
    session = tmp_path / "logs" / "dash"
    out = tmp_path / "report.html"
    res = subprocess.run([sys.executable, "-m", "traceml", "report", str(session), "--html",
                          str(out)], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert f"HTML report written to {out}" in res.stderr
    for path in (session / "final_summary.html", out):
        facts = _report_facts(browser, path)
        assert_every_rank_charted(facts, [0, 1])
        assert facts["verdict"] == verdict and facts["final"]
    page, _ = open_page(browser, "file://")
    page.goto(out.as_uri())
    page.screenshot(path=str(artifact("html-report-2-ranks.png")), full_page=True)
    page.close()


def test_html_report_headlines_a_stall_and_keeps_a_cleared_one_in_view(
        tmp_path: Path, browser: Any) -> None:
    import dataclasses

    from tests.live.conftest import fixed_run
    from tests.live.test_terminal import _with_stall

    for cleared, verdict in ((False, "STALLED"), (True, "INPUT STRAGGLER")):
        run = _with_stall(fixed_run(), cleared)
        run = dataclasses.replace(run, meta=dataclasses.replace(run.meta, exit_code=130,
                                                                ended_at=run.meta.started_at + 9))
        path = write_html(tmp_path / f"cleared-{cleared}.html", build_report(run, 10000), run)
        page, watch = open_page(browser, "file://")
        page.goto(path.as_uri())
        wait_for(lambda p=page: chart_facts(p)["renders"], 20, "the page to render")
        assert chart_facts(page)["verdict"] == verdict
        kinds = page.eval_on_selector_all(".ending", "els => els.map((e) => e.dataset.kind)")
        assert kinds == (["STALL_CLEARED"] if cleared else [])
        if not cleared:
            assert "r1 (n0) made no progress for" in page.inner_text("#verdict")
        assert watch.errors == [] and watch.outside_requests == []
        page.close()


def test_the_phase_table_marks_the_blamed_rank_not_the_one_that_waits(
        tmp_path: Path, browser: Any) -> None:
    """The demo's straggler on the page: the one red cell is r1's input (the verdict);
    r0's communication, the most of that column because r0 waits for r1, is marked
    as waiting; the key under the table says which is which."""
    from tests.live.conftest import comm_run

    run = comm_run()
    path = write_html(tmp_path / "final_summary.html", build_report(run, 10000), run)
    page, watch = open_page(browser, "file://")
    page.goto(path.as_uri())
    wait_for(lambda: chart_facts(page)["renders"], 20, "the page to render")
    marks = page.eval_on_selector_all(
        "#table tr[data-rank] td[class]",
        "tds => tds.map((td) => [td.parentElement.dataset.rank, td.cellIndex, td.className])")
    head = page.eval_on_selector_all("#table thead th", "ths => ths.map((th) => th.textContent)")
    named = {(rank, head[index], kind) for rank, index, kind in marks}
    assert named == {("1", "input", "hot"), ("0", "communication", "waited")}
    assert page.get_attribute("#table td.hot", "title") == "INPUT STRAGGLER: r1"
    most = page.inner_text("#table tr.worst").split("\t")
    assert most[head.index("communication")] == "r0 (waiting)"
    assert most[head.index("forward")] == "–"  # 40 ms on both ranks: neither has the most
    assert "Red: what the verdict blames" in page.inner_text("#table [data-key=table]")
    page.screenshot(path=str(artifact("html-report-straggler-marks.png")), full_page=True)
    assert watch.errors == [] and watch.outside_requests == []
    page.close()


def test_html_report_shows_a_captures_operators(tmp_path: Path, browser: Any) -> None:
    from tests.unit.test_profiler_captures import REFERENCE, SUSPECT, capture

    run = from_jsonable(json.loads((SCENARIOS / "compute_straggler_8r" / "run.json").read_text()))
    run = dataclasses.replace(run, captures=(
        capture(1, "suspect", SUSPECT, step_ms=(("compute", 50.0),)),
        capture(0, "reference", REFERENCE, step_ms=(("compute", 28.0),))))
    path = write_html(tmp_path / "final_summary.html", build_report(run, 10000), run)
    page, watch = open_page(browser, "file://")
    page.goto(path.as_uri())
    wait_for(lambda: chart_facts(page)["renders"], 20, "the page to render")
    top = page.inner_text("#captures tr[data-operator]").split("\t")
    assert top[:4] == ["aten::mm", "31.0", "16.0", "+15.0"], top
    assert "[512, 512], [512, 512] / [256, 512], [512, 512]" in top[-1]
    text = page.inner_text("#captures")
    assert "the compute operators +21.5 (compute as traceml timed these steps: +22.0)" in text
    assert "Trace r1: /logs/s/captures/c1-r1.pt.trace.json.gz" in text
    page.screenshot(path=str(artifact("html-report-capture.png")), full_page=True)
    assert watch.errors == [] and watch.outside_requests == []
    page.close()


def _lanes(page: Any) -> list[dict[str, Any]]:
    """Each drawn step's lanes: per rank, per phase, its rectangles' drawn widths (px)
    summed."""
    return list(page.evaluate("""() => Array.from(
        document.querySelectorAll('[data-chart=lane-step]')).map((f) => ({
            label: f.dataset.label, view: f.querySelector('svg').dataset.view,
            lanes: Object.fromEntries(Array.from(f.querySelectorAll('[data-lane]')).map((g) =>
                [g.dataset.lane, Array.from(g.querySelectorAll('rect[data-phase]')).reduce(
                    (acc, r) => ({...acc, [r.dataset.phase]: (acc[r.dataset.phase] || 0)
                                  + r.getBoundingClientRect().width}), {})]))}))"""))


def test_html_swimlanes_show_the_slow_ranks_longer_phases(tmp_path: Path, browser: Any) -> None:
    """A real 2-rank gloo DDP straggler (r1 gets twice the rows: twice the forward and
    backward): the report's swimlanes draw the typical step's phases of each rank to one
    scale, as long as the store says they took, where over the run r1's forward is the
    longer and r0's wait in the all-reduce (communication) the longer; the lanes zoom and
    reset.  (One step of a real run on a shared machine may buck the run's trend, so the
    trend is held over the window's medians and the drawing against its own step.)"""
    from tests.conftest import run_traceml, script
    from traceml.report.session import load_run
    from traceml.report.timeline import placed_phases

    res = run_traceml(tmp_path, "run", "--html", "--nproc-per-node=2", script("ddp_real.py"),
                      "--case", "uneven", "--steps", "30", timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    page, watch = open_page(browser, "file://")
    page.goto((res.session_dir / "final_summary.html").as_uri())
    wait_for(lambda: chart_facts(page)["renders"], 20, "the page to render")
    steps = _lanes(page)
    assert steps and steps[0]["label"].startswith("typical step "), steps
    typical = steps[0]["lanes"]
    assert set(typical) == {"0", "1"}
    assert {"input", "backward", "optimizer", "in-flight"} <= set(typical["0"])
    run, _ = load_run(res.session_dir)
    step = int(steps[0]["label"].split()[-1])
    rows = {row.rank: row for row in run.steps if row.step == step}
    px_per_ms = typical["0"]["step"] / rows[0].total_ms
    for rank, row in rows.items():
        drawn: dict[str, float] = {}
        for begin, end, phase in placed_phases(row)[0]:
            drawn[phase.name] = drawn.get(phase.name, 0.0) + end - begin
        for name in ("forward", "backward", "communication"):
            assert typical[str(rank)][name] == pytest.approx(drawn[name] * px_per_ms, abs=1.5), (
                rank, name, typical, drawn)
    by_rank = {rank: [row for row in run.steps if row.rank == rank] for rank in (0, 1)}

    def median_ms(rank: int, name: str) -> float:
        return statistics.median(row.ms(name) for row in by_rank[rank])

    assert median_ms(1, "forward") > 1.3 * median_ms(0, "forward"), typical
    assert median_ms(0, "communication") > median_ms(1, "communication"), typical
    page.locator("[data-chart=lane-step] svg").first.scroll_into_view_if_needed()
    page.screenshot(path=str(artifact("html-report-lanes.png")), full_page=True)
    svg = page.locator("[data-chart=lane-step] svg").first
    before = svg.get_attribute("data-view")
    svg.hover()
    page.mouse.wheel(0, -400)  # zoom in around the pointer
    zoomed = wait_for(lambda: v if (v := svg.get_attribute("data-view")) != before else None, 10,
                      "the lanes to zoom")
    lo, hi = map(float, zoomed.split(","))
    full_lo, full_hi = map(float, before.split(","))
    assert full_lo <= lo < hi <= full_hi and hi - lo < 0.9 * (full_hi - full_lo)
    svg.dblclick()
    assert svg.get_attribute("data-view") == before
    assert watch.errors == [] and watch.outside_requests == []
    page.close()
