"""A wait-heavy run: each step spends time outside input, forward, backward
and optimizer (here a synchronous checkpoint/logging stall) (WAIT-HEAVY).

    traceml run examples/diagnosis/wait_heavy.py
"""

import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(40 * 32, 64), torch.randint(0, 10, (40 * 32,)))
for x, y in DataLoader(data, batch_size=32):
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    time.sleep(0.01)  # e.g. writing metrics to a slow disk after every step
