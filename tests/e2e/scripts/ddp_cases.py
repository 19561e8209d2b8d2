"""2-rank gloo DDP with one injected slowdown (never imports traceml).

``--case``:
  balanced   nothing injected
  backward   ``--slow-rank`` spends ``--delay-ms`` more inside backward, before
             its gradients are ready (so before any all-reduce)
  between    ``--slow-rank`` spends ``--delay-ms`` of host work after its
             optimizer step, before its next fetch (logging, a sync, I/O)
  network    every rank's gradient all-reduce ends ``--delay-ms`` later (a
             communication hook of the script's own, like a slow link)
  hook       the script registers a hook that sums instead of averaging; the
             evidence file says whether the update used the sum
"""

# No `from __future__ import annotations`: torch checks a comm hook's
# ``bucket`` annotation against dist.GradBucket itself, not its string.
import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset


class Device(torch.autograd.Function):
    """Identity; its forward and backward sleep, standing in for device time (a
    GPU's kernels), so a loaded 2-core host's CPU noise is a small part of a step."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class Net(nn.Module):
    """A small MLP (real CPU work) with 4 ms of forward and 6 ms of backward
    device time; ``slow_backward_s`` more at the top of backward, before any
    parameter's gradient is ready."""

    def __init__(self, slow_backward_s: float) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(128, 128), nn.ReLU())
                                      for _ in range(6)), nn.Linear(128, 1))
        self.slow_backward_s = slow_backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = Device.apply(x, 0.002, 0.003)
        out = self.layers(x)
        return Device.apply(out, 0.002, 0.003 + self.slow_backward_s)


def slow_network(delay_s: float) -> Any:
    """The step's last all-reduce completes ``delay_s`` late (on gloo's thread)."""
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = default_hooks.allreduce_hook(state, bucket)
        if not bucket.is_last():
            return future

        def late(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            time.sleep(delay_s)
            return fut.value()
        return future.then(late)
    return hook


def summing(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    work = dist.all_reduce(bucket.buffer(), group=state, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="balanced")
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--delay-ms", type=float, default=15.0)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    delay_s = args.delay_ms / 1e3
    slowed = rank == args.slow_rank
    net = Net(delay_s if args.case == "backward" and slowed else 0.0)
    model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.1)
    if args.case == "network":
        model.register_comm_hook(None, slow_network(delay_s))
    elif args.case == "hook":
        model.register_comm_hook(None, summing)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)
    batch = 64
    data = TensorDataset(torch.randn(args.steps * batch, 128), torch.randn(args.steps * batch, 1))
    evidence: dict[str, Any] = {"rank": rank}
    for i, (x, y) in enumerate(DataLoader(data, batch_size=batch)):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i == 0:
            bias = net.layers[-1].bias
            evidence["grad"] = bias.grad.item()
            local = nn.functional.mse_loss(net.layers(x), y)
            evidence["local_grad"] = torch.autograd.grad(local, bias)[0].item()
        opt.step()
        if args.case == "between" and slowed:
            time.sleep(delay_s)
    total = torch.tensor([evidence["local_grad"]])
    dist.all_reduce(total)
    evidence["sum_of_local_grads"] = total.item()
    out_dir = os.environ.get("EVIDENCE_DIR")
    if out_dir:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(evidence, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
