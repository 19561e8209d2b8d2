"""2-rank FSDP (fully_shard) on gloo: a plain loop (never imports traceml)."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(4)),
                      nn.Linear(128, 1))
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(1 + rank)
data = TensorDataset(torch.randn(steps * 64, 128), torch.randn(steps * 64, 1))
for x, y in DataLoader(data, batch_size=64):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
out = os.environ.get("EVIDENCE_DIR")
if out:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "steps": steps}, f)
dist.destroy_process_group()
