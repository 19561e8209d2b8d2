"""The --mode=cli view: snapshots rendered into a fixed-width console, compared as text."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

from rich.console import Console, RenderableType

from tests.live.conftest import T0, comm_run, fixed_run, wide_run
from traceml.live.terminal import _cell, render_view, status_line
from traceml.live.worker_output import OutputLine, WorkerOutput, clean_line
from traceml.records import RunData
from traceml.report.page.snapshot import live_snapshot


def render(renderable: RenderableType, width: int = 100, height: int = 40) -> str:
    console = Console(width=width, height=height, record=True, file=io.StringIO(),
                      color_system=None, legacy_windows=False)
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


OUTPUT = (OutputLine(0, "rank 0 step 10 loss 1.2345", False),
          OutputLine(1, "Traceback (most recent call last): " + "x" * 90, True))

EXPECTED_VIEW = """\
traceml session live-demo | 2 ranks on 1 node | cuda | 0:01:05 | running
Step time, ms: median / worst of the last 11 aligned steps
rank  step      input    forward   backward  optimizer       wait    total
──────────────────────────────────────────────────────────────────────────
r0      11  5.00/6.00  30.0/30.0  56.0/56.0  10.0/10.0  0.00/0.00  101/102
r1      11  41.0/42.0  30.0/30.0  20.0/20.0  10.0/10.0  0.00/0.00  101/102
most               r1          -         r0          -          -        -
Diagnosis: INPUT STRAGGLER [crit] (Step Time, r1)
  r1 input was 41.1 ms vs 5.1 ms on the other ranks (+36.0 ms, 35.6% of the 101.1 ms typical step;
  slower in 100% of the steps).
  Next: Check r1's data path: its shard size, DataLoader num_workers, and storage or preprocessing
  load on its node; every rank should load alike.
  Step Time INPUT STRAGGLER | Step Memory BALANCED | Process NORMAL | System NORMAL
System
n0 gpu-box  CPU ██░░░░░░ 25%  RAM ██░░░░░░ 30%
n0 gpu0     util ███████░ 90%  mem █░░░░░░░ 10.0/80.0 GiB  temp 61C
Process
r0 n0  CPU ░░░░░░░░ 100%  RSS ░░░░░░░░ 2.0 GiB  GPU mem ░░░░░░░░ 5.0/80.0 GiB
r1 n0  CPU ░░░░░░░░ 100%  RSS ░░░░░░░░ 2.0 GiB  GPU mem ░░░░░░░░ 5.0/80.0 GiB
Worker output (last lines by local rank; all of it in logs/live-demo/workers)
[0] rank 0 step 10 loss 1.2345
[1] Traceback (most recent call last): xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx…
"""


def test_view_of_a_two_rank_run() -> None:
    snap = live_snapshot(fixed_run(), 10000, now=T0 + 65)
    assert render(render_view(snap, OUTPUT, "logs/live-demo/workers")) == EXPECTED_VIEW


EXPECTED_80X24 = """\
traceml session live-demo | 2 ranks on 1 node | cuda | 0:01:05 | running
Step time, ms: median / worst of the last 11 aligned steps
rank  step      input    forward   backward  optimizer       wait    total
──────────────────────────────────────────────────────────────────────────
r0      11  5.00/6.00  30.0/30.0  56.0/56.0  10.0/10.0  0.00/0.00  101/102
r1      11  41.0/42.0  30.0/30.0  20.0/20.0  10.0/10.0  0.00/0.00  101/102
most               r1          -         r0          -          -        -
Diagnosis: INPUT STRAGGLER [crit] (Step Time, r1)
  r1 input was 41.1 ms vs 5.1 ms on the other ranks (+36.0 ms, 35.6% of the
  101.1 ms typical step; slower in 100% of the steps).
  Next: Check r1's data path: its shard size, DataLoader num_workers, and
  storage or preprocessing load on its node; every rank should load alike.
  Step Time INPUT STRAGGLER | Step Memory BALANCED | Process NORMAL | System
  NORMAL
System
n0 gpu-box  CPU ██░░░░░░ 25%  RAM ██░░░░░░ 30%
n0 gpu0     util ███████░ 90%  mem █░░░░░░░ 10.0/80.0 GiB  temp 61C
Process
r0 n0  CPU ░░░░░░░░ 100%  RSS ░░░░░░░░ 2.0 GiB  GPU mem ░░░░░░░░ 5.0/80.0 GiB
r1 n0  CPU ░░░░░░░░ 100%  RSS ░░░░░░░░ 2.0 GiB  GPU mem ░░░░░░░░ 5.0/80.0 GiB
Worker output (last lines by local rank; all of it in logs/live-demo/workers)
[1] Traceback (most recent call last): xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx…
[0] rank 0 step 10 loss 1.2345
[1] Traceback (most recent call last): xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx…
"""


def test_an_80x24_terminal_gets_as_many_output_lines_as_fit() -> None:
    snap = live_snapshot(fixed_run(), 10000, now=T0 + 65)
    text = render(render_view(snap, OUTPUT * 5, "logs/live-demo/workers"), width=80, height=24)
    assert text == EXPECTED_80X24
    assert len(text.splitlines()) == 24


EXPECTED_WAITING = """\
traceml session live-demo | 2 ranks on 1 node | cuda | 0:00:03 | ended
Waiting for the first training steps...
Diagnosis: STEP TIME NOT MEASURED [info] (Step Time)
  No training step was recorded.
  Step Time STEP TIME NOT MEASURED | Step Memory STEP MEMORY NOT MEASURED | Process PROCESS NOT
  MEASURED | System SYSTEM NOT MEASURED
System
  no samples yet
Process
  no samples yet
Worker output (last lines by local rank; all of it in w)
  (nothing yet)
"""


def test_view_before_the_first_step_and_once_ended() -> None:
    empty = RunData(fixed_run().meta, (), (), ())
    snap = dataclasses.replace(live_snapshot(empty, 10000, now=T0 + 3.9), ended=True)
    assert render(render_view(snap, (), "w")) == EXPECTED_WAITING


def test_many_ranks_show_the_slowest_sixteen() -> None:
    base = fixed_run()
    steps = tuple(row.replace(rank=rank, total_ms=row.total_ms + rank)
                  for rank in range(20) for row in base.steps if row.rank == 0)
    run = RunData(dataclasses.replace(base.meta, world_size=20), steps, (), ())
    text = render(render_view(live_snapshot(run, 10000, now=T0), (), None), width=120)
    assert "\n16 slowest of 20 ranks shown\n" in text
    ranks = [line.split()[0] for line in text.splitlines()
             if line.startswith("r") and line[1].isdigit()]
    assert ranks == [f"r{rank}" for rank in range(4, 20)]


EXPECTED_64_RANKS = """\
traceml session wide | 64 ranks on 8 nodes | cuda | 0:01:05 | running
Step time across 64 ranks, ms: each rank's median of the last 11 aligned steps
across ranks  input  forward  backward  optimizer  wait  total
──────────────────────────────────────────────────────────────
median         2.25     30.2      80.0       10.0  7.50    130
p90            2.25     30.2      80.0       10.0  7.50    130
worst          32.2     30.2      80.0       10.0  7.50    130
worst rank      r37       r0        r0         r0    r0     r0
Worst ranks by phase, ms (their median; the 8 worst)
input      r37 32.2  r0 2.25  r1 2.25  r2 2.25  r3 2.25  r4 2.25  r5 2.25  r6 2.25
forward    r0 30.2  r1 30.2  r2 30.2  r3 30.2  r4 30.2  r5 30.2  r6 30.2  r7 30.2
backward   r0 80.0  r1 80.0  r2 80.0  r3 80.0  r4 80.0  r5 80.0  r6 80.0  r7 80.0
optimizer  r0 10.0  r1 10.0  r2 10.0  r3 10.0  r4 10.0  r5 10.0  r6 10.0  r7 10.0
wait       r0 7.50  r1 7.50  r2 7.50  r3 7.50  r4 7.50  r5 7.50  r6 7.50  r7 7.50
total      r0 130  r1 130  r2 130  r3 130  r4 130  r5 130  r6 130  r7 130
Newest step: median 11, lowest 11 (r0)
Throughput: 15,754 samples/s
Diagnosis: INPUT STRAGGLER [crit] (Step Time, r37)
  r37 input was 32.2 ms vs 2.2 ms on the other ranks (+30.0 ms, 23.1% of the 130.0 ms typical step;
  slower in 100% of the steps).
  Next: Check r37's data path: its shard size, DataLoader num_workers, and storage or preprocessing
  load on its node; every rank should load alike.
  Step Time INPUT STRAGGLER | Step Memory BALANCED | Process NORMAL | System NORMAL
System
nodes median  CPU ██░░░░░░ 28% n3  RAM ██░░░░░░ 30% n4
nodes p90     CPU ███░░░░░ 32% n7  RAM ██░░░░░░ 30% n0
nodes worst   CPU ███░░░░░ 32% n7  RAM ██░░░░░░ 30% n0
GPUs median   util ███████░ 84% n0 gpu4  mem █░░░░░░░ 10.0/80.0 GiB n4 gpu0  temp 63C n0 gpu3
GPUs p90      util ██████░░ 80% n6 gpu0  mem █░░░░░░░ 10.0/80.0 GiB n0 gpu6  temp 67C n6 gpu7
GPUs worst    util ██████░░ 80% n0 gpu0  mem █░░░░░░░ 10.0/80.0 GiB n0 gpu0  temp 67C n0 gpu7
Process
ranks median  CPU █░░░░░░░ 93% r38  RSS ░░░░░░░░ 2.0 GiB r31  GPU mem ░░░░░░░░ 5.0/80.0 GiB r32
ranks p90     CPU █░░░░░░░ 96% r48  RSS ░░░░░░░░ 2.1 GiB r57  GPU mem ░░░░░░░░ 5.0/80.0 GiB r6
ranks worst   CPU █░░░░░░░ 96% r6  RSS ░░░░░░░░ 2.1 GiB r63  GPU mem ░░░░░░░░ 5.0/80.0 GiB r0
"""


def test_many_ranks_show_spreads_and_the_worst_ranks_not_every_rank() -> None:
    snap = live_snapshot(wide_run(64, 12, slow_rank=37), 10000, now=T0 + 65)
    text = render(render_view(snap, (), None), width=100, height=60)
    assert text == EXPECTED_64_RANKS
    assert status_line(snap).startswith(
        "traceml: 0:01:05 | 64 ranks, step median 11, lowest 11 (r0) | step time median 130 ms")


def test_status_line_without_a_terminal() -> None:
    snap = live_snapshot(fixed_run(), 10000, now=T0 + 65)
    assert status_line(snap) == ("traceml: 0:01:05 | step r0 11, r1 11 | step time median 101 ms,"
                                 " worst 101 ms (r0) | INPUT STRAGGLER [crit]")


def test_clean_line_shows_what_a_terminal_would() -> None:
    assert clean_line("epoch 1:  10%\r epoch 1:  50%\r epoch 1: 100%\r") == " epoch 1: 100%"
    assert clean_line("\x1b[31mred\x1b[0m and\tplain\x07") == "red and plain"


def test_worker_output_follows_the_log_files(tmp_path: Path) -> None:
    old = tmp_path / "earlier_run" / "attempt_0" / "0"
    old.mkdir(parents=True)
    (old / "stdout.log").write_text("from an earlier run\n")
    output = WorkerOutput(tmp_path, num_lines=3, skip=frozenset({"earlier_run"}))
    assert output.poll() == ()
    rank0 = tmp_path / "run_x" / "attempt_0" / "0"
    rank1 = tmp_path / "run_x" / "attempt_0" / "1"
    rank0.mkdir(parents=True)
    rank1.mkdir(parents=True)
    (rank0 / "stdout.log").write_text("one\ntwo\npart")
    (rank1 / "stderr.log").write_text("boom\n")
    assert [(o.local_rank, o.text, o.is_err) for o in output.poll()] == [
        (0, "one", False), (1, "boom", True), (0, "two", False)]  # the files interleaved
    with (rank0 / "stdout.log").open("a") as f:
        f.write("ial line\n\nlast\n")
    assert [o.text for o in output.poll()] == ["two", "partial line", "last"]


def _with_stall(run: RunData, cleared: bool) -> RunData:
    from traceml.records import Incident
    from traceml.stacks import Frame

    user = (Frame("/home/me/train.py", 42, "forward"),)
    end = T0 + 8 if cleared else None
    stalls = (Incident("stall", 1, 0, "gpu-box", 11, T0 + 2, T0 + 5, end, 11, "forward",
                       ("forward",), user, "python"),
              Incident("stall", 0, 0, "gpu-box", 10, T0 + 2.1, T0 + 5, end, 11,
                       "communication", ("backward", "communication"), user, "python"))
    return dataclasses.replace(run, incidents=stalls)


def test_a_stall_is_the_diagnosis_while_it_lasts_and_stays_in_view_once_cleared() -> None:
    stalled = render(render_view(live_snapshot(_with_stall(fixed_run(), cleared=False), 10000,
                                               now=T0 + 65)))
    assert "Diagnosis: STALLED [crit] (Ending, r1)" in stalled
    assert "r1 (n0) made no progress for 3.0 s at step 11 in forward (train.py:42 in forward)" in stalled
    cleared = render(render_view(live_snapshot(_with_stall(fixed_run(), cleared=True), 10000,
                                               now=T0 + 65)))
    assert "Diagnosis: INPUT STRAGGLER [crit] (Step Time, r1)" in cleared
    assert "STALL CLEARED [warn]: r1 (n0) made no progress for 6.0 s at step 11 in forward" in cleared
def test_throughput_line_and_status_once_measured() -> None:
    from tests.unit.test_throughput import run

    snap = live_snapshot(run(2), 10000, now=T0 + 65)
    text = render(render_view(snap))
    assert "Throughput: 1,280 samples/s | 600 TFLOP/s | MFU 30.3%\n" in text
    assert "| 1,280 samples/s | 600 TFLOP/s | MFU 30.3% |" in status_line(snap)
    low = render(render_view(live_snapshot(run(2, flops=5e12), 10000, now=T0 + 65)))
    assert "Throughput: 1,280 samples/s | 100 TFLOP/s | MFU 5.1%  LOW MFU\n" in low
    assert "Throughput:" not in render(render_view(live_snapshot(fixed_run(), 10000, now=T0)))


def _table_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Step time"))
    end = next(i for i, line in enumerate(lines) if line.startswith("most "))
    return lines[start:end + 1]


def test_at_80_columns_the_table_narrows_instead_of_cutting_values() -> None:
    """With communication timed the median / worst table is 91 columns: at 80 each rank's
    median is shown whole, every phase named in full; wider terminals get both."""
    snap = live_snapshot(comm_run(), 10000, now=T0 + 5)
    narrow = render(render_view(snap, OUTPUT * 5, "logs/comm-demo/workers"), width=80, height=24)
    table = _table_lines(narrow)
    assert table[0] == "Step time, ms: median of the last 27 aligned steps"
    assert table[1].split() == ["rank", "step", "input", "forward", "backward", "optimizer",
                                "communication", "wait", "total"]
    assert table[3].split() == ["r0", "29", "0.60", "40.0", "1.00", "0.20", "22.1", "0.30", "64.1"]
    assert table[4].split() == ["r1", "29", "20.6", "40.0", "1.00", "0.20", "2.00", "0.30", "64.1"]
    assert all("…" not in line and len(line) <= 80 for line in table)
    assert "…" not in narrow.split("Worker output")[0]  # the output lines may be cut, not the rest
    assert len(narrow.splitlines()) == 24  # the output panel keeps its room
    wide = _table_lines(render(render_view(snap, (), None), width=100))
    assert wide[0] == "Step time, ms: median / worst of the last 27 aligned steps"
    assert wide[3].split()[2:4] == ["0.60/0.60", "40.0/40.0"]


def test_red_is_what_the_verdict_blames_not_the_rank_that_waits() -> None:
    """The demo's straggler: r1 loads slowly, r0 waits for it in communication.  Red is
    r1's input (INPUT STRAGGLER); r0's communication is the most time in that column,
    dim and italic (waiting), and ranks alike in a phase name no one."""
    snap = live_snapshot(comm_run(), 10000, now=T0 + 5)
    r0, r1 = snap.phases
    styles = {(row.rank, phase): str(_cell(snap, row, phase, True).style)
              for row in (r0, r1) for phase in row.median_ms}
    assert [key for key, style in styles.items() if "red" in style] == [(1, "input_ms")]
    assert styles[(0, "communication_ms")] == "italic dim"
    assert styles[(0, "forward_ms")] == styles[(1, "forward_ms")] == ""  # 40.0 on both
    text = render(render_view(snap, (), None), width=100)
    assert _table_lines(text)[-1].split() == ["most", "r1", "-", "-", "-", "r0", "-", "-"]
