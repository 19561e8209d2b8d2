"""How big the page's document is, and how fast Chromium draws it, at many ranks.

Builds a hand-made run of N ranks (nodes of 8, one slow loader: tests/live/conftest.py
``wide_run``) and, for each N, prints:

  report_s    build_report over the run (the rules; not the page's part)
  snapshot_s  the page model: spreads, worst ranks, the downsampled grid, encoded
  html_MB     final_summary.html (the report's page, every byte of it)
  live_MB     the live dashboard's /api/snapshot document
  html_ms     Chromium, navigation to the page's first render, final_summary.html
  live_ms     ...the live document (embedded, as the dashboard's poll delivers it)
  lanes_ms    the swimlanes' part of snapshot_s: the typical and slowest step's lanes
              and density band, built and encoded
  lanes_KB    ...their part of the document

The page must draw the swimlanes (the run's rows carry phase positions), else the
benchmark fails.

    python scripts/bench_page_scale.py [--ranks 1024 8192] [--steps 40] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from bench_options import parse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.live.conftest import CHROMIUM, CHROMIUM_ARGS, wide_run  # noqa: E402
from traceml.report import build_report  # noqa: E402
from traceml.report.page.lanes import build_lanes, lanes_to_json  # noqa: E402
from traceml.report.page.render import render_page  # noqa: E402
from traceml.report.page.snapshot import (  # noqa: E402
    build_snapshot,
    live_snapshot,
    report_window,
    snapshot_to_json,
)


def first_render_ms(browser: Any, path: Path) -> float:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(path.as_uri())
    page.wait_for_function("document.body.dataset.renders !== '0'", timeout=60_000)
    ms = float(page.evaluate("document.body.dataset.firstRenderMs"))
    if not page.query_selector_all("[data-chart=lane-step] [data-lane]"):
        errors.append("no swimlanes drawn")
    page.close()
    if errors:
        raise SystemExit(f"{path.name}: the page erred: {errors[0]}")
    return ms


def measure(num_ranks: int, num_steps: int, browser: Any, folder: Path) -> dict[str, float]:
    run = wide_run(num_ranks, num_steps, slow_rank=num_ranks * 2 // 3)
    started = time.perf_counter()
    report = build_report(run, 10000)
    report_s = time.perf_counter() - started
    started = time.perf_counter()
    html_doc = orjson.dumps(snapshot_to_json(build_snapshot(run, report, ended=True), live=False))
    snapshot_s = time.perf_counter() - started
    live_doc = snapshot_to_json(live_snapshot(run, 10000, now=run.meta.started_at + 60), live=True)
    html = folder / f"final_{num_ranks}.html"
    html.write_text(render_page(orjson.loads(html_doc), "traceml report"), encoding="utf-8")
    live = folder / f"live_{num_ranks}.html"
    live.write_text(render_page(live_doc, "traceml live"), encoding="utf-8")
    started = time.perf_counter()
    lanes = orjson.dumps(lanes_to_json(build_lanes(run, report, report_window(run, report))))
    lanes_ms = (time.perf_counter() - started) * 1e3
    return {"report_s": report_s, "snapshot_s": snapshot_s, "html_MB": html.stat().st_size / 1e6,
            "live_MB": len(orjson.dumps(live_doc)) / 1e6,
            "html_ms": first_render_ms(browser, html), "live_ms": first_render_ms(browser, live),
            "lanes_ms": lanes_ms, "lanes_KB": len(lanes) / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--steps", type=int, default=40, help="steps per rank (default 40)")
    args = parse(parser, quick={"ranks": [64], "steps": 10}, limit_s=1800.0)
    from playwright.sync_api import sync_playwright

    print(f"{'ranks':>6} {'steps':>5} {'report_s':>9} {'snapshot_s':>10} {'html_MB':>8} "
          f"{'live_MB':>8} {'html_ms':>8} {'live_ms':>8} {'lanes_ms':>8} {'lanes_KB':>8}")
    with sync_playwright() as pw, tempfile.TemporaryDirectory() as tmp:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for num_ranks in args.ranks:
            m = measure(num_ranks, args.steps, browser, Path(tmp))
            print(f"{num_ranks:>6} {args.steps:>5} {m['report_s']:>9.1f} {m['snapshot_s']:>10.2f} "
                  f"{m['html_MB']:>8.2f} {m['live_MB']:>8.2f} {m['html_ms']:>8.0f} "
                  f"{m['live_ms']:>8.0f} {m['lanes_ms']:>8.0f} {m['lanes_KB']:>8.1f}", flush=True)
        browser.close()


if __name__ == "__main__":
    main()
