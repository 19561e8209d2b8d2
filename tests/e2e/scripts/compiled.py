"""torch.compile under traceml: report dynamo's graph-break counter."""

import torch
from torch import nn
from torch._dynamo.utils import counters

model = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
                      backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(6):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
breaks = sum(counters["graph_break"].values())
frames = counters["stats"]["unique_graphs"]
print(f"graph_breaks={breaks} frames_ok={int(frames == 1)}")
