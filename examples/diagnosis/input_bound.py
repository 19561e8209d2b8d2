"""An input-bound run: every sample takes 1 ms to load, so the model waits
for data (INPUT-BOUND).  ``--sample-ms 0`` is its fixed twin.

    traceml run examples/diagnosis/input_bound.py
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowDataset(Dataset):
    def __init__(self, n: int, sample_ms: float) -> None:
        self.n, self.sample_s = n, sample_ms / 1e3

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.sample_s)  # decoding, augmentation, a slow disk...
        return torch.randn(64), i % 10


parser = argparse.ArgumentParser()
parser.add_argument("--sample-ms", type=float, default=1.0)
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in DataLoader(SlowDataset(args.steps * 16, args.sample_ms), batch_size=16):
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
