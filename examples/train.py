"""A small CPU training job for trying traceml: `traceml run examples/train.py`.

It never imports traceml.  Works alone or under DDP (gloo) with several ranks.

Each forward also waits ``--device-ms`` (default 20 ms), standing in for the
time a GPU's kernels would take: on a CPU-only machine that keeps step times
steady however busy the cores are.  ``--slow-rank R --slow-input-ms MS`` makes
rank R's data loading MS slower per batch (as a rank on an overloaded node, or
with a slower data shard, would be): the demo's straggler.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate


class SlowCollate:
    """Batches as DataLoader makes them, ``delay_s`` later (slow decoding or I/O)."""

    def __init__(self, delay_s):
        self.delay_s = delay_s

    def __call__(self, samples):
        if self.delay_s:
            time.sleep(self.delay_s)
        return default_collate(samples)


class Model(nn.Module):
    """An MLP whose forward also waits ``device_s``, standing in for GPU kernels."""

    def __init__(self, device_s):
        super().__init__()
        self.device_s = device_s
        self.layers = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        if self.device_s:
            time.sleep(self.device_s)
        return self.layers(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device-ms", type=float, default=20.0,
                        help="time each forward waits, standing in for GPU kernels")
    parser.add_argument("--slow-rank", type=int, default=None,
                        help="the rank whose data loading is slowed")
    parser.add_argument("--slow-input-ms", type=float, default=0.0,
                        help="how much slower each of its batches loads")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = Model(args.device_ms / 1e3)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    data = TensorDataset(torch.randn(args.steps * args.batch_size, 64),
                         torch.randint(0, 10, (args.steps * args.batch_size,)))
    slow_s = args.slow_input_ms / 1e3 if rank == args.slow_rank else 0.0
    loader = DataLoader(data, batch_size=args.batch_size, collate_fn=SlowCollate(slow_s))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    print(f"rank {rank}: done, last loss {loss.item():.3f}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
