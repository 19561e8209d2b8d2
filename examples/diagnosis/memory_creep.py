"""Host memory creeping up: every step keeps 6 MiB alive, as a list of
losses kept with their graphs, or a growing cache, would (HOST RSS CREEP).

    traceml run examples/diagnosis/memory_creep.py
"""

import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(90 * 16, 64), torch.randint(0, 10, (90 * 16,)))
kept = []
for x, y in DataLoader(data, batch_size=16):
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    kept.append(torch.ones(3 * 512 * 1024))  # 6 MiB that is never freed
    time.sleep(0.04)
