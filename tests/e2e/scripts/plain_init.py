"""traceml.init() and traceml.summary() in a plain `python train.py` run."""

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import traceml


class Slow(Dataset):
    def __len__(self):
        return 30 * 4

    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.randn(8), torch.randn(1)


config = traceml.init(logs_dir=sys.argv[1], session_id="plain")
assert config is not None and config.session_id == "plain"
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in DataLoader(Slow(), batch_size=4):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
deadline = time.monotonic() + 20
flat = {}
while time.monotonic() < deadline:  # the collector stores batches as they arrive
    flat = traceml.summary()
    if flat.get("traceml/step_time/diagnosis") == "INPUT-BOUND":
        break
    time.sleep(0.1)
assert all(k.startswith("traceml/") for k in flat), flat
assert flat["traceml/step_time/diagnosis"] == "INPUT-BOUND", flat
assert flat["traceml/step_time/input_ms/median"] > 5, flat
print("flat keys ok")
