"""DDP with 2 ranks where rank 1's forward is slower, as on a throttled or
shared GPU (COMPUTE STRAGGLER, r1).

    traceml run --nproc-per-node=2 examples/diagnosis/compute_straggler.py
"""

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, extra_s: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        self.extra_s = extra_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.extra_s)  # stands in for slower kernels on this rank
        return self.body(x)


dist.init_process_group("gloo")
rank = dist.get_rank()
extra_s = 0.015 if rank == int(os.environ.get("SLOW_RANK", "1")) else 0.0
model = nn.parallel.DistributedDataParallel(Net(extra_s))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(40 * 16, 64), torch.randint(0, 10, (40 * 16,)))
for x, y in DataLoader(data, batch_size=16):
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
dist.destroy_process_group()
