"""Live-view fixtures: a hand-built run, a real headless Chromium, polling with deadlines."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.rows import step_row
from traceml import phases
from traceml.records import (
    GpuSample,
    NodeInfo,
    ProcessSample,
    RunData,
    RunMeta,
    SystemSample,
)

ROOT = Path(__file__).resolve().parents[2]
LIVE_SCRIPTS = ROOT / "tests" / "live" / "scripts"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]
GIB = 1024**3
MIB = 1024**2
T0 = 1_767_225_600.0

T = TypeVar("T")


def _two_rank_meta(session_id: str, host: str, device: str, torch: str) -> RunMeta:
    """A running 2-rank job on one node."""
    return RunMeta(
        session_id=session_id, command=["train.py"], started_at=T0, ended_at=T0,
        exit_code=None, partial=True, world_size=2, missing_ranks=(),
        nodes=(NodeInfo(0, host, (0, 1)),), device=device,
        versions={"traceml": "0.1.0", "torch": torch, "python": "3.11.7"},
        transport={"sent": 10, "dropped": 0, "gaps": 0, "rejected": 0},
    )


def fixed_run(num_steps: int = 12) -> RunData:
    """2 ranks on one CUDA node: r1's loader is slow and r0 waits for it in backward;
    device memory grows by 1 MiB a step; one GPU."""
    meta = _two_rank_meta("live-demo", "gpu-box", "cuda", "2.5.1")
    phases = {0: (4.0, 30.0, 56.0, 10.0), 1: (40.0, 30.0, 20.0, 10.0)}
    steps = tuple(
        step_row(r, s, phases[r][0] + (s % 3), *phases[r][1:], 100.0 + (s % 3), 0.0,
                4 * GIB + s * MIB, 5 * GIB, 2 * GIB, t=T0 + 1 + s * 0.1)
        for r in (0, 1) for s in range(num_steps))
    process = tuple(ProcessSample(r, 0, T0 + t, 100.0, 2 * GIB, 256 * GIB, 32,
                                  4 * GIB, 5 * GIB, 80 * GIB) for r in (0, 1) for t in (1, 2))
    gpus = (GpuSample(0, 90.0, 10 * GIB, 80 * GIB, 61.0, 200.0),)
    system = tuple(SystemSample(0, "gpu-box", T0 + t, 25.0, 30.0, 256 * GIB, gpus)
                   for t in (1, 2))
    return RunData(meta, steps, process, system)


def comm_run(num_steps: int = 30) -> RunData:
    """2 CPU ranks under gloo DDP, collectives timed, as in the demo: r1 loads each batch
    20 ms slower, r0 waits for it in the gradient all-reduce (its communication)."""
    meta = _two_rank_meta("comm-demo", "cpu-box", "cpu", "2.13.0")
    steps = []
    for s in range(num_steps):
        for rank, input_ms, comm_ms in ((0, 0.5, 22.0 + (s % 3) * 0.1), (1, 20.5, 2.0)):
            row = step_row(rank, s, input_ms + (s % 2) * 0.1, 40.0, 1.0, 0.2, 64.0 + (s % 2) * 0.1,
                           0.3, rss_bytes=GIB, t=T0 + 1 + s * 0.065, collective_ms=comm_ms)
            steps.append(row.replace(communication_ms=comm_ms))
    process = tuple(ProcessSample(r, 0, T0 + t, 100.0, GIB, 256 * GIB, 32, None, None, None)
                    for r in (0, 1) for t in (1, 2))
    system = tuple(SystemSample(0, "cpu-box", T0 + t, 25.0, 30.0, 256 * GIB, ())
                   for t in (1, 2))
    return RunData(meta, tuple(steps), process, system)


WIDE_SLOW_MS = 30.0
"""How much slower the planted rank of :func:`wide_run` loads its batches."""


def wide_phases(rank: int, step: int, slow_rank: int | None) -> tuple[float, ...]:
    """input, forward, backward, optimizer, total of one step of a many-rank run: a little
    deterministic noise on every rank, ``slow_rank`` loading WIDE_SLOW_MS slower; the other
    ranks wait that long in backward (as under DDP), so the totals stay alike."""
    noise = ((rank * 7 + step * 3) % 11) * 0.05
    slow = WIDE_SLOW_MS if rank == slow_rank else 0.0
    return 2.0 + noise + slow, 30.0 + noise, 50.0 + WIDE_SLOW_MS - slow, 10.0, 100.0 + WIDE_SLOW_MS


def wide_run(num_ranks: int, num_steps: int, slow_rank: int | None) -> RunData:
    """``num_ranks`` ranks on nodes of 8 (8 GPUs each), CUDA; rank ``slow_rank``'s loader
    is slow. Process and system samples for the gauges."""
    per_node = 8
    nodes = tuple(NodeInfo(n, f"node{n}", tuple(range(n * per_node, (n + 1) * per_node)))
                  for n in range(math.ceil(num_ranks / per_node)))
    meta = dataclasses.replace(fixed_run(1).meta, session_id="wide", world_size=num_ranks,
                               nodes=nodes)
    steps = []
    for rank in range(num_ranks):
        for step in range(num_steps):
            inp, fwd, bwd, opt, total = wide_phases(rank, step, slow_rank)
            row = step_row(rank, step, inp, fwd, bwd, opt, total, total - inp - fwd - bwd - opt,
                           4 * GIB + rank * MIB, 5 * GIB, 2 * GIB, t=T0 + 1 + step * 0.1,
                           samples=32)
            at, placed = 0.0, {}  # one call each, one after the other, as the tracker keeps them
            for name, ms in zip(("input", "forward", "backward", "optimizer"),
                                (inp, fwd, bwd, opt)):
                placed |= {f"{name}_at_ms": round(at, 3), f"{name}_end_ms": round(at + ms, 3)}
                at += ms
            steps.append(row.replace(**placed))
    process = tuple(ProcessSample(r, r // per_node, T0 + t, 90.0 + r % 7, 2 * GIB + r * MIB,
                                  256 * GIB, 64, 4 * GIB, 5 * GIB, 80 * GIB)
                    for r in range(num_ranks) for t in (1, 2))
    gpus = tuple(GpuSample(i, 80.0 + i, 10 * GIB, 80 * GIB, 60.0 + i, 300.0)
                 for i in range(per_node))
    system = tuple(SystemSample(n.node_rank, n.host, T0 + t, 25.0 + n.node_rank % 9, 30.0,
                                256 * GIB, gpus) for n in nodes for t in (1, 2))
    return RunData(meta, tuple(steps), process, system)


def wait_for(check: Callable[[], T | None], timeout_s: float, what: str,
             interval_s: float = 0.2, describe: Callable[[], str] | None = None) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``, with
    ``describe()`` (what was seen last) in the message."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            seen = f"; last seen:\n{describe()}" if describe else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{seen}")
        time.sleep(interval_s)


def artifact(name: str) -> Path:
    """A path under test-artifacts/ (gitignored), for screenshots and captures."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS / name


@dataclass
class PageWatch:
    """What a page did that a self-contained, error-free page must not do."""

    errors: list[str] = field(default_factory=list)
    outside_requests: list[str] = field(default_factory=list)


def _missing_browser() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is not installed (scripts/setup.sh installs it)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (requirements-dev.txt)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium, headless, through Playwright (its own browser download is not
    reachable). Missing on a developer machine: skipped; missing in CI: a failure."""
    missing = _missing_browser()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def open_page(browser: Any, allowed_origin: str) -> tuple[Any, PageWatch]:
    """A new page that records console errors, page errors and requests leaving
    ``allowed_origin`` (``file://`` or ``http://127.0.0.1:PORT``)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    watch = PageWatch()
    page.on("console", lambda msg: watch.errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: watch.errors.append(str(exc)))

    def check_request(request: Any) -> None:
        if not (request.url.startswith(allowed_origin) or request.url.startswith("data:")):
            watch.outside_requests.append(request.url)

    page.on("request", check_request)
    return page, watch


def chart_facts(page: Any) -> dict[str, Any]:
    """What every chart on the page drew, read from its data attributes."""
    return dict(page.evaluate("""() => ({
        phases: Array.from(document.querySelectorAll('[data-chart=phases]')).map((f) => ({
            rank: Number(f.dataset.rank), points: Number(f.dataset.points),
            last: Number(f.dataset.lastStep), paths: f.querySelectorAll('path').length})),
        heat: document.getElementById('heatmap').dataset.ranks || '',
        heatCols: Number(document.getElementById('heatmap').dataset.cols || 0),
        memory: (document.querySelector('[data-chart=memory]') || {dataset: {}}).dataset.ranks
            || '',
        gauges: Array.from(document.querySelectorAll('[data-gauges]')).map((g) => g.dataset.gauges),
        tableRanks: Array.from(document.querySelectorAll('#table tr[data-rank]'))
            .map((r) => Number(r.dataset.rank)),
        verdict: document.getElementById('verdict').dataset.label || '',
        final: document.getElementById('verdict').dataset.final === 'true',
        renders: Number(document.body.dataset.renders),
    })"""))


def assert_every_rank_charted(facts: dict[str, Any], ranks: list[int]) -> None:
    assert [p["rank"] for p in facts["phases"]] == ranks
    # One stacked area per part of the step: every phase, then wait.
    assert all(p["points"] > 0 and p["paths"] == len(phases.stacked())
               for p in facts["phases"]), facts["phases"]
    assert facts["heat"] == ",".join(map(str, ranks)) and facts["heatCols"] > 0
    assert facts["memory"] == ",".join(map(str, ranks))
    assert facts["tableRanks"] == ranks
    assert facts["gauges"], "no system or process gauges"


def have_tmux() -> bool:
    return shutil.which("tmux") is not None
