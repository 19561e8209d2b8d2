"""What the final summary costs on long and wide runs.

Builds synthetic stores with the real `StoreWriter` (every rank with its own
sender, steps, process samples every second, a system sample per node per
second, the launcher's start and end records), then times ``traceml report
<dir>`` in a fresh subprocess: wall seconds and the child's peak RSS
(``wait4``'s resource usage of that child).  The bounded path (what ``traceml run``,
``traceml report`` and ``traceml.summary()`` use) is timed on every store; the
full read (every stored row into Python, as before) for comparison on the
stores named with ``--full-on``.  Stores are kept in ``--cache`` and reused
when their shape matches, since the 20 M-row one takes minutes to write.

    python scripts/bench_summary_scale.py [--shapes 8x250000 8x2500000 8192x100]
        [--cache /tmp/traceml-bench-summary] [--full-on 8x250000] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_options import parse

from traceml import phases
from traceml.records import StepRow
from traceml.store import STORE_FILENAME, SenderState, StoreWriter
from traceml.wire.identity import Sender
from traceml.wire.records import RunEnd, RunStart
from traceml.wire.rows import ProcessRows, SystemRows

STEP_S = 0.05  # 20 steps/s per rank
RANKS_PER_NODE = 8
BATCH_ROWS = 200_000  # step rows per executemany
STARTED_AT = 1.7e9
WINDOW_ROWS = 10_000


def _pool(rank: int) -> list[tuple[tuple[float, ...], float]]:
    """A few phase-time patterns per rank (rank 1 is slower in backward: a straggler)."""
    out = []
    for k in range(17):
        base = (2.0 + 0.1 * (k % 5), 10.0 + 0.2 * (k % 3), 20.0 + (6.0 if rank == 1 else 0.0),
                3.0)
        phase_ms = [0.0] * len(phases.PHASES)
        for name, ms in zip(("input", "forward", "backward", "optimizer"), base):
            phase_ms[[p.name for p in phases.PHASES].index(name)] = ms
        out.append((tuple(phase_ms), sum(base) + 1.0 + 0.05 * k))
    return out


def _records(sender: Sender, first: int, last: int) -> list[StepRow]:
    pool = _pool(sender.rank or 0)
    counts = {p.count_column: 1 for p in phases.PHASES}
    out = []
    for step in range(first, last):
        phase_ms, total_ms = pool[step % len(pool)]
        out.append(StepRow.of(
            rank=sender.rank, node_rank=sender.node_rank, step=step,
            t_begin=STARTED_AT + step * STEP_S, total_ms=total_ms, wait_ms=1.0,
            **dict(zip((p.column for p in phases.PHASES), phase_ms)), **counts,
            rss_bytes=(2 << 30) + step * 64, samples=32, flops_counted=step == 7,
            eval_ms=500.0 if step % 5000 == 4999 else 0.0,
            num_eval=1 if step % 5000 == 4999 else 0))
    return out


def build_store(folder: Path, num_ranks: int, num_steps: int) -> None:
    """A finished run of ``num_ranks`` x ``num_steps`` steps in ``folder``."""
    folder.mkdir(parents=True)
    writer = StoreWriter(str(folder / STORE_FILENAME))
    writer.save_run(RunStart(session_id=folder.name, command=("python", "train.py"),
                             started_at=STARTED_AT, traceml_version="bench",
                             torch_version="", python_version="",
                             summary_window_rows=WINDOW_ROWS, mode="run",
                             expected_world_size=num_ranks))
    senders = [Sender("rank", f"node{r // RANKS_PER_NODE}", 1000 + r, r // RANKS_PER_NODE,
                      rank=r, local_rank=r % RANKS_PER_NODE, world_size=num_ranks)
               for r in range(num_ranks)]
    per_batch = max(1, BATCH_ROWS // num_ranks)
    for first in range(0, num_steps, per_batch):
        last = min(num_steps, first + per_batch)
        for sender in senders:
            writer.add_steps(_records(sender, first, last))
        writer.commit()
    duration_s = num_steps * STEP_S
    _add_samples(writer, senders, num_ranks, duration_s)
    end = STARTED_AT + duration_s
    for sender in senders:
        writer.save_sender(SenderState(sender, STARTED_AT, end, said_bye=True))
    writer.save_run(RunEnd(ended_at=end, exit_code=0))
    writer.close()


def _add_samples(writer: StoreWriter, senders: list[Sender], num_ranks: int,
                 duration_s: float) -> None:
    """One process sample per rank and one system sample per node every second."""
    num_nodes = (num_ranks + RANKS_PER_NODE - 1) // RANKS_PER_NODE
    fields = ("t", "cpu_pct", "rss_bytes", "host_ram_total_bytes", "num_cpus")
    times = [STARTED_AT + s for s in range(int(duration_s) + 1)]
    for sender in senders:
        writer.add_process(sender, ProcessRows(fields, [(t, 95.0, 2 << 30, 64 << 30, 16) for t in times]))
        writer.commit()
    for node in range(num_nodes):
        who = Sender("system", f"node{node}", 900 + node, node)
        writer.add_system(who, SystemRows(("t", "cpu_pct", "ram_pct", "ram_total_bytes", "gpus"),
                          [(t, 40.0, 30.0, 64 << 30, []) for t in times]))
        writer.save_sender(SenderState(who, STARTED_AT, STARTED_AT + duration_s, said_bye=True))
        writer.commit()


def timed_summary(folder: Path, full: bool) -> tuple[float, float, float, str]:
    """Wall seconds, CPU seconds, peak RSS (MB) and the verdict of one summary in a
    fresh process."""
    # The summary is dropped once printed, as `traceml report` and the launcher drop
    # theirs (held to the end, the interpreter's last collection would walk it too).
    code = ("import sys; from pathlib import Path; "
            "from traceml.report.session import write_summary; "
            f"print(write_summary(Path(sys.argv[1]), full={full}).summary['primary']['label'])")
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    out = child.stdout.read()
    # wait4: this child's own resource usage (RUSAGE_CHILDREN would keep the peak of
    # every child so far)
    _, status, usage = os.wait4(child.pid, 0)
    wall_s = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"the summary of {folder} failed (exit {child.returncode})")
    return wall_s, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out.strip()


def _shape(text: str) -> tuple[int, int]:
    ranks, steps = text.lower().split("x")
    return int(ranks), int(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8x250000", "8x2500000", "8192x100"],
                        help="RANKSxSTEPS per store")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/traceml-bench-summary"))
    parser.add_argument("--full-on", nargs="*", default=["8x250000"],
                        help="shapes also timed with the full read")
    parser.add_argument("--fresh", action="store_true", help="rebuild the cached stores")
    args = parse(parser, quick={"shapes": ["8x2000", "64x50"], "full_on": ["8x2000"]},
                 limit_s=7200.0)
    print(f"{'store':>12} {'rows':>11} {'MB':>7} {'path':>8} {'wall s':>7} {'CPU s':>6} "
          f"{'peak RSS MB':>11}  verdict")
    for text in args.shapes:
        num_ranks, num_steps = _shape(text)
        folder = args.cache / f"r{num_ranks}x{num_steps}"
        if args.fresh and folder.exists():
            shutil.rmtree(folder)
        if not (folder / STORE_FILENAME).is_file():
            started = time.perf_counter()
            partial = folder.with_name(folder.name + ".partial")  # an interrupted build
            shutil.rmtree(partial, ignore_errors=True)
            build_store(partial, num_ranks, num_steps)
            partial.rename(folder)
            print(f"# built {folder} in {time.perf_counter() - started:.0f} s", flush=True)
        size_mb = os.path.getsize(folder / STORE_FILENAME) / 1e6
        for full in ([False, True] if text in args.full_on else [False]):
            wall_s, cpu_s, rss_mb, verdict = timed_summary(folder, full)
            print(f"{text:>12} {num_ranks * num_steps:>11,} {size_mb:>7.0f} "
                  f"{'full' if full else 'bounded':>8} {wall_s:>7.2f} {cpu_s:>6.2f} "
                  f"{rss_mb:>11.0f}  {verdict}", flush=True)


if __name__ == "__main__":
    main()
