"""Adding a phase is a change to traceml/phases.py alone: a phase appended to the
table in a child process (tests/live/scripts/added_phase.py) reaches the
collector's step records, the store, the summary JSON and its schema, the text
card, compare, the launcher's table, the live terminal view and the page."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.live.conftest import LIVE_SCRIPTS, chart_facts, open_page, wait_for


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("added_phase")
    done = subprocess.run([sys.executable, str(LIVE_SCRIPTS / "added_phase.py"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_new_phase_is_timed_stored_and_summarised(outputs: Path) -> None:
    doc = json.loads((outputs / "slow" / "final_summary.json").read_text())
    step_time = doc["step_time"]
    assert step_time["stats"]["h2d_ms"]["median"] == pytest.approx(6.0)
    # The last step ends with its optimizer step: 0.5 ms shorter than the rest.
    assert step_time["stats"]["h2d_share_pct"]["median"] == pytest.approx(100 * 6.0 / 14.5, rel=0.01)
    assert [row["h2d_ms"]["mean"] for row in step_time["ranks"]] == pytest.approx([6.0, 6.0])
    # Exclusive: the copy is not wait, and compute is unchanged.
    assert step_time["stats"]["wait_ms"]["median"] == pytest.approx(0.5 * 35 / 36)
    assert step_time["stats"]["compute_ms"]["median"] == pytest.approx(7.0)
    assert (outputs / "schema_problems.txt").read_text() == ""
    card = " ".join(line.strip("|+- ") for line in
                    (outputs / "slow" / "final_summary.txt").read_text().splitlines())
    card = " ".join(card.split())  # a wrapped line loses its "|" at the box edge
    assert "input 1.0/1.0 | h2d 6.0/6.0" in card and "compute 7.0/7.0" in card


def test_compare_the_launcher_table_and_the_terminal_view_show_it(outputs: Path) -> None:
    compare = " ".join(line.strip("|+- ") for line in
                       (outputs / "compare.txt").read_text().splitlines())
    compare = " ".join(compare.split())  # columns and wrapped lines, single-spaced
    assert "Host to device 1.0 ms" in compare and "+5.0 ms +500.0%" in compare
    assert "most of it is h2d time (+5.0 ms)" in compare
    assert "h2d ms" in (outputs / "ending.txt").read_text()
    header = next(line for line in (outputs / "terminal.txt").read_text().splitlines()
                  if line.startswith("rank"))
    assert header.split() == ["rank", "step", "input", "forward", "backward", "optimizer",
                              "h2d", "wait", "total"]


def test_the_page_draws_it(outputs: Path, browser: Any) -> None:
    page, watch = open_page(browser, "file://")
    page.goto((outputs / "slow" / "final_summary.html").as_uri())
    wait_for(lambda: chart_facts(page)["renders"], 20, "the page to render")
    legend = page.inner_text("#legend").split()
    assert legend == ["input", "forward", "backward", "optimizer", "communication", "hook",
                      "h2d", "wait"]
    assert page.locator('[data-chart=phases] path[data-phase="h2d"]').count() == 2
    page.select_option("#heat-phase", "h2d_ms")
    assert page.eval_on_selector("#heatmap", "c => c.dataset.ranks") == "0,1"
    assert watch.errors == []
    page.close()
