"""Per-step overhead of traceml's agent, and start-up cost against torchrun.

Runs the same small CPU training loop with and without instrumentation,
alternating blocks in one process, with a live collector process receiving
the batched steps.  Two clocks: wall time, and the CPU time of the training
thread (steadier on a shared machine; the agent's cost is CPU work on that
thread, while the sender thread runs beside it).  Each figure is the fastest
of many alternating blocks.  Prints the added cost per step (µs) and the traced /
untraced ratio for a short (~1 ms) and a long (~20 ms) step, then times
``traceml run`` against ``torchrun`` on an empty script.

    python scripts/bench_overhead.py [--blocks 15] [--startup-runs 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from traceml.agent.patches import Instrumentation
from traceml.agent.runtime import AgentRuntime
from traceml.collector.server import CollectorConfig
from traceml.environment import AgentEnv
from traceml.launcher.collector_process import CollectorProcess
from traceml.protocol import Sender


def make_loop(width: int, depth: int, batch: int, steps: int):  # type: ignore[no-untyped-def]
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(steps * batch, width), torch.randn(steps * batch, 1))
    loader = DataLoader(data, batch_size=batch)
    loss_fn = nn.MSELoss()

    def run_block() -> tuple[float, float]:
        """Seconds per step: (wall clock, CPU time of the training thread)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - wall) / steps, (time.thread_time() - cpu) / steps

    return run_block


def measure(name: str, run_block, inst: Instrumentation, blocks: int) -> None:  # type: ignore[no-untyped-def]
    run_block()  # warm-up
    plain: list[tuple[float, float]] = []
    traced: list[tuple[float, float]] = []
    for _ in range(blocks):
        plain.append(run_block())
        inst.install()
        try:
            traced.append(run_block())
        finally:
            inst.uninstall()
    # The fastest block of each kind is the one least disturbed by the rest of
    # the machine (as timeit reports); blocks alternate, so drift hits both.
    for i, clock in enumerate(("wall", "cpu")):
        p = min(x[i] for x in plain)
        t = min(x[i] for x in traced)
        print(f"{name:<11}{clock:>5}  untraced {p * 1e3:8.3f} ms/step  traced {t * 1e3:8.3f} "
              f"ms/step  added {(t - p) * 1e6:7.1f} µs/step  ratio {t / p:.4f}")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--startup-runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        collector = CollectorProcess(CollectorConfig(
            session_id="bench", bind_host="127.0.0.1", port=0,
            db_path=os.path.join(tmp, "telemetry.sqlite"), parent_pid=os.getpid()))
        env = AgentEnv(session_id="bench", endpoint=f"tcp://127.0.0.1:{collector.port}",
                       launcher_pid=os.getppid())
        runtime = AgentRuntime(env, Sender("rank", socket.gethostname(), os.getpid(), 0, rank=0))
        runtime.sender.start()
        inst = Instrumentation(runtime.probe)
        print(f"torch {torch.__version__}, 1 thread, collector live on port {collector.port}")
        measure("short step", make_loop(64, 2, 32, 400), inst, args.blocks)
        measure("long step", make_loop(512, 6, 256, 20), inst, args.blocks)
        runtime.tracker.close()
        runtime.sender.stop()
        collector.stop()
        print(f"steps sent to the collector: {runtime.num_steps}, "
              f"messages sent {runtime.sender.num_sent}, dropped {runtime.sender.num_dropped}")
    startup(args.startup_runs)


if __name__ == "__main__":
    main()
