"""A healthy CPU run: compute dominates each step (COMPUTE-BOUND or BALANCED).

    traceml run examples/diagnosis/healthy.py
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(60 * 128, 256), torch.randint(0, 10, (60 * 128,)))
for x, y in DataLoader(data, batch_size=128):
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
