"""A 2-rank gloo DDP loop whose rank 1 starts a child process that tries to speak as
rank 0 (`forger.py`), halfway through: first it asks the launcher's key service for a
token, then it sends forged steps as rank 0, copying its host and pid, with the token
its parent (rank 1) holds and with none.  Each rank writes how many steps it ran."""

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
dist.init_process_group("gloo")
rank = dist.get_rank()
pids = [None, None]
dist.all_gather_object(pids, os.getpid())
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(16, 8), torch.randn(16, 2)
done = 0
for i in range(steps):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    done += 1
    if rank == 1 and i == steps // 2:
        from traceml.agent import runtime  # what a child could read from its parent

        agent = runtime.active()
        token = agent.token if agent is not None else ""
        forger = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forger.py")
        subprocess.run([sys.executable, forger, str(pids[0]), token or ""], check=True)
out = os.environ["EVIDENCE_DIR"]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "steps": done, "pid": os.getpid()}, f)
dist.destroy_process_group()
