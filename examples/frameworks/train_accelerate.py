"""A plain loop with Hugging Face Accelerate: `traceml run examples/frameworks/train_accelerate.py`
(add --nproc-per-node=2 for two DDP ranks on gloo).  It never imports traceml.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accum", type=int, default=1)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum)
    model = nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    num_rows = args.steps * args.accum * 64 * accelerator.num_processes
    data = TensorDataset(torch.randn(num_rows, 256), torch.randint(0, 10, (num_rows,)))
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=64))
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    accelerator.end_training()


if __name__ == "__main__":
    main()
