"""How many ranks node 0's collector can take.

Starts a real collector process and feeds it N simulated ranks at STEPS_PER_S
steps per second each for DURATION seconds, on a steady schedule: every
simulated sender sends its messages at its own offset in the flush interval
(an agent's events every 0.5 s and a process sample every second; a relay's
batch every `relay_interval_s` of the job's nodes), never a burst per tick.
Senders send with NOBLOCK under a bounded high-water mark and count their own
drops (zmq.Again); the envelopes carry the counts, so the collector's store
has them too, beside the sequence gaps it counts itself.

``--mode relay`` (the default): the N ranks are N/8 nodes of 8 ranks.  Node
0's 8 ranks send to the collector themselves; nodes 1..R run real relay
processes (`traceml.collector.relay`: the collector's intake and step tracker)
fed by simulated agents; the other nodes' relays are simulated: paced batches
built by the relay's own `Outbox` from step rows (no step tracker runs for
them), from a few processes.  ``--mode direct``: every rank sends its events
to the collector, which runs every step tracker.

Reported per size, over the real send window (first to last send): step rows
stored per second, drops counted by the senders and by the collector (gaps),
node 0's collector CPU % (its cpu_times over the window), its peak RSS, how
long after the last send the store held every row, and the wall time of
``traceml report`` on the store at the end.  ``--scrape on`` serves Prometheus's
``/metrics`` (``traceml run --metrics-port``) from the collector and scrapes it
once a second, as a Prometheus would (``both``: each size without, then with).
``--capture`` likewise for the profiler captures' planner (``traceml run``'s default
``--capture auto``: it builds the live report every 3 s at most, 5 % of its time at most):
``auto`` (the default), ``off``, or ``both``.  The simulated ranks ask for no capture.

A simulating process that fails ends the benchmark with exit 1 and its error;
so does the whole run lasting past ``--time-limit``.

    python scripts/bench_collector_scale.py [--ranks 1024 4096 8192] [--mode relay]
        [--scrape off|on|both] [--capture auto|off|both] [--quick] [--time-limit S]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import psutil
import zmq
from bench_options import parse

from traceml import step_fields
from traceml.collector.config import CollectorConfig, relay_interval_s
from traceml.collector.relay import SEND_HWM as RELAY_SEND_HWM
from traceml.collector.relay import Outbox
from traceml.launcher.collector_process import CollectorProcess
from traceml.records import StepRow
from traceml.security import derive_keys, new_secret, relay_keys, secure_client
from traceml.sender import SEND_HWM
from traceml.store import SenderState, step_block
from traceml.wire import events as ev
from traceml.wire.envelope import Envelope, Message, encode
from traceml.wire.identity import Sender
from traceml.wire.records import Bye, RunEnd, RunStart
from traceml.wire.relay import RelayBatch
from traceml.wire.rows import PROCESS_FIELDS, SYSTEM_FIELDS, ProcessRows, SystemRows

SESSION = "scale"
FLUSH_S = 0.5  # as an agent ships its events; the pacing tick (a relay sends every few)
SAMPLE_S = 1.0  # process and system samples
SLOTS = 50  # sends are spread over this many slots per flush interval
RANKS_PER_NODE = 8
START_DELAY_S = 3.0  # senders connect, then all start at one time


@dataclass
class Tally:
    """What one sender process sent: message and row counts, its window."""

    sent: int = 0
    dropped: int = 0
    rows: int = 0
    first: float = float("inf")
    last: float = 0.0

    def add(self, other: Tally) -> None:
        self.sent += other.sent
        self.dropped += other.dropped
        self.rows += other.rows
        self.first = min(self.first, other.first)
        self.last = max(self.last, other.last)


@dataclass
class Paced:
    """One simulated sender: its offset in the flush interval and what it sends per tick
    (``messages(tick, last)`` -> [(encoded message, step rows in it)])."""

    offset_s: float
    messages: Callable[[int, bool], list[tuple[bytes, int]]]
    rows_kind: str = "rank"  # or "relay"
    sock: Any = None  # its own socket, as every rank and relay has
    seq: int = 0
    num_sent: int = 0
    num_dropped: int = 0


def run_paced(senders: list[Paced], start_at: float, duration_s: float) -> Tally:
    """Send every sender's messages at its offset, tick after tick, without blocking."""
    slots: list[list[Paced]] = [[] for _ in range(SLOTS)]
    for s in senders:
        slots[int(s.offset_s / FLUSH_S * SLOTS) % SLOTS].append(s)
    tally = Tally()
    num_ticks = max(1, round(duration_s / FLUSH_S))
    for tick in range(num_ticks):
        for slot, group in enumerate(slots):
            wait = start_at + (tick + slot / SLOTS) * FLUSH_S - time.time()
            if wait > 0:
                time.sleep(wait)
            for s in group:
                for data, rows in s.messages(tick, tick == num_ticks - 1):
                    try:
                        s.sock.send(data, zmq.NOBLOCK)
                    except zmq.Again:
                        s.num_dropped += 1
                        tally.dropped += 1
                        continue
                    s.num_sent += 1
                    tally.sent += 1
                    tally.rows += rows
                    now = time.time()
                    tally.first, tally.last = min(tally.first, now), now
    return tally


def envelope(p: Paced, message: Message, who: Sender) -> bytes:
    data = encode(Envelope(SESSION, who, p.seq, time.time(), message,
                                    num_sent=p.num_sent, num_dropped=p.num_dropped))
    p.seq += 1
    return data


def log_iteration(times: list[list[float]], t: float) -> None:
    """One training iteration's events as a rank logs them: fetch, forward,
    loss, backward, optimizer."""
    for code, at in ((ev.INPUT, t), (ev.END, t + 0.001),
                     (ev.FORWARD, t + 0.001), (ev.END, t + 0.02),
                     (ev.FORWARD, t + 0.02), (ev.END_UNCOUNTED, t + 0.021),
                     (ev.BACKWARD, t + 0.021), (ev.END, t + 0.06),
                     (ev.OPTIMIZER, t + 0.06), (ev.OPTIMIZER_END, t + 0.07)):
        times[code].append(at)


def rank_sender(r: int, world: int, host: str, steps_per_s: float) -> Paced:
    """A simulated agent: its events every flush, a process sample every second."""
    who = Sender("rank", host, 10_000 + r, r // RANKS_PER_NODE, rank=r,
                 local_rank=r % RANKS_PER_NODE, world_size=world)
    per_flush = max(1, round(steps_per_s * FLUSH_S))
    wall = time.time()

    def messages(tick: int, last: bool) -> list[tuple[bytes, int]]:
        times: list[list[float]] = [[] for _ in range(ev.NUM_EVENT_CODES)]
        for i in range(per_flush):
            log_iteration(times, (tick * per_flush + i) / steps_per_s)
        if last:
            times[ev.CLOSE].append(times[ev.OPTIMIZER_END][-1])
        out = [(envelope(p, ev.EventBatch(tick, wall, times, [], [(times[ev.INPUT][0], 300 << 20)]),
                         who), per_flush)]
        if tick % 2 == 0:
            out.append((envelope(p, ProcessRows(PROCESS_FIELDS, [
                (time.time(), 95.0, 300 << 20, 64 << 30, 2, None, None, None)]), who), 0))
        if last:
            out.append((envelope(p, Bye(time.time()), who), 0))
        return out

    p = Paced((r * 0.618034 % 1.0) * FLUSH_S, messages)
    return p


def step_record(who: Sender, step: int, t_begin: float) -> StepRow:
    """A step as a relay's tracker emits it (the times of `log_iteration`'s loop)."""
    phase_ms = {"input": 1.0, "forward": 20.0, "backward": 39.0, "optimizer": 10.0}
    placed, at = {}, 0.0  # where each phase ran, as the tracker keeps it (to the µs)
    for name, ms in phase_ms.items():
        placed |= {f"{name}_at_ms": round(at + 0.0123, 3), f"{name}_end_ms": round(at + ms, 3)}
        at += ms + 0.25
    return StepRow.of(rank=who.rank, node_rank=who.node_rank, step=step, t_begin=t_begin,
                      total_ms=100.0, wait_ms=30.0,
                      **{f"{name}_ms": ms for name, ms in phase_ms.items()},
                      **{f"num_{name}": 1 for name in phase_ms}, **placed,
                      rss_bytes=300 << 20, boundary="optimizer")


@dataclass
class Unsent:
    """The upstream of a simulated relay's `Outbox`: its identity (the node is known,
    so nothing is learned from the ranks), and nothing is ever sent through it."""

    identity: Sender


def relay_sender(node: int, world: int, steps_per_s: float) -> Paced:
    """A simulated node's relay: one batch per `relay_interval_s` of its ranks' step
    rows and samples.  The batches are built by the relay's own `Outbox` (once per
    kind of batch, from step records as a tracker emits them); each batch only
    renumbers the steps and their times, so simulating a node costs little more
    than encoding."""
    host = f"sim-node{node}"
    relay = Sender("relay", host, 50_000 + node, node)
    ranks = [Sender("rank", host, 10_000 + r, node, rank=r, local_rank=r % RANKS_PER_NODE,
                    world_size=world)
             for r in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)]
    system = Sender("system", host, 40_000 + node, node)
    start = time.time()
    per_flush = max(1, round(steps_per_s * FLUSH_S))
    interval_s = relay_interval_s(max(1, world // RANKS_PER_NODE))
    every = max(1, round(interval_s / FLUSH_S))  # ticks per batch
    sampled_every = max(1, round(SAMPLE_S / interval_s))  # batches per process sample

    def template(num_ticks: int, with_samples: bool, last: bool) -> RelayBatch:
        outbox = Outbox(Unsent(relay))  # type: ignore[arg-type]  # only take() is used
        for who in ranks:
            outbox.add_steps([step_record(who, i, start) for i in range(per_flush * num_ticks)])
            if with_samples:  # a sample a second
                outbox.add_process(who, ProcessRows(PROCESS_FIELDS, [
                    [start + i, 95.0, 300 << 20, 64 << 30, 2, None, None, None]
                    for i in range(max(1, round(num_ticks * FLUSH_S / SAMPLE_S)))]))
            outbox.save_sender(SenderState(who, start, start, said_bye=last))
        if with_samples:
            outbox.add_system(system, SystemRows(SYSTEM_FIELDS, [[start, 50.0, 40.0, 64 << 30, []]]))
        outbox.save_sender(SenderState(system, start, start, said_bye=last))
        batch = outbox.take()
        assert batch is not None
        return batch

    # The regular batches' templates now; a last, shorter batch's when it is sent.
    templates = {(every, w, False): template(every, w, False) for w in (True, False)}
    measured = [f.name for f in step_fields.measured()]
    step_col, t_col = (measured.index(c) for c in ("step", "t_begin"))
    done = [0]  # ticks whose steps were sent

    def messages(tick: int, last: bool) -> list[tuple[bytes, int]]:
        if (tick + 1) % every and not last:
            return []
        n = tick + 1 - done[0]
        key = (n, tick // every % sampled_every == 0, last)
        if key not in templates:
            templates[key] = template(*key)
        batch = templates[key]
        first = done[0] * per_flush
        done[0] = tick + 1
        blocks = []  # each rank's block, renumbered, as the relay makes it (`step_block`)
        for template_block in batch.step_blocks:
            rows = orjson.loads(template_block[-1])
            for i, row in enumerate(rows):
                row[step_col], row[t_col] = first + i, start + (first + i) / steps_per_s
            block = step_block(rows)
            assert block is not None
            blocks.append([template_block[0], *block[:-1], block[-1].decode()])
        first_sample = time.time() - SAMPLE_S * max(1, round(interval_s / SAMPLE_S))
        process = [(i, replace(rows, rows=[[first_sample + k * SAMPLE_S, *r[1:]]
                                           for k, r in enumerate(rows.rows)]))
                   for i, rows in batch.process]
        message = replace(batch, step_blocks=blocks, process=process)
        out = [(envelope(p, message, relay), per_flush * n * len(ranks))]
        if last:
            out.append((envelope(p, Bye(time.time()), relay), 0))
        return out

    p = Paced((node * 0.618034 % 1.0) * FLUSH_S, messages, rows_kind="relay")
    return p


def simulate(endpoint: str, keys: Any, make: list[tuple[str, tuple[Any, ...]]],
             start_at: float, duration_s: float, out: mp.Queue[Tally | str]) -> None:
    """One sender process: several simulated senders, each with its own socket, paced."""
    try:
        context = zmq.Context()
        makers: dict[str, Callable[..., Paced]] = {"rank": rank_sender, "relay": relay_sender}
        senders = [makers[kind](*args) for kind, args in make]
        if time.time() > start_at:
            raise RuntimeError(f"simulated senders ready {time.time() - start_at:.1f} s after "
                               "the start: the run would measure them starting late")
        for s in senders:
            s.sock = context.socket(zmq.PUSH)
            s.sock.setsockopt(zmq.SNDHWM, SEND_HWM if s.rows_kind == "rank" else RELAY_SEND_HWM)
            s.sock.setsockopt(zmq.LINGER, 5000)
            secure_client(s.sock, keys)
            s.sock.connect(endpoint)
        tally = run_paced(senders, start_at, duration_s)
        for s in senders:
            s.sock.close()
        context.term()
    except BaseException:
        out.put(traceback.format_exc())  # the parent ends the benchmark with it
        raise
    out.put(tally)


def gather(workers: list[mp.Process], out: mp.Queue[Tally | str], deadline: float) -> Tally:
    """Every sender process's tally.  One that failed ends the benchmark with its
    error (or its exit code, when it died without a word), as does ``deadline``."""
    tally, num_done = Tally(), 0
    while num_done < len(workers):
        try:
            got = out.get(timeout=0.5)
        except queue.Empty:
            dead = [w for w in workers if w.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"a simulating process died (exit {dead[0].exitcode})") from None
            if time.time() > deadline:
                raise SystemExit(f"{len(workers) - num_done} simulating processes never "
                                 "reported") from None
            continue
        if isinstance(got, str):
            raise SystemExit(f"a simulating process failed:\n{got}")
        tally.add(got)
        num_done += 1
    return tally


@dataclass
class Plan:
    """Who sends where: (endpoint, keys, simulated senders) per sender process."""

    processes: list[tuple[str, Any, list[tuple[str, tuple[Any, ...]]]]] = field(
        default_factory=list)
    relays: list[CollectorProcess] = field(default_factory=list)
    note: str = ""


def plan_direct(n: int, port: int, secret: str, steps: float, senders: int) -> Plan:
    keys = derive_keys(secret, SESSION)
    host = socket.gethostname()
    plan = Plan(note=f"direct: {n} ranks send to the collector, which runs every step tracker")
    for i in range(senders):
        plan.processes.append((f"tcp://127.0.0.1:{port}", keys, [
            ("rank", (r, n, host, steps)) for r in range(i, n, senders)]))
    return plan


def plan_relay(n: int, port: int, secret: str, steps: float, senders: int,
               num_relays: int) -> Plan:
    keys = derive_keys(secret, SESSION)
    host = socket.gethostname()
    nodes = max(1, n // RANKS_PER_NODE)
    node0 = f"tcp://127.0.0.1:{port}"
    real = min(num_relays, nodes - 1)
    plan = Plan(note=(
        f"relay: {nodes} nodes of {RANKS_PER_NODE} ranks; node 0's ranks send to the "
        f"collector; nodes 1-{real} run real relay processes (step trackers) fed by "
        f"simulated agents; the other {nodes - 1 - real} nodes' relays are simulated "
        f"(paced batches of step blocks built by the relay's Outbox, renumbered each "
        f"tick, no step tracker), "
        f"from {senders} processes"))
    agents: list[tuple[str, Any, list[tuple[str, tuple[Any, ...]]]]] = [(node0, keys, [
        ("rank", (r, n, host, steps)) for r in range(RANKS_PER_NODE)])]
    for node in range(1, 1 + real):
        relay = CollectorProcess(CollectorConfig(
            session_id=SESSION, bind_host="127.0.0.1", port=0, db_path="",
            parent_pid=os.getpid(), secret=secret, upstream=node0, node_rank=node,
            relay_interval_s=relay_interval_s(nodes)))
        plan.relays.append(relay)
        agents.append((f"tcp://127.0.0.1:{relay.port}", keys, [
            ("rank", (r, n, host, steps))
            for r in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)]))
    plan.processes += agents
    simulated = list(range(1 + real, nodes))
    relay_key = relay_keys(keys, secret, SESSION)
    for i in range(senders):
        part = simulated[i::senders]
        if part:
            plan.processes.append((node0, relay_key, [("relay", (node, n, steps))
                                                      for node in part]))
    return plan


def store_counts(db_path: Path) -> tuple[int, int, int, dict[str, int]] | None:
    """Step rows stored, sequence gaps, drops the senders reported (in-band) and what
    the collector rejected, by reason; None while the store cannot be read."""
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        try:
            (steps,) = db.execute("SELECT COALESCE(SUM(num_rows), 0) FROM step_blocks").fetchone()
            gaps, dropped = db.execute(
                "SELECT COALESCE(SUM(num_gaps), 0), COALESCE(SUM(num_dropped), 0) "
                "FROM senders").fetchone()
            rejected = dict(db.execute("SELECT reason, count FROM rejected").fetchall())
            return int(steps), int(gaps), int(dropped), rejected
        finally:
            db.close()
    except sqlite3.Error:
        return None


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Scraper(threading.Thread):
    """A Prometheus stand-in: GETs /metrics once a second, timing each answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.done = threading.Event()
        self.seconds: list[float] = []
        self.size = 0
        self.failed = 0
        self.start()

    def run(self) -> None:
        while not self.done.wait(1.0):
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=10) as response:
                    self.size = len(response.read())
                self.seconds.append(time.monotonic() - t0)
            except OSError:
                self.failed += 1

    def stop(self) -> str:
        self.done.set()
        self.join(15)
        if not self.seconds:
            return f"/metrics scraped 1/s: no answer ({self.failed} failed)"
        return (f"/metrics scraped 1/s: {len(self.seconds)} answers, {self.failed} failed, "
                f"median {statistics.median(self.seconds) * 1e3:.0f} ms, "
                f"slowest {max(self.seconds) * 1e3:.0f} ms, {self.size / 1024:.0f} KiB")


def bench(n: int, args: argparse.Namespace, scrape: bool = False, capture: str = "auto") -> str:
    with tempfile.TemporaryDirectory() as tmp:
        session_dir = Path(tmp) / SESSION
        session_dir.mkdir()
        db_path = session_dir / "telemetry.sqlite"
        secret = new_secret()
        collector = CollectorProcess(CollectorConfig(
            session_id=SESSION, bind_host="127.0.0.1", port=0, db_path=str(db_path),
            parent_pid=os.getpid(), secret=secret, metrics_port=free_port() if scrape else None,
            capture=capture))
        scraper = Scraper(collector.ready["metrics"]["url"]) if scrape else None
        collector.record(RunStart(
            session_id=SESSION, command=("bench",), started_at=time.time(),
            traceml_version="", torch_version="", python_version="",
            summary_window_rows=10000, mode="run", expected_world_size=n,
            expected_nodes=max(1, n // RANKS_PER_NODE)))
        if args.mode == "relay":
            plan = plan_relay(n, collector.port, secret, args.steps_per_s, args.senders,
                              args.real_relays)
        else:
            plan = plan_direct(n, collector.port, secret, args.steps_per_s, args.senders)
        proc = psutil.Process(collector.proc.pid)
        out: mp.Queue[Tally | str] = mp.Queue()
        # time to build every simulated sender (about 6 ms a relay here) before the start
        start_at = time.time() + START_DELAY_S + 0.1 * len(plan.processes) + 0.6e-3 * n
        # daemons: a benchmark that stops early (an error, --time-limit) leaves none behind
        workers = [mp.Process(target=simulate, args=(endpoint, keys, make, start_at,
                                                     args.duration, out), daemon=True)
                   for endpoint, keys, make in plan.processes]
        try:
            for w in workers:
                w.start()
            time.sleep(max(0.0, start_at - time.time()))
            cpu0, wall0 = cpu_s(proc), time.time()
            peak_rss = 0
            while time.time() < start_at + args.duration:
                peak_rss = max(peak_rss, proc.memory_info().rss)
                time.sleep(0.5)
            cpu1, wall1 = cpu_s(proc), time.time()
            scraped = scraper.stop() if scraper is not None else ""
            tally = gather(workers, out, deadline=time.time() + 60.0)
            for w in workers:
                w.join()
        finally:
            for w in workers:
                if w.is_alive():
                    w.kill()
            for relay in plan.relays:
                relay.stop()
        caught_up = wait_stored(db_path, tally.rows, tally.last)
        peak_rss = max(peak_rss, proc.memory_info().rss)
        collector.record(RunEnd(ended_at=time.time(), exit_code=0))
        collector.stop()
        stored, gaps, reported, rejected = store_counts(db_path) or (0, 0, 0, {})
        t0 = time.monotonic()
        report = subprocess.run([sys.executable, "-m", "traceml", "report", str(session_dir)],
                                capture_output=True, text=True)
        summary_s = time.monotonic() - t0
        if args.keep_store:  # for profiling the summary on it
            shutil.copytree(session_dir, Path(args.keep_store) / f"{n}ranks", dirs_exist_ok=True)
    window = tally.last - tally.first
    cpu_pct = 100.0 * (cpu1 - cpu0) / (wall1 - wall0)
    failed = "" if report.returncode == 0 else f"  (report exit {report.returncode})"
    return (f"{n:5d} ranks  {stored / window:7.0f} steps/s stored  {tally.sent / window:6.0f} msg/s  "
            f"stored {stored}/{tally.rows}  dropped: senders {tally.dropped}, collector "
            f"{gaps} gaps  node 0 collector CPU {cpu_pct:3.0f}%  RSS {peak_rss / 2**20:4.0f} MiB  "
            f"all stored {caught_up:4.1f} s after the last send  final summary "
            f"{summary_s:5.1f} s{failed}\n       {plan.note}"
            + (f"; {reported} drops reported in-band" if reported else "")
            + (f"\n       {scraped}" if scrape else "")
            + f"\n       captures {capture}"
            + (f"\n       rejected by node 0: {rejected}" if rejected else ""))


def wait_stored(db_path: Path, rows: int, last_send: float) -> float:
    """Wait until the store holds every row sent, or stops growing; returns how long
    after the last send that was."""
    stored, since, grew = 0, time.monotonic(), time.monotonic()
    while time.monotonic() - grew < 10.0 and time.monotonic() - since < 120.0:
        counts = store_counts(db_path)
        if counts is not None and counts[0] != stored:
            stored, grew = counts[0], time.monotonic()
        if stored >= rows:
            break
        time.sleep(0.1)
    return time.time() - last_send


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--mode", choices=("relay", "direct"), default="relay")
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--senders", type=int, default=3, help="simulating processes")
    parser.add_argument("--keep-store", metavar="DIR",
                        help="copy each size's session folder (its store) to DIR/<N>ranks")
    parser.add_argument("--real-relays", type=int, default=2,
                        help="relay processes that run (relay mode)")
    parser.add_argument("--scrape", choices=("off", "on", "both"), default="off",
                        help="serve Prometheus /metrics and scrape it once a second (both: "
                             "each size without, then with)")
    parser.add_argument("--capture", choices=("auto", "off", "both"), default="auto",
                        help="the profiler captures' planner (both: each size without, then "
                             "with)")
    args = parse(parser, quick={"ranks": [64], "duration": 3.0, "senders": 1, "real_relays": 1},
                 limit_s=3600.0)
    print(f"{args.steps_per_s:g} steps/s per rank for {args.duration:g} s, mode {args.mode}, "
          f"{os.cpu_count()} CPUs", flush=True)
    scrapes = {"off": (False,), "on": (True,), "both": (False, True)}[args.scrape]
    captures = ("off", "auto") if args.capture == "both" else (args.capture,)
    for n in args.ranks:
        for scrape in scrapes:
            for capture in captures:
                print(bench(n, args, scrape, capture), flush=True)


if __name__ == "__main__":
    main()
