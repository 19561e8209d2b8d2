"""Training loops that count their own samples and tokens and time their own steps, for
the throughput tests.  Never imports traceml.  Writes $EVIDENCE_DIR/rank<R>.json:
per step, when it began (before its fetch), its samples and its tokens, and the
model's shapes so the test can count its FLOPs by hand.

Cases: ``mlp`` (a DataLoader of (x, y) tensors, the last batch short), ``lm`` (token
ids in a dict batch, an embedding and two linear layers), ``noloader`` (tensors made
in the loop, no DataLoader)."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

IN, HIDDEN, OUT = 64, 128, 8
VOCAB, SEQ, DIM = 97, 32, 48


class Seeded(Dataset):
    """``n`` items, item ``i`` made by ``make`` from a generator seeded with ``i``."""

    def __init__(self, n, make):
        self.n, self.make = n, make

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make(torch.Generator().manual_seed(i))


def pair(g):
    return torch.randn(IN, generator=g), torch.randint(0, OUT, (1,), generator=g)[0]


def token_ids(g):
    ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
    return {"input_ids": ids[:-1], "labels": ids[1:]}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids):
        return self.head(torch.relu(self.hidden(self.embed(input_ids))))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=["mlp", "lm", "noloader"], default="mlp")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=15.0, help="sleep in each forward")
    p.add_argument("--ddp", action="store_true")
    return p.parse_args()


def main():
    args = parse()
    rank = int(os.environ.get("RANK", "0"))
    if args.ddp:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyLM() if args.case == "lm" else nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    # A step waits like a GPU's kernels would, so timing noise stays small.
    model.register_forward_hook(lambda *_: time.sleep(args.step_ms / 1000.0))
    if args.case == "noloader":
        batches = None
    else:
        data = Seeded(args.steps * args.batch, token_ids) if args.case == "lm" else Seeded(
            args.steps * args.batch - args.batch // 2, pair)  # the last batch is short
        batches = iter(DataLoader(data, batch_size=args.batch))
    steps = []
    for i in range(args.steps):
        t = time.perf_counter()
        if batches is None:
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(args.batch, IN, generator=g), torch.randint(0, OUT, (args.batch,))
        elif args.case == "lm":
            batch = next(batches)
            x, y = batch["input_ids"], batch["labels"]
        else:
            x, y = next(batches)
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        tokens = x.numel() if args.case == "lm" else None
        steps.append({"t": t, "samples": int(x.shape[0]), "tokens": tokens})
    end = time.perf_counter()
    out_dir = os.environ.get("EVIDENCE_DIR")
    if out_dir:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"steps": steps, "end": end, "batch": args.batch,
                       "shapes": {"in": IN, "hidden": HIDDEN, "out": OUT, "vocab": VOCAB,
                                  "seq": SEQ, "dim": DIM}}, f)
    if args.ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
