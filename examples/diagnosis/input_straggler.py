"""DDP with 2 ranks where rank 1 loads its data slowly (INPUT STRAGGLER, r1).

The step totals of both ranks come out equal: rank 0 waits for rank 1 inside
backward's all-reduce.  The straggler shows in the phase that differs.

    traceml run --nproc-per-node=2 examples/diagnosis/input_straggler.py
"""

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Shard(Dataset):
    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s

    def __len__(self) -> int:
        return 40 * 8

    def __getitem__(self, i: int):
        time.sleep(self.slow_s)
        return torch.randn(64), i % 10


dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
slow_s = 0.002 if rank == int(os.environ.get("SLOW_RANK", "1")) else 0.0
for x, y in DataLoader(Shard(slow_s), batch_size=8):
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
dist.destroy_process_group()
