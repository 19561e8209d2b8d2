"""Host memory over a training loop, for the creep accuracy script and tests.
Never imports traceml.

  creep  every step keeps 1 MB alive (a list of tensors never freed): RSS grows
         ~1 MB per step, steadily
  flat   every step allocates and frees a buffer of random size (1-16 MB) and keeps
         a bounded cache of random ones (20 of 1-6 MB, evicted at random, cleared
         now and then): RSS jumps around but does not grow
"""

import argparse
import random
import time

import torch
from torch import nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=["creep", "flat"], required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-ms", type=float, default=10.0)
    a = p.parse_args()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rng = random.Random()
    kept, cache = [], []
    for _ in range(a.steps):
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if a.case == "creep":
            kept.append(torch.ones(250_000))  # 1 MB, never freed
        else:
            scratch = torch.ones(rng.randint(1, 16) * 250_000)  # 1-16 MB, freed at once
            del scratch
            cache.append(torch.ones(rng.randint(1, 6) * 250_000))  # up to ~120 MB kept
            if len(cache) > 20:
                cache.pop(rng.randrange(len(cache)))
            if rng.random() < 0.05:
                cache.clear()
        time.sleep(a.step_ms / 1e3)


if __name__ == "__main__":
    main()
