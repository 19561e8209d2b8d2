"""2-rank gloo DDP that a test steers through files in ``--control DIR`` (never imports
traceml): rank 1 gets twice the rows of rank 0 (an uneven shard: a compute straggler);
once ``hang`` exists, rank 1 stops after its next step (writing the time into
``hung``) until ``release`` exists, while rank 0 waits for it in the all-reduce;
then both run ``--after`` more steps and end.  Bounded: ``--max-steps``, and
``--max-hang-s`` of waiting."""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_real import mlp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", required=True)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--after", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--max-hang-s", type=float, default=120.0)
    args = parser.parse_args()
    control = Path(args.control)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(mlp(args.width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    rows = args.rows * (2 if rank == 1 else 1)
    data = TensorDataset(torch.randn(rows * 8, args.width), torch.randn(rows * 8, 1))
    hung = False
    resumed = torch.zeros(1)
    left = None
    step = 0
    while step < args.max_steps and left != 0:
        for x, y in DataLoader(data, batch_size=rows):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            step += 1
            if rank == 1 and not hung and (control / "hang").exists():
                hung = True
                (control / "hung").write_text(repr(time.time()))
                deadline = time.monotonic() + args.max_hang_s
                while not (control / "release").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                resumed[0] = 1.0
            flag = resumed.clone()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # both ranks end at the same step
            if flag.item() and left is None:
                left = args.after
            if left is not None:
                left -= 1
            if step >= args.max_steps or left == 0:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
