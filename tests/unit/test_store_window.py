"""The final summary's bounded read (`StoreReader.window_run`) gives the same report as
reading every stored row, while loading only the window's rows."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.rows import run_start, sent_by, step_record
from traceml.diagnosis import window
from traceml.launcher.ending import phase_table
from traceml.records import Capture, Incident, RunData, StepRow
from traceml.report.session import build_summary
from traceml.store import STORE_FILENAME, SenderState, StoreWriter, reader
from traceml.wire.identity import Sender
from traceml.wire.records import RunEnd
from traceml.wire.rows import ProcessRows, SystemRows

T0 = 1.7e9
STEP_S = 0.05


@dataclass
class Attempt:
    """Steps ``first``..``last - 1`` of one rank's attempt (restart)."""

    rank: int
    first: int
    last: int
    restart: int = 0
    skip: frozenset[int] = frozenset()  # steps that never arrived
    slower_ms: float = 0.0  # extra backward time: a straggler


@dataclass
class Shape:
    attempts: list[Attempt]
    window: int
    sample_s: float = 1.0  # process and system sample interval
    counted: tuple[int, ...] = (7,)  # steps the FLOP counter ran in (rank 0)
    eval_every: int = 100
    kill_at: float | None = None  # a SIGKILL of rank 0 at this unix time
    nodes: int = 1
    ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ranks = sorted({a.rank for a in self.attempts})


def _records(a: Attempt, shape: Shape) -> Iterable[StepRow]:
    for step in range(a.first, a.last):
        if step in a.skip:
            continue
        k = (step * 7 + a.rank * 3 + a.restart) % 11
        backward = 20.0 + k * 0.3 + a.slower_ms + (40.0 if step % 97 == 13 else 0.0)
        phases = {"input_ms": 2.0 + 0.1 * k, "forward_ms": 10.0, "backward_ms": backward,
                  "optimizer_ms": 3.0}
        total = sum(phases.values()) + 1.0
        record = step_record(step, t_begin=T0 + step * STEP_S, total_ms=total, wait_ms=1.0,
                             num_input=1, rss_bytes=(1 << 30) + step * 4096 * (1 + a.rank),
                             **phases)
        evaluated = step % shape.eval_every == shape.eval_every - 1
        yield record.replace(
            flops_counted=a.rank == 0 and step in shape.counted, samples=8,
            eval_ms=250.0 + a.rank if evaluated else 0.0, num_eval=1 if evaluated else 0)


def _write(folder: Path, shape: Shape) -> Path:
    writer = StoreWriter(str(folder / STORE_FILENAME))
    writer.save_run(run_start("w", T0, shape.window, expected_world_size=len(shape.ranks)))
    node_of = {r: r * shape.nodes // len(shape.ranks) for r in shape.ranks}
    for a in shape.attempts:
        who = Sender("rank", f"h{node_of[a.rank]}", 100 + a.rank, node_of[a.rank], rank=a.rank,
                     local_rank=a.rank, world_size=len(shape.ranks), restart=a.restart)
        writer.add_steps(sent_by(who, _records(a, shape)))
        writer.save_sender(SenderState(who, T0, T0 + a.last * STEP_S, said_bye=True))
        end_s = a.last * STEP_S
        times = [T0 + i * shape.sample_s for i in range(int(end_s / shape.sample_s) + 1)]
        writer.add_process(who, ProcessRows(("t", "cpu_pct", "rss_bytes", "host_ram_total_bytes",
                                 "num_cpus"),
                           [(t, 90.0 + (t - T0) % 7, 1 << 30, 64 << 30, 4) for t in times]))
    duration_s = max(a.last for a in shape.attempts) * STEP_S
    for node in sorted(set(node_of.values())):
        who = Sender("system", f"h{node}", 50 + node, node)
        times = [T0 + i * shape.sample_s for i in range(int(duration_s / shape.sample_s) + 1)]
        writer.add_system(who, SystemRows(("t", "cpu_pct", "ram_pct", "ram_total_bytes", "gpus"),
                          [(t, 30.0 + (t - T0) % 5, 40.0 + (t - T0) % 50, 64 << 30, [])
                           for t in times]))
        writer.save_sender(SenderState(who, T0, T0 + duration_s, said_bye=True))
    if shape.kill_at is not None:
        writer.add_incident(Incident("exit", 0, 0, "h0", 100, shape.kill_at, shape.kill_at,
                                     detail={"signal": "SIGKILL"}))
    writer.save_run(RunEnd(ended_at=T0 + duration_s, exit_code=137 if shape.kill_at else 0))
    writer.close()
    return folder


SHAPES = {
    "3 ranks x 400, window 50": Shape(
        [Attempt(r, 0, 400, slower_ms=8.0 if r == 2 else 0.0) for r in range(3)], 50,
        counted=(7, 380)),
    "a rank stops early": Shape([Attempt(0, 0, 400), Attempt(1, 0, 250), Attempt(2, 0, 400)], 50),
    "a restart re-runs steps": Shape(
        [Attempt(0, 0, 300), Attempt(0, 200, 400, restart=1), Attempt(1, 0, 400)], 60),
    "dropped steps near the end": Shape(
        [Attempt(0, 0, 400), Attempt(1, 0, 400, skip=frozenset(range(330, 395)))], 40),
    "one rank": Shape([Attempt(0, 0, 400)], 30),
    "8 ranks, 2 nodes": Shape(
        [Attempt(r, 0, 300, slower_ms=6.0 if r == 5 else 0.0) for r in range(8)], 50, nodes=2),
    "a window between two samples": Shape([Attempt(0, 0, 400), Attempt(1, 0, 400)], 20,
                                          sample_s=5.0),
    "a SIGKILL after the window": Shape([Attempt(0, 0, 200), Attempt(1, 0, 400)], 50,
                                        kill_at=T0 + 10.9),
    "the window is the whole run": Shape([Attempt(0, 0, 40), Attempt(1, 0, 40)], 100),
    "warm-up decided by a short run": Shape([Attempt(0, 0, 45), Attempt(1, 0, 45)], 30),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_bounded_summary_is_the_full_reads(tmp_path: Path, name: str) -> None:
    shape = SHAPES[name]
    folder = _write(tmp_path, shape)
    full = build_summary(folder, full=True)
    bounded = build_summary(folder)
    assert bounded.summary == full.summary
    assert bounded.text == full.text
    assert phase_table(bounded.run) == phase_table(full.run)
    stored = len(full.run.steps)
    if shape.window * 3 < max(a.last for a in shape.attempts):
        assert len(bounded.run.steps) < stored / 2, "the bounded read loaded most of the run"
    assert len(bounded.run.process) <= len(full.run.process)


def test_the_window_the_read_placed_is_the_reports(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounded read places the window (to read the samples taken while it ran); the
    report takes it, not placing it again (a pass over 400 000 rows at 8192 ranks),
    unless a profiler capture's steps are to be left out of it."""
    from traceml.report import build

    folder = _write(tmp_path, SHAPES["8 ranks, 2 nodes"])
    placed: list[window.StepWindow] = []
    place = window.select_window

    def counted(*args: object, **kwargs: object) -> window.StepWindow:
        placed.append(place(*args, **kwargs))  # type: ignore[arg-type]
        return placed[-1]

    monkeypatch.setattr(window, "select_window", counted)
    monkeypatch.setattr(build, "select_window", counted)
    files = build_summary(folder)
    assert len(placed) == 1 and placed[0].world_size == 0  # the read's, before the meta
    assert files.summary["step_time"]["scope"]["num_steps"] == 50
    assert files.summary["step_time"]["scope"]["missing_ranks"] == []
    run = files.run
    policy = window.PlacingWindow()
    policy.time_span(run.steps, 50)
    reused = policy.window_for(run, 50)
    assert reused is not None and reused.world_size == 8
    assert reused == place(run.steps, 50, 8) and reused.time_span() == placed[0].time_span()
    assert policy.window_for(run, 60) is None  # another window
    captured = dataclasses.replace(run, captures=(_capture(run),))
    assert policy.window_for(captured, 50) is None  # the report leaves its steps out


def _capture(run: RunData) -> Capture:
    first = run.steps[-5]
    assert first.t_begin is not None
    return Capture("c1", first.rank, "suspect", "manual", "manual", None, T0,
                          first.step, 2, began_at=first.t_begin, ended_at=first.t_begin + 0.1)


def test_the_window_reads_each_rank_around_its_end_only(tmp_path: Path) -> None:
    folder = _write(tmp_path, SHAPES["3 ranks x 400, window 50"])
    files = build_summary(folder, window_rows=50)
    steps = {(r.rank, r.step) for r in files.run.steps}
    # 50 steps and a warm-up's margin before them, no further back
    assert min(s for _, s in steps) >= 400 - 50 - 60
    assert files.summary["step_time"]["scope"]["num_steps"] == 49  # step 380 was counted
    totals = {t.rank: t for t in files.run.totals or ()}
    assert [t.num_rows for t in totals.values()] == [400, 400, 400]  # the whole run's
    assert totals[0].num_eval == 4 and totals[0].last_step == 399
    # ... and the samples taken while the window ran, not the whole run's
    full = build_summary(folder, window_rows=50, full=True).run
    assert 0 < len(files.run.process) < len(full.process) / 4
    assert 0 < len(files.run.system) < len(full.system) / 4


def test_a_store_without_the_sample_indexes_reads_the_same(tmp_path: Path) -> None:
    folder = _write(tmp_path, SHAPES["8 ranks, 2 nodes"])
    with_indexes = build_summary(folder)
    db = sqlite3.connect(folder / STORE_FILENAME)
    db.execute("DROP INDEX process_t")
    db.execute("DROP INDEX system_t")
    db.commit()
    db.close()
    (folder / STORE_FILENAME).chmod(0o444)  # as a read-only copy would be
    assert build_summary(folder).summary == with_indexes.summary


def test_the_phase_table_of_a_wide_job_lists_its_slowest_ranks(tmp_path: Path) -> None:
    shape = Shape([Attempt(r, 0, 30, slower_ms=9.0 if r in (3, 17) else 0.0)
                   for r in range(40)], 10)
    files = build_summary(_write(tmp_path, shape))
    table = phase_table(files.run).splitlines()
    assert table[0] == "traceml: mean time per step (16 slowest of 40 ranks)"
    listed = [line.split()[0] for line in table[3:]]
    assert len(listed) == 16 and "r3" in listed and "r17" in listed
    assert listed == sorted(listed, key=lambda r: int(r[1:]))


def test_a_wide_jobs_window_is_capped_in_rows_and_read_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At many ranks the window keeps at most WINDOW_MAX_ROWS rows over all ranks
    (here lowered so that 8 ranks are "many"): the bounded read then loads about
    that, not the configured window of every rank, and still gives the full read's
    summary."""
    monkeypatch.setattr(window, "WINDOW_MAX_ROWS", 8 * 60)
    shape = dataclasses.replace(SHAPES["8 ranks, 2 nodes"], window=250)
    folder = _write(tmp_path, shape)
    full = build_summary(folder, full=True)
    bounded = build_summary(folder)
    assert bounded.summary == full.summary
    scope = bounded.summary["step_time"]["scope"]
    assert scope["num_steps"] == 60 and scope["last_step"] == 299
    assert scope["window_rows"] == 250  # the configured window, as the run asked
    assert bounded.summary["step_time"]["findings"][0]["ranks"] == [5]  # the slow rank
    assert len(bounded.run.steps) <= 8 * (60 + 60)
    assert window.window_steps(250, 8) == 60
    assert window.window_steps(250, 2) == 240 and window.window_steps(250, 100) == 50


def test_hundreds_of_crashed_ranks_still_get_their_summary(tmp_path: Path) -> None:
    """Every rank of a wide job aborted (the NCCL watchdog's SIGABRT): one crash
    incident per rank, whose host samples the ending reads; far more spans than
    one SQLite query may hold, and the summary is the full read's."""
    num_ranks = 600
    writer = StoreWriter(str(tmp_path / STORE_FILENAME))
    writer.save_run(run_start("w", T0, 50, num_ranks))
    for r in range(num_ranks):
        who = Sender("rank", "h0", 100 + r, 0, rank=r, local_rank=r, world_size=num_ranks)
        writer.add_steps(sent_by(who, [step_record(s, t_begin=T0 + s * 0.1, total_ms=100.0, wait_ms=1.0,
                                           forward_ms=50.0) for s in range(60)]))
        writer.save_sender(SenderState(who, T0, T0 + 6))
        at = T0 + 6.0 + r * 0.05  # spread over 30 s: spans that overlap and some that do not
        writer.add_incident(Incident("exit", r, 0, "h0", 100 + r, at, at + 0.1,
                                     detail={"exit_code": -6, "signal": "SIGABRT"}))
    system = Sender("system", "h0", 50, 0)
    writer.add_system(system, SystemRows(("t", "cpu_pct", "ram_pct", "ram_total_bytes", "gpus"),
                      [(T0 + i, 10.0, 40.0 + i, 64 << 30, []) for i in range(60)]))
    writer.save_sender(SenderState(system, T0, T0 + 60, said_bye=True))
    writer.save_run(RunEnd(ended_at=T0 + 60, exit_code=1))
    writer.close()
    bounded, full = build_summary(tmp_path), build_summary(tmp_path, full=True)
    assert bounded.summary == full.summary
    assert bounded.summary["primary"]["label"] == "CRASHED"


def test_a_watch_summary_reads_the_latest_samples_of_each_source(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No step window (traceml watch): at most SAMPLES_PER_SOURCE shared out, the
    latest of each rank and node (lowered here to stand for a week of samples)."""
    # The reader reads the cap where it is defined (the package only re-exports it).
    monkeypatch.setattr(reader, "SAMPLES_PER_SOURCE", 2 * 70)
    writer = StoreWriter(str(tmp_path / STORE_FILENAME))
    writer.save_run(dataclasses.replace(run_start("w", T0, 100, 1), mode="watch"))
    who = Sender("rank", "h0", 100, 0, rank=0, local_rank=0, world_size=1)
    writer.add_process(who, ProcessRows(("t", "cpu_pct", "rss_bytes", "host_ram_total_bytes", "num_cpus"),
                       [(T0 + i, 50.0 if i < 200 else 5.0, 1 << 30, 64 << 30, 4)
                        for i in range(400)]))
    writer.save_sender(SenderState(who, T0, T0 + 400, said_bye=True))
    system = Sender("system", "h0", 50, 0)
    writer.add_system(system, SystemRows(("t", "cpu_pct", "ram_pct", "ram_total_bytes", "gpus"),
                      [(T0 + i, 90.0 if i < 200 else 10.0, 40.0, 64 << 30, [])
                       for i in range(400)]))
    writer.save_sender(SenderState(system, T0, T0 + 400, said_bye=True))
    writer.save_run(RunEnd(ended_at=T0 + 400, exit_code=0))
    writer.close()
    run = build_summary(tmp_path).run
    for samples in (run.process, run.system):
        kept = len(samples)
        assert 60 <= kept <= 140  # its share of the cap, at least MIN_SAMPLES_PER_SOURCE
        assert [s.t - T0 for s in samples] == [float(i) for i in range(400 - kept, 400)]
