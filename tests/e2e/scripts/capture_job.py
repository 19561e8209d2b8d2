"""2-rank gloo DDP that trains until a profiler capture has been written (never imports
traceml): the cases of ``ddp_real.py`` that traceml's captures are tested on.

``--case``:
  uneven    a 4 x (512 x 512) MLP, 256 rows per batch; ``--slow-rank`` gets twice the
            rows (an uneven shard): twice the forward and backward work
  heavy     a 4 x (2048 x 2048) MLP (67 MB of gradients), 2 rows per batch: the
            gradient all-reduce is most of the step

It stops ``--after`` steps once ``--until`` (a glob; ``{rank}`` is the rank) matches on
every rank (the ranks
agree with an all-reduce every ``CHECK_EVERY`` steps, so they stop at the same step),
or at ``--max-steps``.  Each rank writes ``rank<R>.json`` into ``EVIDENCE_DIR``: its steps.
"""

import argparse
import glob
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CHECK_EVERY = 10
NUM_BATCHES = 32  # the data is this many batches, gone through again and again


def mlp(width: int, depth: int = 4) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU())
                           for _ in range(depth - 1)), nn.Linear(width, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="uneven", choices=("uneven", "heavy"))
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--until", default="")
    parser.add_argument("--after", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    width, batch = (2048, 2) if args.case == "heavy" else (512, 256)
    if args.case == "uneven" and rank == args.slow_rank:
        batch *= 2
    model = nn.parallel.DistributedDataParallel(mlp(width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    torch.manual_seed(1 + rank)
    rows = NUM_BATCHES * batch
    data = TensorDataset(torch.randn(rows, width), torch.randn(rows, 1))
    steps, stop_at = 0, args.max_steps
    while steps < stop_at:
        for x, y in DataLoader(data, batch_size=batch):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            steps += 1
            if steps % CHECK_EVERY == 0 and stop_at == args.max_steps and args.until:
                found = torch.tensor([float(bool(glob.glob(args.until.format(rank=rank))))])
                dist.all_reduce(found, op=dist.ReduceOp.MIN)
                if found.item() > 0:
                    stop_at = min(args.max_steps, steps + args.after)
            if steps >= stop_at:
                break
    out_dir = os.environ.get("EVIDENCE_DIR")
    if out_dir:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "steps": steps}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
