"""A tiny training loop that runs until the test says stop (live-view tests).

Never imports traceml. Trains until the file $LIVE_STOP_FILE exists (or
$LIVE_MAX_S seconds pass, a safety net), so a test decides when the run ends
instead of guessing how long it takes. Every rank prints a line every 25 steps
and one line on stderr at the end. With several ranks (gloo DDP) the ranks agree
on stopping at the same step.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __init__(self, sleep_s):
        self.sleep_s = sleep_s

    def __len__(self):
        return 10**9

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randint(0, 4, (1,), generator=g)[0]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--input-sleep-ms", type=float, default=2.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    return p.parse_args()


def should_stop(deadline, world):
    stop = os.path.exists(os.environ["LIVE_STOP_FILE"]) or time.monotonic() > deadline
    if world > 1:
        flag = torch.tensor([int(stop)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
    return stop


def main():
    a = parse()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + float(os.environ.get("LIVE_MAX_S", "120"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sleep_ms = a.input_sleep_ms + (a.slow_ms if rank == a.slow_rank else 0.0)
    loader = DataLoader(Slow(sleep_ms / 1e3), batch_size=1)
    step = 0
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 25 == 0:
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if should_stop(deadline, world):
            break
    print(f"rank {rank} finished after {step + 1} steps", flush=True)
    print(f"rank {rank} says goodbye on stderr", file=sys.stderr, flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
