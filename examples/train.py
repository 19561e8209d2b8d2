"""A small CPU training job for trying traceml: `traceml run examples/train.py`.

It never imports traceml.  Works alone or under DDP (gloo) with several ranks.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    data = TensorDataset(torch.randn(args.steps * args.batch_size, 64),
                         torch.randint(0, 10, (args.steps * args.batch_size,)))
    loader = DataLoader(data, batch_size=args.batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    rank = int(os.environ.get("RANK", "0"))
    print(f"rank {rank}: done, last loss {loss.item():.3f}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
