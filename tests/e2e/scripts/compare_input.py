"""A tiny CPU training loop whose input and compute times are set from the command line.

Never imports traceml. Each DataLoader fetch sleeps --input-sleep-ms (a slow
loader); the model's forward sleeps --compute-sleep-ms (a stand-in for device
time, steady even on a busy CPU) on top of a real MLP of --width (real CPU work,
as noisy as the machine). Used by the compare end-to-end test and
scripts/bench_compare_noise.py.
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Batches(Dataset):
    """Whole batches; fetching one takes --input-sleep-ms."""

    def __init__(self, num_batches, batch_size, sleep_s):
        self.num_batches, self.batch_size, self.sleep_s = num_batches, batch_size, sleep_s

    def __len__(self):
        return self.num_batches

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(i)
        return (torch.randn(self.batch_size, 32, generator=g),
                torch.randint(0, 4, (self.batch_size,), generator=g))


class Model(nn.Module):
    def __init__(self, sleep_s, width):
        super().__init__()
        self.sleep_s = sleep_s
        self.net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width),
                                 nn.ReLU(), nn.Linear(width, 4))

    def forward(self, x):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.net(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--input-sleep-ms", type=float, default=0.0)
    p.add_argument("--compute-sleep-ms", type=float, default=10.0)
    p.add_argument("--width", type=int, default=64, help="hidden width: real CPU compute")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Model(a.compute_sleep_ms / 1e3, a.width)
    loader = DataLoader(Batches(a.steps, a.batch_size, a.input_sleep_ms / 1e3), batch_size=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()


if __name__ == "__main__":
    main()
