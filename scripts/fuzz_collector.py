"""Fuzz a live collector during a real 2-rank run.

``python scripts/fuzz_collector.py [-n 10000] [--seed 1]`` starts ``traceml run
--nproc-per-node 2`` on a tiny gloo DDP loop (with a ``TRACEML_SECRET``, so
this script can speak CURVE as an authenticated sender), waits until both
ranks have stored steps, then sends N mutated copies of genuine messages
(every kind the agent, the system sampler and the launcher send): a value of
another type, a field dropped, a huge or negative number, NaN or infinity,
deep nesting, an oversized message.  It is an insider: it holds the token of
rank 1 in a second attempt (restart 1), as a rank of the job would hold its own,
so whatever it sends as that identity passes the token check and goes through
the payload checks, the step tracker and the store.  It also tries what an insider
must not do: speak as another identity with its token (the real rank 0 with its
host and pid, the real rank 1, rank 7, node 0's sampler), and flood the collector
with large valid messages past its byte budget.  Then it ends the training and
checks that the launcher exits 0, that the summary was written and matches its
schema, that every impersonation was refused, that the flood was cut and counted,
and that the real ranks' step counts (their first attempt's) are exactly what the
ranks counted themselves.

Prints the figures the README quotes: messages sent, rejected by reason,
accepted, the real ranks' steps (stored vs counted), and the collector's
peak memory.  Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
import zmq
from bench_options import parse

from traceml.security import TokenBook, derive_keys, secure_client
from traceml.wire import events as ev
from traceml.wire.envelope import KINDS, Envelope, encode, encode_payload
from traceml.wire.identity import Sender
from traceml.wire.records import CONTROL_KIND, Hello, RunEnd, RunStart, StopCollector
from traceml.wire.rows import PROCESS_FIELDS, SYSTEM_FIELDS, ProcessRows, SystemRows

SESSION = "fuzz"
SECRET = "fuzz secret"
TARGET = '''
import os, sys, torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 16)
steps = 0
stop = torch.zeros(1)
while not stop.item():
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    steps += 1
    stop[0] = float(rank == 0 and os.path.exists(sys.argv[1]))
    dist.all_reduce(stop)
with open(os.path.join(os.path.dirname(sys.argv[1]), f"steps{rank}"), "w") as f:
    f.write(str(steps))
dist.destroy_process_group()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- genuine messages --------------------------------------------------------------------


def events(batch: int, t0: float) -> dict[str, Any]:
    """Three training iterations with an RSS reading and a collective, as a rank logs them."""
    times: list[list[float]] = [[] for _ in range(ev.NUM_EVENT_CODES)]
    spans = []
    for i in range(3):
        t = t0 + 0.01 * i
        for code, start, end in ((ev.INPUT, 0.0, 0.001), (ev.FORWARD, 0.001, 0.003),
                                 (ev.BACKWARD, 0.003, 0.007)):
            times[code].append(t + start)
            times[ev.END].append(t + end)
        times[ev.OPTIMIZER].append(t + 0.007)
        times[ev.OPTIMIZER_END].append(t + 0.008)
        spans.append((t + 0.004, t + 0.006))
    return ev.EventBatch(batch, time.time() - t0, times, [], [(t0, 300 << 20)], spans).payload()


def genuine(kind: str, batch: int) -> dict[str, Any]:
    now = time.time()
    if kind == ev.EventBatch.KIND:
        return events(batch, 1000.0 + batch)
    if kind == ProcessRows.KIND:
        return ProcessRows(PROCESS_FIELDS,
                           [(now, 95.0, 300 << 20, 64 << 30, 2, None, None, None)]).payload()
    if kind == SystemRows.KIND:
        return SystemRows(SYSTEM_FIELDS, [
            (now, 40.0, 30.0, 64 << 30, [[0, 90.0, 10 << 30, 80 << 30, 60, 300.0]])]).payload()
    if kind == CONTROL_KIND:
        return random.choice([
            RunStart(SESSION, ("train.py",), now, "x", "x", "x", 0, "run", 64),
            RunEnd(now, 1), StopCollector()]).payload()
    return {"t": now, "num_batches": batch}


# -- mutations ---------------------------------------------------------------------------

# Mutations and their weights: an oversized message costs the most to build and send.
MUTATIONS = {"type": 3.0, "drop": 2.0, "huge": 2.0, "nan": 1.0, "deep": 1.0, "oversized": 0.1,
             "valid": 1.0, "impersonate": 1.0}
ODD_VALUES: list[Any] = ["abc", "", None, True, [], {}, [[1, 2]], {"a": 1}, 0, 1.5, "\x1b[2J"]
HUGE: list[Any] = [10**30, -(10**30), 2**63, 2**64, -1, 1e308, -1e308, 1e-308, 10**12]


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``obj`` (keys and indexes), lists sampled."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, prefix + (k,))
    elif isinstance(obj, list) and obj:
        for i in random.sample(range(len(obj)), min(3, len(obj))):
            out += paths(obj[i], prefix + (i,))
    return out


def get_parent(obj: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
    for key in path[:-1]:
        obj = obj[key]
    return obj, path[-1]


def mutate(env: dict[str, Any]) -> tuple[str, bytes]:
    """One mutated copy of ``env``: (the mutation's name, the bytes to send)."""
    env = copy.deepcopy(env)
    kind = random.choices(list(MUTATIONS), weights=list(MUTATIONS.values()))[0]
    if kind == "impersonate" and env["kind"] in DECODABLE:  # another identity: refused
        env["from"] = list(random.choice(OTHERS).values())
        return kind, dumps(env)
    if kind == "impersonate":
        kind = "type"
    targets = [p for p in paths(env) if p and p[0] != "tok"]
    path = random.choice(targets)
    if path[0] != "p":
        # An envelope mutation speaks as a sender of its own: a huge sequence number
        # that passes leaves the next messages of rank 7 unharmed.
        env["from"][2] = random.randint(10**6, 2**31)
    parent, key = get_parent(env, path)
    if kind == "type":
        parent[key] = random.choice(ODD_VALUES)
    elif kind == "drop":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif kind == "huge":
        parent[key] = random.choice(HUGE)
    elif kind == "nan":
        parent[key] = random.choice([float("nan"), float("inf"), float("-inf")])
    elif kind == "deep":  # nested lists in place of the value, as text
        depth = random.choice([50, 500, 5000])
        parent[key] = "__deep__"
        return kind, dumps(env).replace(b'"__deep__"', b"[" * depth + b"]" * depth, 1)
    elif kind == "oversized":
        size = random.choice([1 << 20, 7 << 20, 9 << 20])
        parent[key] = [random.random() for _ in range(size // 20)]
    return kind, dumps(env)


def dumps(env: dict[str, Any]) -> bytes:
    """As the agent encodes (compact, keys in order), but with what orjson refuses:
    integers beyond 64 bits, NaN and infinities."""
    return json.dumps(env, allow_nan=True, separators=(",", ":")).encode()


# -- the run -----------------------------------------------------------------------------


def collector_process(launcher: psutil.Process) -> psutil.Process | None:
    for child in launcher.children(recursive=True):
        try:
            if "traceml.collector" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def stored_steps(db: Path, restart: int = 0) -> dict[int, int]:
    """Stored steps per rank of one attempt (0: the real ranks'; 1: the insider's)."""
    from traceml.store import StoreError, StoreReader

    try:
        with StoreReader(db, timeout_s=1.0) as reader:
            return dict(collections_count(r.rank for r in reader.steps_after(0, 10**9).rows
                                          if r.restart == restart))
    except StoreError:
        return {}


def real_ranks(db: Path) -> list[Sender]:
    """The run's own ranks, as they said hello."""
    from traceml.store import StoreReader

    with StoreReader(db, timeout_s=1.0) as reader:
        return [s.sender for s in reader.senders("rank")]


def collections_count(items: Any) -> dict[int, int]:
    counts: dict[int, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


HOST = socket.gethostname()
INSIDER = Sender("rank", HOST, os.getpid(), 0, rank=1, local_rank=1, world_size=2, restart=1)
INSIDER_TOKEN = TokenBook(SECRET, SESSION).rank(1, 1)  # what rank 1's second attempt holds
OTHERS: list[Sender] = [Sender("rank", HOST, os.getpid(), 0, rank=7, local_rank=7, world_size=8),
                        Sender("system", HOST, os.getpid(), 0)]  # ...and the real ranks, below
FLOOD_MESSAGES = 40  # large valid messages back to back: past the sender's byte budget
DECODABLE = frozenset({"events", "process", "system", "hello", "bye"})  # genuine() is valid


def fuzz(n: int, endpoint: str, collector: psutil.Process | None) -> tuple[dict[str, int], int]:
    """Send ``n`` mutated messages, then a flood; returns them by mutation and the
    collector's peak RSS."""
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.LINGER, 5000)
    secure_client(sock, derive_keys(SECRET, SESSION))
    sock.connect(endpoint)
    by_mutation: dict[str, int] = {}
    peak: list[int] = [0]
    for i in range(n):
        kind = random.choice(sorted(KINDS))
        env = orjson.loads(encode_payload(Envelope(SESSION, INSIDER, i, time.time(), Hello(),
                                                   token=INSIDER_TOKEN), kind, genuine(kind, i)))
        name, data = mutate(env)
        by_mutation[name] = by_mutation.get(name, 0) + 1
        _send(sock, data, collector, i, peak)
    times: list[list[float]] = [[] for _ in range(ev.NUM_EVENT_CODES)]
    times[ev.END] = [1000.0 + 1e-6 * k for k in range(ev.MAX_EVENTS_ACCEPTED)]  # ~4 MB
    for i in range(FLOOD_MESSAGES):
        batch = ev.EventBatch(10**6 + i, time.time() - time.perf_counter(), times)
        _send(sock, encode(Envelope(SESSION, INSIDER, n + i, time.time(), batch,
                                    token=INSIDER_TOKEN)), collector, i, peak)
    by_mutation["flood"] = FLOOD_MESSAGES
    sock.close()
    context.term()
    return by_mutation, peak[0]


def _send(sock: Any, data: bytes, collector: psutil.Process | None, i: int,
          peak: list[int]) -> None:
    while True:
        try:
            sock.send(data, zmq.NOBLOCK)
            break
        except zmq.Again:
            time.sleep(0.01)  # the collector is busy: wait, so every message is sent
    if collector is not None and i % 200 == 0:
        try:
            peak[0] = max(peak[0], collector.memory_info().rss)
        except psutil.Error:
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=10_000, help="mutated messages to send")
    parser.add_argument("--seed", type=int, default=1)
    args = parse(parser, quick={"n": 300}, limit_s=1800.0)
    random.seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "train.py").write_text(TARGET)
        marker = tmp_path / "stop"
        port = free_port()
        env = dict(os.environ, TRACEML_SECRET=SECRET, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "traceml", "run", "--nproc-per-node", "2", "--logs-dir",
             str(tmp_path / "logs"), "--session-id", SESSION, "--aggregator-port", str(port),
             str(tmp_path / "train.py"), str(marker)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        try:
            return _fuzz_run(args.n, proc, port, tmp_path, marker)
        finally:  # never leave the run's ranks behind (a timeout, a Ctrl-C of this script)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _fuzz_run(n: int, proc: subprocess.Popen[str], port: int, tmp_path: Path,
              marker: Path) -> int:
    db = tmp_path / "logs" / SESSION / "telemetry.sqlite"
    deadline = time.monotonic() + 120
    while set(stored_steps(db)) != {0, 1}:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            print("the run never stored steps of both ranks", proc.communicate()[1][-3000:])
            return 1
        time.sleep(0.2)
    collector = collector_process(psutil.Process(proc.pid))
    OTHERS.extend(real_ranks(db))  # their host and pid copied: the token still gives it away
    started = time.monotonic()
    by_mutation, peak_rss = fuzz(n, f"tcp://127.0.0.1:{port}", collector)
    sent_s = time.monotonic() - started
    time.sleep(1.0)  # let the collector drain what is queued before the run ends
    marker.write_text("")
    out, err = proc.communicate(timeout=300)
    return report(n, sent_s, by_mutation, peak_rss, proc.returncode, tmp_path, err)


OVER_RATE = "over its sender's byte rate"


def _impostors(db: Path) -> list[str]:
    """Senders stored with this process's pid but not the insider's own identity."""
    from traceml.store import StoreReader

    with StoreReader(db, timeout_s=1.0) as reader:
        return [s.sender.sender_id for s in reader.senders()
                if s.sender.pid == INSIDER.pid and s.sender != INSIDER]


def report(n: int, sent_s: float, by_mutation: dict[str, int], peak_rss: int, status: int,
           tmp_path: Path, err: str) -> int:
    from traceml.report import validate_summary

    session_dir = tmp_path / "logs" / SESSION
    summary_path = session_dir / "final_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    problems = validate_summary(summary) if summary is not None else ["no summary"]
    counted = {r: int((tmp_path / f"steps{r}").read_text()) for r in (0, 1)
               if (tmp_path / f"steps{r}").exists()}
    stored = stored_steps(session_dir / "telemetry.sqlite")
    rejected = summary["meta"]["rejected"] if summary else {}
    print(f"sent {n} mutated messages in {sent_s:.1f} s "
          f"({', '.join(f'{k} {v}' for k, v in sorted(by_mutation.items()))})")
    print(f"rejected {sum(rejected.values())}:")
    for reason, count in sorted(rejected.items(), key=lambda kv: -kv[1]):
        print(f"  {count:6d}  {reason}")
    print(f"not rejected: {n + FLOOD_MESSAGES - sum(rejected.values())} (the insider's own "
          "samples and steps stored; 'duplicate step' counts steps, not messages)")
    print(f"collector peak RSS during the fuzzing: {peak_rss / 2**20:.0f} MiB")
    print(f"real ranks' steps: counted by the ranks {counted}, stored {{0: {stored.get(0)}, "
          f"1: {stored.get(1)}}}")
    impostors = _impostors(session_dir / "telemetry.sqlite")
    print(f"impersonations sent {by_mutation.get('impersonate', 0)}, refused for their token "
          f"{rejected.get('sender without the token of its identity', 0)}; senders of this "
          f"process's other identities stored: {impostors}")
    print(f"flood of {FLOOD_MESSAGES} large valid messages: "
          f"{rejected.get(OVER_RATE, 0)} over the sender's byte rate, cut")
    checks = {
        "launcher exit status 0": status == 0,
        "summary written and schema-valid": not problems,
        "every impersonation refused": impostors == [] and rejected.get(
            "sender without the token of its identity", 0) >= by_mutation.get("impersonate", 0),
        "the flood cut and counted": rejected.get(OVER_RATE, 0) > 0,
        "the store never failed": "not stored: the store failed" not in rejected,
        "real ranks' step counts exact": counted and all(
            stored.get(r) == c for r, c in counted.items()) and len(counted) == 2,
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if not all(checks.values()):
        print(err[-3000:], problems[:5])
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
