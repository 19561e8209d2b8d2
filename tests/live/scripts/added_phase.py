"""A phase added to the table and nothing else, run through the whole pipeline.

``python added_phase.py OUT``: appends a dummy ``h2d`` phase to
`traceml.phases.PHASES` before anything else is imported, then replays two
sessions' rank events through the collector's step tracker into real SQLite
stores (session ``slow`` spends 6 ms per step in the new phase, ``fast`` 1 ms),
writes their summaries and HTML reports, compares them, and renders the live
terminal view and the launcher's per-rank table, each into a file under OUT,
with what the (equally derived) summary schema found wrong.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

from traceml import phases

phases.PHASES = (*phases.PHASES, phases.Phase("h2d", "Host to device", "#17becf"))

from rich.console import Console  # noqa: E402

from traceml.collector.rank_steps import RankSteps  # noqa: E402
from traceml.compare.cli import main as compare_main  # noqa: E402
from traceml.launcher.ending import phase_table  # noqa: E402
from traceml.live.terminal import render_view  # noqa: E402
from traceml.report.html import write_html  # noqa: E402
from traceml.report.page.snapshot import live_snapshot  # noqa: E402
from traceml.report.schema import validate_summary  # noqa: E402
from traceml.report.session import write_summary  # noqa: E402
from traceml.store import SenderState, StoreWriter  # noqa: E402
from traceml.wire import events as ev  # noqa: E402
from traceml.wire.envelope import Envelope, decode, encode  # noqa: E402
from traceml.wire.identity import Sender  # noqa: E402
from traceml.wire.records import RunEnd, RunStart  # noqa: E402

H2D = phases.code("h2d")
T0 = 1_767_225_600.0
NUM_STEPS = 40


def iteration(t: float, h2d_s: float) -> list[tuple[int, float]]:
    """One training iteration's events: fetch, copy to the device, forward,
    backward, optimizer step (seconds on the rank's clock)."""
    marks = [(ev.INPUT, 0.0), (ev.END, 0.001), (H2D, 0.001),
             (ev.END, 0.001 + h2d_s)]
    at = 0.001 + h2d_s
    for code, length in ((ev.FORWARD, 0.002), (ev.BACKWARD, 0.004),
                         (ev.OPTIMIZER, 0.001)):
        marks += [(code, at), (ev.OPTIMIZER_END if code == ev.OPTIMIZER
                               else ev.END, at + length)]
        at += length
    return [(code, t + dt) for code, dt in marks]


def events(h2d_s: float) -> ev.EventBatch:
    """A rank's events message of NUM_STEPS steps, as the collector receives it."""
    times: list[list[float]] = [[] for _ in range(ev.NUM_EVENT_CODES)]
    step_s = 0.0085 + h2d_s  # 0.5 ms of it outside every phase
    for step in range(NUM_STEPS):
        for code, t in iteration(step * step_s, h2d_s):
            times[code].append(t)
    times[ev.CLOSE].append(NUM_STEPS * step_s)
    batch = ev.EventBatch(0, T0, times, [], [(0.0, 1 << 30)])
    wire = decode(encode(Envelope("s", Sender("rank", "box", 1, 0, 0), 0, T0, batch))).message
    assert isinstance(wire, ev.EventBatch)
    return wire


def session(out: Path, name: str, h2d_s: float) -> Path:
    folder = out / name
    folder.mkdir(parents=True)
    writer = StoreWriter(str(folder / "telemetry.sqlite"))
    writer.save_run(RunStart(
        session_id=name, command=(), started_at=T0, traceml_version="", torch_version="",
        python_version="", summary_window_rows=10000, mode="run", expected_world_size=2))
    writer.save_run(RunEnd(ended_at=T0 + 1.0, exit_code=0))
    for rank in (0, 1):
        sender = Sender("rank", "box", 100 + rank, 0, rank, rank, 2)
        writer.add_steps(RankSteps(sender).feed_batch(events(h2d_s)))
        writer.save_sender(SenderState(sender, T0, T0 + 1.0, said_bye=True))
    writer.close()
    return folder


def main() -> None:
    out = Path(sys.argv[1])
    slow, fast = session(out, "slow", 0.006), session(out, "fast", 0.001)
    write_summary(fast)
    files = write_summary(slow)
    (out / "schema_problems.txt").write_text("\n".join(validate_summary(files.summary)))
    write_html(slow / "final_summary.html", files.report, files.run)
    (out / "ending.txt").write_text(phase_table(files.run))
    compare_main([str(fast), str(slow), "--output", str(out / "compare")])
    console = Console(width=120, record=True, file=io.StringIO(), color_system=None)
    console.print(render_view(live_snapshot(files.run, 10000, now=T0 + 1.0)))
    (out / "terminal.txt").write_text(console.export_text())


if __name__ == "__main__":
    main()
