"""2-rank gloo DDP whose cost comes from real causes, never a sleep (never imports traceml).

``--case``:
  heavy     a 4 x (2048 x 2048) MLP (67 MB of gradients) and 2 rows per batch:
            the gradient all-reduce is most of the step
  hook      the same, with a compression-style DDP comm hook of the script's own
            that works on the calling thread (int8 quantization with error
            feedback) before it launches ``all_reduce(..., async_op=True)``
  uneven    a 4 x (512 x 512) MLP, 256 rows per batch; ``--slow-rank`` gets
            twice the rows (an uneven shard): twice the forward and backward work
  shared    the smaller MLP, 256 rows per batch on every rank; each rank is pinned to
            its own core and ``--slow-rank`` shares its core with a spinning process
            (a step's compute spans several scheduler slices, so the share halves
            that rank's speed at every step rather than at some)
  large     the heavy model with 1024 rows per batch: compute dominates the step
  conv      four 3 x 3 convolutions of 16 channels with BatchNorm on 96 x 96 images:
            DDP broadcasts the BatchNorm statistics as each forward begins, and
            all-reduces the gradients in backward (two spans in flight, a gap
            between); ``--slow-rank`` gets twice the images, as in ``uneven``

Each rank writes ``rank<R>.json`` into ``EVIDENCE_DIR`` when set: its step count and,
per step, the ms its comm hook spent before returning (``hook``: timed by the hook).
"""

# No `from __future__ import annotations`: torch checks a comm hook's
# ``bucket`` annotation against dist.GradBucket itself, not its string.
import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HEAVY_WIDTH = 2048
SMALL_WIDTH = 512
BATCH = {"heavy": 2, "hook": 2, "uneven": 256, "shared": 256, "large": 1024, "conv": 16}
"""Rows per batch of each case (``--slow-rank`` gets twice as many in ``uneven`` and
``conv``)."""


def mlp(width: int, depth: int = 4) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU())
                           for _ in range(depth - 1)), nn.Linear(width, 1))


CONV_CHANNELS, CONV_SIZE = 16, 96


def convnet() -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Conv2d(1 if i == 0 else CONV_CHANNELS, CONV_CHANNELS, 3, padding=1),
                   nn.BatchNorm2d(CONV_CHANNELS), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.LazyLinear(1))


class Compressor:
    """A compression-style hook with error feedback: on the calling thread it
    quantizes the bucket to int8 and keeps the quantization error for the next
    step (the work a compressing hook does before it launches), then launches
    the all-reduce of the dense bucket, so the update stays exact.  It times
    itself (``step_s``: its seconds per step, the ground truth for traceml's
    ``hook_ms``)."""

    def __init__(self) -> None:
        # By bucket and size: DDP rebuilds its buckets after the first step.
        self.residuals: dict[tuple[int, int], torch.Tensor] = {}
        self.step_s: list[float] = [0.0]

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        try:
            return self._compress_and_launch(bucket)
        finally:
            self.step_s[-1] += time.perf_counter() - start

    def _compress_and_launch(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        key = (bucket.index(), buffer.numel())
        corrected = buffer + self.residuals.get(key, 0.0)
        scale = corrected.abs().amax().clamp_min(1e-12) / 127.0
        quantized = (corrected / scale).round_().clamp_(-127, 127).to(torch.int8)
        self.residuals[key] = corrected - quantized.float() * scale
        buffer.div_(dist.get_world_size())
        work = dist.all_reduce(buffer, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])


def spin_on(core: int) -> subprocess.Popen[bytes]:
    """A process that keeps one core busy (another job on this rank's core), until
    this rank ends, however it ends."""
    spin = f"import os\nwhile os.getppid() == {os.getpid()}: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    os.sched_setaffinity(spinner.pid, {core})
    return spinner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="heavy",
                        choices=("heavy", "hook", "uneven", "shared", "large", "conv"))
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=0, help="rows per batch (0: the case's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    slowed = rank == args.slow_rank
    spinner = None
    if args.case == "shared":
        # Before the process group: gloo's threads are made then, and take the
        # rank's core with them (traceml's own threads already run, and float).
        cores = sorted(os.sched_getaffinity(0))
        core = cores[rank % len(cores)]
        os.sched_setaffinity(0, {core})
        if slowed:
            spinner = spin_on(core)
    try:
        steps, compressor = train(args, rank, slowed)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    out_dir = os.environ.get("EVIDENCE_DIR")
    if out_dir:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "steps": steps,
                       "hook_ms": [1e3 * s for s in compressor.step_s[:steps]]}, f)
    dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int, slowed: bool) -> tuple[int, Compressor]:
    """The case's DDP training loop; its step count and the hook (timed or unused)."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    heavy = args.case in ("heavy", "hook", "large")
    width = HEAVY_WIDTH if heavy else SMALL_WIDTH
    shape: tuple[int, ...] = (width,)
    if args.case == "conv":
        net, shape = convnet(), (1, CONV_SIZE, CONV_SIZE)
        net(torch.zeros(2, *shape))  # the lazy layer takes its shape before DDP
    else:
        net = mlp(width)
    model = nn.parallel.DistributedDataParallel(net)
    compressor = Compressor()
    if args.case == "hook":
        model.register_comm_hook(None, compressor)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    batch = args.batch or BATCH[args.case]
    if args.case in ("uneven", "conv") and slowed:
        batch *= 2
    torch.manual_seed(1 + rank)
    data = TensorDataset(torch.randn(args.steps * batch, *shape),
                         torch.randn(args.steps * batch, 1))
    steps = 0
    for x, y in DataLoader(data, batch_size=batch):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        steps += 1
        compressor.step_s.append(0.0)
    return steps, compressor


if __name__ == "__main__":
    main()
