"""Per-step cost of tracing Ray Train workers: the same TorchTrainer fit with
``traceml.integrations.ray.fit`` and with ``trainer.fit()``, paired, on the workers;
and the same loops under ``traceml run`` against ``--no-trace``, for the agent's
own cost on the same machine the same hour.

Starts a local Ray cluster (2 CPUs) and runs fits of 2 gloo DDP workers in ABBA
order (untraced, traced, traced, untraced, ...), then as many ``traceml run
--nproc-per-node=2`` launches of the same loops.  In each, every worker times two
loops of its own, a short step (~1 ms of compute) and a long one (~15 ms): the
median wall time per step, and the training thread's CPU time per step, of the
slower worker.  Prints, per loop, the traced - untraced difference of each adjacent
pair (median of the pairs) and an A/A line: two untraced runs of alternate pairs,
which differ by nothing (its figure is the run's noise floor).

    python scripts/bench_ray_overhead.py [--pairs 4] [--divide 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench_options import parse

LOOPS = {"short": (64, 2, 600), "long": (512, 6, 80)}  # width, depth, steps (quick: / 4)
WARMUP_STEPS = 10


def time_loop(width: int, depth: int, steps: int, on_ray: bool) -> list[float]:
    """Worker: ``steps`` DDP steps of an MLP (made ready by Ray Train's prepare_model
    and prepare_data_loader on Ray, by hand under `traceml run`); the median wall and
    CPU seconds per step after warm-up, the larger of the two workers' (an all-reduce)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(width, 1))
    rows = steps * 64 * dist.get_world_size()  # each worker takes its share of the batches
    data = TensorDataset(torch.randn(rows, width), torch.randn(rows, 1))
    if on_ray:
        import ray.train.torch

        model = ray.train.torch.prepare_model(net)
        loader = ray.train.torch.prepare_data_loader(DataLoader(data, batch_size=64))
    else:
        model = nn.parallel.DistributedDataParallel(net)
        loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=False))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    wall: list[float] = []
    cpu: list[float] = []
    for x, y in loader:
        w, c = time.perf_counter(), time.thread_time()
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.thread_time() - c)
    medians = torch.tensor([statistics.median(wall[WARMUP_STEPS:]),
                            statistics.median(cpu[WARMUP_STEPS:])])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return [float(v) for v in medians]


def train_func(config: dict[str, Any]) -> None:
    """Worker: both loops; rank 0 writes the figures to ``config["out"]`` (this machine)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    metrics: dict[str, float] = {}
    for name, (width, depth, steps) in LOOPS.items():
        metrics[f"{name}_wall_s"], metrics[f"{name}_cpu_s"] = time_loop(
            width, depth, max(WARMUP_STEPS * 2, steps // config["divide"]), config["on_ray"])
    if dist.get_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump(metrics, f)


def one_fit(traced: bool, divide: int, tmp: str) -> dict[str, float]:
    import ray.train
    from ray.train.torch import TorchTrainer

    out = os.path.join(tmp, "figures.json")
    trainer = TorchTrainer(
        train_func, train_loop_config={"divide": divide, "out": out, "on_ray": True},
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(storage_path=os.path.join(tmp, "ray")))
    if not traced:
        trainer.fit()
    else:
        from traceml.integrations.ray import fit

        stdout = sys.stdout
        with open(os.devnull, "w") as quiet:  # the summary card, once per fit
            sys.stdout = quiet
            try:
                fit(trainer, logs_dir=os.path.join(tmp, "logs"))
            finally:
                sys.stdout = stdout
    with open(out) as f:
        metrics: dict[str, float] = json.load(f)
    return metrics


def one_launch(traced: bool, divide: int, tmp: str) -> dict[str, float]:
    """The same loops as 2 ranks of ``traceml run`` (``--no-trace``: untraced)."""
    out = os.path.join(tmp, "figures.json")
    command = [sys.executable, "-m", "traceml", "run", "--nproc-per-node=2", "--logs-dir",
               os.path.join(tmp, "logs"), *([] if traced else ["--no-trace"]), __file__,
               "--worker", "--divide", str(divide), "--out", out]
    subprocess.run(command, check=True, capture_output=True, cwd=tmp,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(out) as f:
        metrics: dict[str, float] = json.load(f)
    return metrics


def worker_main() -> None:
    """A rank of `one_launch` (started by ``traceml run``)."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--divide", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    train_func({"divide": args.divide, "out": args.out, "on_ray": False})
    dist.destroy_process_group()


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """Median of ``values`` and its ~95% interval (sign-test order statistics)."""
    values = sorted(values)
    n = len(values)
    k = max(0, int((n - 1.96 * n ** 0.5) / 2))
    return values[k], statistics.median(values), values[n - 1 - k]


def report(how: str, plain: list[dict[str, float]], traced: list[dict[str, float]]) -> None:
    """Per loop and clock: the paired added time per step, and the A/A line."""
    print(f"-- {how}")
    for name in LOOPS:
        for clock in ("wall", "cpu"):
            key = f"{name}_{clock}_s"
            diffs = [t[key] - p[key] for p, t in zip(plain, traced)]
            lo, mid, hi = median_interval(diffs)
            base = statistics.median(p[key] for p in plain)
            print(f"{name:<6}{clock:>5}  untraced {base * 1e3:7.3f} ms/step  paired added "
                  f"{mid * 1e6:7.1f} µs/step, 95% interval {lo * 1e6:.1f} to {hi * 1e6:.1f} "
                  f"({len(diffs)} pairs)  ratio {(base + mid) / base:.4f}")
        if len(plain) >= 2:
            key = f"{name}_wall_s"
            aa = [b[key] - a[key] for a, b in zip(plain[0::2], plain[1::2])]
            print(f"{name:<6}  A/A  untraced vs untraced: {statistics.median(aa) * 1e6:+7.1f} "
                  f"µs/step, the noise floor of this run")
        else:
            print(f"{name:<6}  A/A  needs two untraced runs (--pairs 2 or more)")


def run_pairs(pairs: int, one: Any, divide: int, tmp: str, label: str
              ) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """``pairs`` untraced/traced runs of ``one`` in ABBA order."""
    plain: list[dict[str, float]] = []
    traced: list[dict[str, float]] = []
    for i in range(pairs):
        for with_traceml in ((False, True) if i % 2 == 0 else (True, False)):
            started = time.monotonic()
            (traced if with_traceml else plain).append(one(with_traceml, divide, tmp))
            print(f"{label} {len(plain) + len(traced)}: "
                  f"{'traced' if with_traceml else 'untraced'} in "
                  f"{time.monotonic() - started:.0f} s", flush=True)
    return plain, traced


def main() -> None:
    if "--worker" in sys.argv:
        worker_main()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="untraced/traced run pairs (ABBA)")
    parser.add_argument("--divide", type=int, default=1, help="run each loop's steps / N")
    args = parse(parser, quick={"pairs": 1, "divide": 4}, limit_s=3600.0)
    import ray

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"ray {ray.__version__}, local cluster of 2 CPUs, 2 gloo DDP workers, 1 thread each")
    with tempfile.TemporaryDirectory() as tmp:
        on_ray = run_pairs(args.pairs, one_fit, args.divide, tmp, "ray fit")
        ray.shutdown()
        under_run = run_pairs(args.pairs, one_launch, args.divide, tmp, "traceml run")
    report("Ray Train: traceml.integrations.ray.fit against trainer.fit()", *on_ray)
    report("the same loops as 2 ranks of traceml run, against --no-trace", *under_run)


if __name__ == "__main__":
    main()
