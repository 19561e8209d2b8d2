"""Closures and evaluation loops with a model whose forward sleeps 30 ms."""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        time.sleep(0.03)
        return self.lin(x)


class SlowData(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.004)
        return torch.randn(8), torch.tensor(i % 2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--closure", choices=["none", "lbfgs", "lightning"], default="none")
    p.add_argument("--eval-every", type=int, default=0)
    a = p.parse_args()
    model = SlowModel()
    opt = (torch.optim.LBFGS(model.parameters(), max_iter=1) if a.closure == "lbfgs"
           else torch.optim.SGD(model.parameters(), lr=0.1))
    train = DataLoader(SlowData(), batch_size=8)  # 8 batches of 8 fast-ish fetches
    evals = DataLoader(SlowData(), batch_size=8)
    loss_fn = nn.CrossEntropyLoss()
    for i, (x, y) in enumerate(train):
        if a.closure != "none":
            def closure():
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)
        else:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        if a.eval_every and (i + 1) % a.eval_every == 0:
            model.eval()
            with torch.no_grad():
                for j, (ex, _) in enumerate(evals):
                    model(ex)
                    if j == 2:
                        break
            model.train()


if __name__ == "__main__":
    main()
