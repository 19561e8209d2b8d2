"""How many ranks one collector can take.

Starts a real collector process, then N simulated ranks (spread over a few
sender processes, each rank with its own identity and sequence numbers) that
each push a batch of step rows every flush interval at STEPS_PER_S steps per
second, plus one process sample per second, for DURATION seconds.  Reports
messages and step rows ingested per second, drops (sender-side queue full)
and sequence gaps, the collector's CPU and memory, and how long the final
summary takes to build and write.

    python scripts/bench_collector_scale.py [--ranks 64 256 1024] [--duration 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import psutil
import zmq

from traceml import protocol
from traceml.collector.server import CollectorConfig
from traceml.launcher.collector_process import CollectorProcess
from traceml.protocol import Envelope, RunEnd, RunStart, Sender
from traceml.security import derive_keys, new_secret, secure_client
from traceml.store import StoreError, StoreReader

SESSION = "scale"
FLUSH_S = 0.5


def simulate(endpoint: str, secret: str, ranks: range, world: int, steps_per_s: float, duration_s: float,
             out: mp.Queue[tuple[int, int, int]]) -> None:
    """One sender process speaking for several ranks."""
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.LINGER, 2000)
    secure_client(sock, derive_keys(secret, SESSION))
    sock.connect(endpoint)
    seqs = {r: 0 for r in ranks}
    sent = dropped = rows_sent = 0
    per_flush = max(1, round(steps_per_s * FLUSH_S))
    start = time.monotonic()
    tick = 0
    while True:
        last = time.monotonic() - start >= duration_s
        now = time.time()
        for r in ranks:
            who = Sender("rank", f"sim{r // 8}", 10_000 + r, r // 8, rank=r, local_rank=r % 8,
                         world_size=world)
            times: list[list[float]] = [[] for _ in range(protocol.NUM_EVENT_CODES)]
            for i in range(per_flush):
                log_iteration(times, (tick * per_flush + i) / steps_per_s)
            if last:
                times[protocol.CLOSE].append(times[protocol.OPTIMIZER_END][-1])
            rss = [(times[protocol.INPUT][0], 300 << 20)]
            messages = [(protocol.KIND_EVENTS,
                         protocol.events_payload(tick, now, times, [], rss))]
            if tick % 2 == 0:
                messages.append((protocol.KIND_PROCESS, protocol.rows_payload(
                    protocol.PROCESS_FIELDS, [(now, 95.0, 300 << 20, 64 << 30, 2, None, None,
                                               None)])))
            for kind, payload in messages:
                env = Envelope(SESSION, kind, who, seqs[r], now, payload)
                seqs[r] += 1
                try:
                    sock.send(protocol.encode(env), zmq.NOBLOCK)
                    sent += 1
                    rows_sent += per_flush if kind == protocol.KIND_EVENTS else 0
                except zmq.Again:
                    dropped += 1
        if last:
            break
        tick += 1
        time.sleep(max(0.0, start + tick * FLUSH_S - time.monotonic()))
    sock.close()
    context.term()
    out.put((sent, dropped, rows_sent))


def log_iteration(times: list[list[float]], t: float) -> None:
    """One training iteration's events as a rank logs them: fetch, forward,
    loss, backward, optimizer."""
    for code, at in ((protocol.INPUT, t), (protocol.END, t + 0.001),
                     (protocol.FORWARD, t + 0.001), (protocol.END, t + 0.02),
                     (protocol.FORWARD, t + 0.02), (protocol.END_UNCOUNTED, t + 0.021),
                     (protocol.BACKWARD, t + 0.021), (protocol.END, t + 0.06),
                     (protocol.OPTIMIZER, t + 0.06), (protocol.OPTIMIZER_END, t + 0.07)):
        times[code].append(at)


def count_steps(db_path: Path) -> int:
    try:
        with StoreReader(db_path) as reader:
            return reader.num_steps()
    except StoreError:
        return 0


def bench(num_ranks: int, steps_per_s: float, duration_s: float, senders: int) -> None:
    from traceml.report.session import write_summary

    with tempfile.TemporaryDirectory() as tmp:
        session_dir = Path(tmp) / SESSION
        session_dir.mkdir()
        db_path = session_dir / "telemetry.sqlite"
        secret = new_secret()
        collector = CollectorProcess(CollectorConfig(
            session_id=SESSION, bind_host="127.0.0.1", port=0, db_path=str(db_path),
            parent_pid=os.getpid(), secret=secret))
        collector.record(RunStart(
            session_id=SESSION, command=("bench",), started_at=time.time(),
            traceml_version="", torch_version="", python_version="",
            summary_window_rows=10000, mode="run", expected_world_size=num_ranks))
        proc = psutil.Process(collector.proc.pid)
        proc.cpu_percent(None)
        out: mp.Queue[tuple[int, int, int]] = mp.Queue()
        chunks = [range(i, num_ranks, senders) for i in range(senders)]
        workers = [mp.Process(target=simulate, args=(
            f"tcp://127.0.0.1:{collector.port}", secret, c, num_ranks, steps_per_s, duration_s, out))
            for c in chunks]
        start = time.monotonic()
        for w in workers:
            w.start()
        peak_rss = 0
        while any(w.is_alive() for w in workers):
            peak_rss = max(peak_rss, proc.memory_info().rss)
            time.sleep(0.5)
        results = [out.get() for _ in workers]
        cpu_pct = proc.cpu_percent(None)
        sent, dropped, rows_sent = (sum(x) for x in zip(*results))
        deadline = time.monotonic() + 60
        while count_steps(db_path) < rows_sent and time.monotonic() < deadline:
            time.sleep(0.2)
        ingest_s = time.monotonic() - start
        stored = count_steps(db_path)
        collector.record(RunEnd(ended_at=time.time(), exit_code=0))
        collector.stop()
        t0 = time.monotonic()
        write_summary(session_dir)
        summary_s = time.monotonic() - t0
    print(f"{num_ranks:5d} ranks  {sent / ingest_s:8.0f} msg/s  {stored / ingest_s:9.0f} rows/s  "
          f"stored {stored}/{rows_sent} rows  dropped {dropped}  collector CPU {cpu_pct:4.0f}%  "
          f"RSS {peak_rss / 2**20:5.0f} MiB  final summary {summary_s:5.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--senders", type=int, default=4)
    args = parser.parse_args()
    print(f"{args.steps_per_s:g} steps/s per rank for {args.duration:g} s, "
          f"{args.senders} sender processes, {os.cpu_count()} CPUs")
    for n in args.ranks:
        bench(n, args.steps_per_s, args.duration, args.senders)


if __name__ == "__main__":
    main()
