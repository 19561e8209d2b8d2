"""Per-step overhead of traceml's agent, and start-up cost against torchrun.

Runs the same small CPU training loop with and without instrumentation,
alternating blocks in one process, with a live collector process receiving
the batched steps.  Two clocks: wall time, and the CPU time of the training
thread (steadier on a shared machine; the agent's cost is CPU work on that
thread, while the sender thread runs beside it).  Each figure is the fastest
of many alternating blocks.  Prints the added cost per step (µs) and the traced /
untraced ratio for a short (~1 ms) and a long (~20 ms) step, then times
``traceml run`` against ``torchrun`` on an empty script.

    python scripts/bench_overhead.py [--blocks 40] [--startup-runs 5] [--dashboard] [--quick]
                                     [--metrics] [--capture] [--split] [--ddp]
                                     [--device cuda [--cuda-timing both|sampled,off|...] [--long-ms 20]]

``--device cuda`` runs the loop on the GPU: the short step is launch-bound
(~1.4 ms on an H200 host), the long one is sized at start to take about
``--long-ms`` on the GPU (a deeper model until an untraced step takes that
long).  ``--cuda-timing both`` (the default) measures each step twice in one
run: ``every step`` (before: CUDA events on every step, two per phase, the
allocator read every step: `traceml.agent.cuda_timing.EVERY_STEP`) and
``sampled`` (after: the agent's default sampling), each paired against
untraced blocks with its own A/A line; ``off`` times no step after the first two
(the rest of the agent alone, so that ``sampled`` minus ``off`` is what the sampled
CUDA path adds); a comma list (``sampled,off``) runs those.

``--dashboard`` runs the collector as ``--mode=dashboard`` does, with a page
polling the live data once a second, to show the live view costs training
nothing; ``--metrics`` likewise with ``--metrics-port``'s endpoint scraped once
a second; ``--capture`` with profiler captures on (``--capture auto``: the collector's
planner builds the live report every 3 s or less often, the rank reads the control channel every
tick) and none run (the rank reads the planner's asks and acts on none: the
alternating blocks look like outlier steps), against the default's captures off.

``--split`` says where the per-step cost goes: each wrapped operation of the short
step (fetch, forward and loss, backward, optimizer step) timed alone, its patch group
on against off, on the training thread with a bare event log (no collector, no
sender thread), the fastest of alternating blocks; then the whole step.

``--ddp`` times communication timing instead: 2 gloo ranks (processes) train
a DDP model in alternating blocks with the agent's communication timing on and
off (the rest of the agent on in both): DDP's exposed wait and its in-flight
span (the hooks on its first bucket's parameters); prints its added time per
step and per gradient bucket, wall and CPU time of the training thread
(paired, with the run's A/A floor); then the in-flight hooks' cost alone, in
this process, without gloo's noise.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from bench_options import parse
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from traceml.agent.cuda_timing import EVERY_STEP, SamplingRule
from traceml.agent.patches import Instrumentation
from traceml.agent.runtime import AgentRuntime
from traceml.collector.config import CollectorConfig
from traceml.environment import AgentEnv
from traceml.launcher.collector_process import CollectorProcess
from traceml.report.page.render import SNAPSHOT_PATH
from traceml.security import TokenBook, client_keys_text, new_secret
from traceml.store import StoreReader
from traceml.wire.events import CLOSE
from traceml.wire.identity import Sender


def make_loop(width: int, depth: int, batch: int, steps: int,  # type: ignore[no-untyped-def]
              device: str = "cpu"):
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1)).to(device)
    on_cuda = device.startswith("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(steps * batch, width), torch.randn(steps * batch, 1))
    loader = DataLoader(data, batch_size=batch)
    loss_fn = nn.MSELoss()

    def run_block() -> tuple[float, float]:
        """Seconds per step: (wall clock, CPU time of the training thread)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        for x, y in loader:
            if on_cuda:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
        if on_cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - wall) / steps, (time.thread_time() - cpu) / steps

    return run_block


def measure(name: str, run_block, inst: Instrumentation, blocks: int) -> None:  # type: ignore[no-untyped-def]
    plain, traced = alternate(run_block, inst, blocks)
    report(name, plain, traced)


def alternate(run_block, inst: Instrumentation, blocks: int  # type: ignore[no-untyped-def]
              ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Untraced and traced blocks in ABBA order: (wall, cpu) seconds per step of each."""
    run_block()  # warm-up
    plain: list[tuple[float, float]] = []
    traced: list[tuple[float, float]] = []
    for i in range(blocks):
        # ABBA order, so that whatever favours the first or second block of a
        # pair (allocator state, frequency) does not land on one side.
        for traced_first in ((False, True) if i % 2 == 0 else (True, False)):
            # Installing or removing the patches changes torch classes, which
            # throws away CPython's specialised bytecode for their methods once;
            # a real run pays that at start, so an untimed block comes first.
            if traced_first:
                inst.install()
                try:
                    run_block()
                    traced.append(run_block())
                finally:
                    inst.uninstall()
            else:
                run_block()
                plain.append(run_block())
    return plain, traced


def report(name: str, plain: list[tuple[float, float]],
           traced: list[tuple[float, float]]) -> None:
    """The fastest blocks, the paired difference with its interval, and the A/A line."""
    # The fastest block of each kind is the one least disturbed by the rest of
    # the machine (as timeit reports); blocks alternate, so drift hits both.
    for i, clock in enumerate(("wall", "cpu")):
        p = min(x[i] for x in plain)
        t = min(x[i] for x in traced)
        print(f"{name:<11}{clock:>5}  untraced {p * 1e3:8.3f} ms/step  traced {t * 1e3:8.3f} "
              f"ms/step  added {(t - p) * 1e6:7.1f} µs/step  ratio {t / p:.4f}")
    # Paired: each traced block against the untraced block beside it, so a
    # slow phase of the machine hits both; the median difference, with a 95%
    # interval from order statistics (no distribution assumed).  The wall
    # clock first (the figure quoted), then the training thread's CPU time.
    for i, clock in enumerate(("", " cpu")):
        diffs = sorted(t[i] - p[i] for p, t in zip(plain, traced))
        ratios = sorted(t[i] / p[i] for p, t in zip(plain, traced))
        lo, mid, hi = median_interval(diffs)
        print(f"{name:<11}paired added{clock} {mid * 1e6:7.1f} µs/step, 95% interval "
              f"{lo * 1e6:.1f} to {hi * 1e6:.1f} (median of {len(diffs)} adjacent pairs)  ratio "
              f"{median_interval(ratios)[1]:.4f}")
    # An A/A check: the same comparison between two halves of the untraced
    # blocks, which differ by nothing.  Figures below it are noise.
    if len(plain) >= 4:
        halves = min(x[0] for x in plain[0::2]), min(x[0] for x in plain[1::2])
        print(f"{name:<11}  A/A  untraced vs untraced (alternate pairs): "
              f"{abs(halves[0] - halves[1]) * 1e6:6.1f} µs/step apart, the noise floor of this run")


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """Median of sorted ``values`` and its ~95% confidence interval (sign-test
    order statistics)."""
    n = len(values)
    k = max(0, int((n - 1.96 * n ** 0.5) / 2))
    return values[k], statistics.median(values), values[n - 1 - k]


CUDA_TIMINGS = {"every-step": ("every step", EVERY_STEP), "sampled": ("sampled", SamplingRule()),
                "off": ("none timed (the rest of the agent alone)",
                        SamplingRule(first_steps=0, budget_s=0.0, max_every=10**9))}
"""``--cuda-timing``: the old path (before), the agent's default (after), and no step
timed after the first two (what the CUDA path adds is the difference to ``off``)."""


def cuda_timings(text: str) -> list[str]:
    """``--cuda-timing``'s value: the CUDA timings to measure, in order."""
    names = ["every-step", "sampled"] if text == "both" else text.split(",")
    unknown = [n for n in names if n not in CUDA_TIMINGS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown timing {unknown[0]!r}: use {', '.join(CUDA_TIMINGS)}, a comma list, or both")
    return names


def cuda_loops(blocks: int, long_ms: float) -> list[tuple[str, Any, int]]:
    """The GPU loops: a launch-bound short step and a long step sized to ~``long_ms``."""
    short = make_loop(64, 2, 128, 200, "cuda")
    width, batch, depth = 4096, 256, 4
    long_step = make_loop(width, depth, batch, 15, "cuda")
    for _ in range(3):  # deeper until an untraced step takes about long_ms
        long_step()
        step_ms = long_step()[0] * 1e3
        if step_ms >= 0.8 * long_ms:
            break
        depth = max(depth + 1, round(depth * long_ms / step_ms))
        long_step = make_loop(width, depth, batch, 15, "cuda")
    long_step()
    print(f"long step: {depth} layers of {width} wide, batch {batch}: "
          f"{long_step()[0] * 1e3:.2f} ms untraced")
    return [("short step", short, blocks), ("long step", long_step, max(4, blocks // 4))]


def measure_cuda(runtime: AgentRuntime, inst: Instrumentation, timings: list[str],
                 blocks: int, long_ms: float) -> None:
    """Each GPU loop with each CUDA timing, paired against untraced blocks."""
    for name, loop, num_blocks in cuda_loops(blocks, long_ms):
        for timing in timings:
            label, rule = CUDA_TIMINGS[timing]
            runtime.device.use_sampling(rule)
            print(f"-- {name}, CUDA timing: {label}")
            measure(name, loop, inst, num_blocks)
            sampler = runtime.device.sampler
            cost, step = sampler.cost_s, sampler.step_s
            if cost is not None and step is not None:
                print(f"{name:<11}timed 1 step in {sampler.every} ({sampler.num_timed} timed); "
                      f"a timed step's CUDA work {cost * 1e6:.1f} µs on the training thread, "
                      f"step {step * 1e3:.3f} ms")


def startup(runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.py"
        empty.write_text("")
        commands = {
            "torchrun": [sys.executable, "-m", "torch.distributed.run", str(empty)],
            "traceml run": [sys.executable, "-m", "traceml", "run", "--logs-dir",
                            str(Path(tmp) / "logs"), str(empty)],
        }
        times: dict[str, list[float]] = {k: [] for k in commands}
        for _ in range(runs):
            for name, cmd in commands.items():
                start = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True, cwd=tmp)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["torchrun"])
    ours = statistics.median(times["traceml run"])
    print(f"start-up     torchrun {base:.2f} s   traceml run {ours:.2f} s   "
          f"added {ours - base:+.2f} s (median of {runs})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DashboardPoller(threading.Thread):
    """A browser stand-in: fetches the live data once a second (or a Prometheus
    stand-in: /metrics)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.done = threading.Event()
        self.answered = 0
        self.start()

    def run(self) -> None:
        while not self.done.wait(1.0):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    response.read()
                self.answered += 1
            except OSError:
                pass

    def stop(self) -> int:
        self.done.set()
        self.join(5)
        return self.answered


DDP_BUCKETS = 4


def ddp_rank(rank: int, port: int, blocks: int) -> None:
    """One of the 2 ranks of ``--ddp``; rank 0 prints."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from traceml.agent.probe import Probe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    probe = Probe(time.perf_counter, lambda exc: None)
    inst = Instrumentation(probe)
    inst.install()
    torch.manual_seed(0)
    width = 256
    net = nn.Sequential(*(nn.Linear(width, width) for _ in range(DDP_BUCKETS)))
    model = DDP(net, bucket_cap_mb=width * width * 4 / 2**20 * 1.01)  # a layer a bucket
    timing = probe.on_backward  # what DDP's construction armed
    x = torch.randn(32, width)

    def block(timed: bool, steps: int = 50) -> tuple[float, float]:
        probe.on_backward = timing if timed else None
        for first in inst.comm.first_buckets:  # in flight: hooks on the first bucket
            first.attach() if timed else first.detach()
        dist.barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            model(x).sum().backward()
        probe.streams = [[] for _ in probe.streams]  # nothing drains the log here
        probe.appenders = [st.append for st in probe.streams]
        return (time.perf_counter() - wall) / steps, (time.thread_time() - cpu) / steps

    for timed in (True, False, True, False):
        block(timed)  # warm-up: buckets rebuilt
    pairs = [(block(False), block(True)) if i % 2 == 0 else tuple(reversed((
        block(True), block(False)))) for i in range(blocks)]
    if rank == 0:
        _ddp_report(pairs)
    inst.uninstall()
    dist.destroy_process_group()


def _ddp_report(pairs: list[tuple[tuple[float, float], ...]]) -> None:
    for i, clock in enumerate(("wall", "cpu")):
        diffs = sorted(t[i] - p[i] for p, t in pairs)
        lo, mid, hi = median_interval(diffs)
        print(f"ddp comm   {clock:>5} paired added {mid * 1e6:7.1f} µs/step "
              f"({mid * 1e6 / DDP_BUCKETS:.1f} µs/bucket, {DDP_BUCKETS} buckets), 95% interval "
              f"{lo * 1e6:.1f} to {hi * 1e6:.1f}; untimed "
              f"{statistics.median(p[i] for p, _ in pairs) * 1e3:.3f} ms/step")
    plain = [p[1] for p, _ in pairs]
    aa = sorted(a - b for a, b in zip(plain[0::2], plain[1::2]))
    print(f"ddp comm     A/A  untimed vs untimed (alternate pairs): "
          f"{median_interval(aa)[1] * 1e6:6.1f} µs/step apart (cpu), the noise floor")


def ddp(blocks: int) -> None:
    import torch.multiprocessing as mp

    print(f"torch {torch.__version__}, 2 gloo ranks, 1 thread each: communication timing "
          "on against off, the rest of the agent on")
    mp.spawn(ddp_rank, args=(free_port(), blocks), nprocs=2, join=True)
    in_flight_hooks(blocks * 5)


def in_flight_hooks(blocks: int, steps: int = 200) -> None:
    """What DDP's in-flight span adds alone, without gloo's noise: the post-accumulate-
    grad hooks on a first bucket of 2 parameters (`traceml.agent.ddp_buckets`), on
    and off in alternating blocks of backwards of a small model in this process;
    the attributes the hooks read of a DDP model are stood in."""
    import weakref

    from traceml.agent.ddp_buckets import FirstBucket

    class StandIn:  # what the hooks read of a DDP model
        require_backward_grad_sync = True
        _comm_hooks: list[Any] = []

    torch.set_num_threads(1)
    net = nn.Linear(4, 4)
    stand_in = StandIn()
    first = FirstBucket(stand_in, list(net.parameters()), time.perf_counter)
    first._hooked = [weakref.ref(p) for p in net.parameters()]
    x = torch.randn(2, 4)

    def block(hooked: bool) -> float:
        first.attach() if hooked else first.detach()
        cpu = time.thread_time()
        for _ in range(steps):
            net(x).sum().backward()
        return (time.thread_time() - cpu) / steps

    for hooked in (True, False) * 5:  # warm-up
        block(hooked)
    diffs, plain = [], []
    for _ in range(blocks):
        before, hooked, after = block(False), block(True), block(False)
        diffs.append(hooked - (before + after) / 2)
        plain.append(before - after)
    lo, mid, hi = median_interval(sorted(diffs))
    print(f"ddp in flight  cpu added {mid * 1e6:6.2f} µs/backward (2 first-bucket hooks, none "
          f"per bucket), 95% interval {lo * 1e6:.2f} to {hi * 1e6:.2f}; A/A "
          f"{median_interval(sorted(plain))[1] * 1e6:.2f} µs; backward "
          f"{statistics.median(block(False) for _ in range(9)) * 1e6:.1f} µs")


def split(blocks: int, calls: int = 1000) -> None:
    """Where the agent's time per step goes: each wrapped operation of the short step
    (a DataLoader fetch, the model and loss forward, backward, the optimizer step) timed
    alone in a tight loop on one thread, with only its own patch group installed and
    without, in alternating blocks; the fastest block of each (as timeit reports).  The
    agent's event log is a bare probe (emptied between blocks): no collector, no sender
    thread.  The whole step with every patch comes last, to set the sum against."""
    from traceml.agent.probe import Probe

    torch.set_num_threads(1)
    probe = Probe(time.perf_counter, lambda exc: None)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    loader = DataLoader(TensorDataset(torch.randn(calls * 128, 64), torch.randn(calls * 128, 1)),
                        batch_size=128)
    x, y = torch.randn(128, 64), torch.randn(128, 1)

    def fetch() -> None:
        for _ in loader:
            pass

    def forward() -> None:
        for _ in range(calls):
            loss_fn(model(x), y)

    def backward() -> None:
        for _ in range(calls):
            loss_fn(model(x), y).backward()

    def step() -> None:
        for _ in range(calls):
            opt.step()

    def whole() -> None:
        for bx, by in loader:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(bx), by).backward()
            opt.step()

    model(x).sum().backward()  # the optimizer has gradients to step with
    print(f"torch {torch.__version__}, 1 thread, {calls} calls a block, {blocks} block pairs "
          "each; only the agent's event log (no collector, no sender thread); added CPU "
          "time of the training thread, fastest blocks")
    total = 0.0
    for name, group, op in (
            ("fetch", "__next__", fetch), ("forward+loss", "__call__", forward),
            ("backward", "backward", backward), ("optimizer step", "hooks", step),
            ("whole step", "all", whole)):
        inst = Instrumentation(probe)
        if group != "all":
            inst.patches = [patch for patch in inst.patches if patch.name == group]
            if group != "hooks":
                inst.hooks.install = lambda: None  # type: ignore[method-assign]
            inst.comm.install = lambda: None  # type: ignore[method-assign]
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(blocks):
            for patched in ((False, True) if i % 2 == 0 else (True, False)):
                if patched:
                    inst.install()
                try:
                    op()  # warm-up: a change of torch's classes drops specialised bytecode
                    began = time.thread_time()
                    op()
                    times[patched].append((time.thread_time() - began) / calls)
                finally:
                    if patched:
                        inst.uninstall()
                for stream in probe.streams:
                    stream.clear()
        added = (min(times[True]) - min(times[False])) * 1e6
        aa = (abs(min(times[False][0::2]) - min(times[False][1::2])) * 1e6
              if blocks >= 2 else math.nan)  # no second block: no A/A
        if group != "all":
            total += added  # each is called once a step
        print(f"split {name:<15} ({group:<8}) added {added:6.2f} µs a call, "
              f"{min(times[False]) * 1e6:7.1f} µs untraced; A/A {aa:.2f} µs"
              + (f"; the parts above add up to {total:.2f} µs" if group == "all" else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40,
                        help="alternating block pairs for the short step (a quarter as many for the long)")
    parser.add_argument("--startup-runs", type=int, default=5)
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda to time the agent's CUDA path (events, memory peaks)")
    parser.add_argument("--cuda-timing", default="both", type=cuda_timings,
                        help="--device cuda: every-step (the old path), sampled, off (no step "
                             "timed), a comma list of them, or both (every-step,sampled)")
    parser.add_argument("--long-ms", type=float, default=20.0,
                        help="--device cuda: the long step's GPU time to size it to")
    parser.add_argument("--dashboard", action="store_true",
                        help="collector with the live dashboard, polled once a second")
    parser.add_argument("--metrics", action="store_true",
                        help="collector serving Prometheus /metrics, scraped once a second")
    parser.add_argument("--capture", action="store_true",
                        help="profiler captures on (the planner and the control channel), none "
                             "asked; without it captures are off")
    parser.add_argument("--ddp", action="store_true",
                        help="the cost of communication timing on 2-rank gloo DDP")
    parser.add_argument("--split", action="store_true",
                        help="where the per-step cost goes: each patch group alone, on the "
                             "training thread only (no collector, no sender thread)")
    args = parse(parser, quick={"blocks": 2, "startup_runs": 1}, limit_s=3600.0)
    if args.ddp:
        ddp(args.blocks)
        return
    if args.split:
        split(args.blocks)
        return
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        secret = new_secret()
        collector = CollectorProcess(CollectorConfig(
            session_id="bench", bind_host="127.0.0.1", port=0,
            db_path=os.path.join(tmp, "telemetry.sqlite"), parent_pid=os.getpid(),
            dashboard_port=free_port() if args.dashboard else None, secret=secret,
            tokens=True, metrics_port=free_port() if args.metrics else None,
            capture="auto" if args.capture else "off"))
        poller = None
        if args.dashboard:
            poller = DashboardPoller(collector.ready["dashboard"]["url"].rstrip("/")
                                     + SNAPSHOT_PATH)
        elif args.metrics:
            poller = DashboardPoller(collector.ready["metrics"]["url"])
        # The batch watch runs as in a real rank; the one FLOP-counting step is a
        # one-time cost of its own (README), so counting is off here.
        env = AgentEnv(session_id="bench", endpoint=f"tcp://127.0.0.1:{collector.port}",
                       launcher_pid=os.getppid(), count_flops=False,
                       client_keys=client_keys_text(collector.keys),
                       rank_token=TokenBook(secret, "bench").rank(0),
                       control_endpoint=(f"tcp://127.0.0.1:{collector.ready['control_port']}"
                                         if args.capture else None))
        runtime = AgentRuntime(env, Sender("rank", socket.gethostname(), os.getpid(), 0, rank=0))
        runtime.watch_batches()
        asks: list[object] = []
        if args.capture and runtime.sender.control is not None:
            # The alternating blocks look like outlier steps to the live findings (an
            # untraced block is one long step to the collector), so the planner asks:
            # the rank reads every ask and acts on none, so what is measured is the
            # machinery's cost while no capture runs.
            runtime.sender.control = (runtime.sender.control[0], asks.append)
        runtime.sender.start()
        if args.device.startswith("cuda") and not runtime.device.watch():
            parser.error("--device cuda: torch sees no CUDA device")
        inst = Instrumentation(runtime.probe)
        mode = ("with the live dashboard polled 1/s" if args.dashboard else
                "with Prometheus /metrics scraped 1/s" if args.metrics else "summary mode")
        mode += ", captures on (none run)" if args.capture else ", captures off"
        print(f"torch {torch.__version__} on {args.device}, 1 thread, "
              f"collector live on port {collector.port}, {mode}")
        if args.device.startswith("cuda"):
            measure_cuda(runtime, inst, args.cuda_timing, args.blocks, args.long_ms)
        else:
            # The same 3-layer MLP, ~1 ms and ~20 ms a step on one core: the agent's
            # cost per step is the same, its share is not.
            measure("short step", make_loop(64, 2, 128, 200, args.device), inst, args.blocks)
            measure("long step", make_loop(512, 6, 128, 15, args.device), inst,
                    max(4, args.blocks // 4))
        runtime.probe.log(CLOSE)  # what the agent logs at exit
        runtime.sender.stop()
        if poller is not None:
            print(f"{'dashboard polls' if args.dashboard else '/metrics scrapes'} answered: "
                  f"{poller.stop()}")
        collector.stop()
        with StoreReader(os.path.join(tmp, "telemetry.sqlite")) as reader:
            stored = reader.num_steps()
        if args.capture:
            print(f"capture asks read by the rank (none acted on): {len(asks)}")
        print(f"steps the collector made of the events: {stored}, "
              f"messages sent {runtime.sender.num_sent}, dropped {runtime.sender.num_dropped}")
    if args.startup_runs:
        startup(args.startup_runs)


if __name__ == "__main__":
    main()
