"""Training loops as people write them without the usual pieces: parameters
updated by hand (with clipping and a learning-rate schedule), batches cut from
a tensor by get_batch() with no DataLoader, evaluation and predictions on
batches the loop builds itself, a slow step now and then.  Never imports
traceml.  Writes its own counts to $EVIDENCE_DIR/rank0.json."""

import argparse
import json
import os
import time

import torch
from torch import nn

DATA = torch.randn(4096, 33)
TEST = torch.randn(64, 33)


class Net(nn.Module):
    def __init__(self, forward_ms):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(32, 64), nn.Linear(64, 1)
        self.forward_ms = forward_ms

    def forward(self, x):
        if self.forward_ms:
            time.sleep(self.forward_ms / 1e3)  # stands in for a GPU's kernels
        return self.lin2(torch.relu(self.lin1(x)))


def get_batch(batch_ms, size=16):
    """A batch cut from a tensor, as char-level trainers do (slow: decoding)."""
    if batch_ms:
        time.sleep(batch_ms / 1e3)
    rows = DATA[torch.randint(0, len(DATA), (size,))]
    return rows[:, :32], rows[:, 32:]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--update", choices=["sgd", "manual", "manual-clip", "lbfgs"], default="sgd")
    p.add_argument("--forward-ms", type=float, default=0.0)
    p.add_argument("--batch-ms", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=3)
    p.add_argument("--predict-ms", type=float, default=0.0, help="LBFGS: predict, then plot")
    p.add_argument("--slow-every", type=int, default=0)
    p.add_argument("--slow-ms", type=float, default=0.0)
    return p.parse_args()


def evaluate(model, a):
    model.eval()
    with torch.no_grad():
        for _ in range(a.eval_batches):
            x, y = get_batch(a.batch_ms)
            nn.functional.mse_loss(model(x), y)
    model.train()


def manual_update(model, it, clip):
    lr = 0.05
    if clip:  # clipping, then linear warm-up and step decay, by hand
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr *= min(1.0, (it + 1) / 10) * 0.5 ** (it // 20)
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def main():
    a = parse()
    torch.manual_seed(0)
    model = Net(a.forward_ms)
    opt = (torch.optim.LBFGS(model.parameters(), max_iter=1) if a.update == "lbfgs"
           else torch.optim.SGD(model.parameters(), lr=0.05))
    counts = {"rank": 0, "iterations": 0, "evaluations": 0, "predictions": 0}
    for it in range(a.steps):
        if a.eval_every and it and it % a.eval_every == 0:
            evaluate(model, a)
            counts["evaluations"] += 1
        x, y = get_batch(a.batch_ms)
        if a.update == "lbfgs":
            def closure():
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)
            if a.predict_ms:  # pytorch/examples' time_sequence_prediction does this
                with torch.no_grad():
                    pred = model(TEST[:, :32])
                    nn.functional.mse_loss(pred, TEST[:, 32:])
                time.sleep(a.predict_ms / 1e3)  # plotting and saving the figure
                counts["predictions"] += 1
        else:
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if a.update == "sgd":
                opt.step()
            else:
                manual_update(model, it, clip=a.update == "manual-clip")
        if a.slow_every and (it + 1) % a.slow_every == 0:
            time.sleep(a.slow_ms / 1e3)  # a checkpoint every so often
        counts["iterations"] += 1
    out = os.environ.get("EVIDENCE_DIR")
    if out:
        with open(os.path.join(out, "rank0.json"), "w") as f:
            json.dump(counts, f)


if __name__ == "__main__":
    main()
