"""Train a tiny model until the file named by argv[1] exists, then exit with
status argv[2] (a test decides when the run ends, e.g. after filling the disk)."""

import os
import sys

import torch
from torch import nn

marker, status = sys.argv[1], int(sys.argv[2])
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 8)
for _ in range(1_000_000):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if os.path.exists(marker):
        break
sys.exit(status)
