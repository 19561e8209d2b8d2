"""final_summary.html from `traceml report --html`: one file that embeds the summary JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.live.test_dashboard import make_store


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "traceml", "report", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_html_embeds_exactly_the_summary(tmp_path: Path) -> None:
    session = tmp_path / "s"
    session.mkdir()
    make_store(session / "telemetry.sqlite")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = report(str(session), "--html", str(out_dir))  # a folder: final_summary.html in it
    assert res.returncode == 0, res.stderr
    html = (out_dir / "final_summary.html").read_text()
    data = re.search(r'<script id="traceml-data" type="application/json">(.*?)</script>', html,
                     re.DOTALL)
    assert data is not None
    doc = json.loads(data.group(1))
    assert doc["summary"] == json.loads((session / "final_summary.json").read_text())
    assert [r["rank"] for r in doc["series"]["ranks"]] == [0, 1]
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing to fetch


def test_an_html_path_in_a_missing_folder_is_a_usage_error(tmp_path: Path) -> None:
    session = tmp_path / "s"
    session.mkdir()
    make_store(session / "telemetry.sqlite")
    res = report(str(session), "--html", str(tmp_path / "nope" / "r.html"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        (f"traceml report: --html: no such folder: {tmp_path / 'nope'} "
         "(create it, or give another path)")]
