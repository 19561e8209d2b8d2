"""Two-node check: gloo all_reduce must be right, then a few training steps."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
step_sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(steps * 4, 8), torch.randn(steps * 4, 1))
for x, y in DataLoader(data, batch_size=4):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    time.sleep(step_sleep_s)
out = os.environ.get("EVIDENCE_DIR")
if out:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "allreduce": t.item(), "group_rank": os.environ["GROUP_RANK"]}, f)
dist.destroy_process_group()
