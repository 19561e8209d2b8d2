"""A configurable tiny training loop for end-to-end tests.  Never imports traceml
(unless --trace-step).  Writes per-rank evidence to $EVIDENCE_DIR/rank<R>.json."""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __init__(self, n, input_sleep_s):
        self.n, self.input_sleep_s = n, input_sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        report_worker()
        if self.input_sleep_s:
            time.sleep(self.input_sleep_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randint(0, 4, (1,), generator=g)[0]


_reported = []


def report_worker():
    """In a DataLoader worker: record whether torch looks patched here."""
    info = torch.utils.data.get_worker_info()
    out = os.environ.get("EVIDENCE_DIR")
    if info is None or _reported or not out:
        return
    _reported.append(True)
    call = torch.nn.Module.__call__
    with open(os.path.join(out, f"worker-{os.getpid()}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "module_call": call.__module__ + "." + call.__qualname__,
                   "agent_loaded": "traceml.agent.runtime" in sys.modules and
                   sys.modules["traceml.agent.runtime"].active() is not None}, f)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--gan", action="store_true")
    p.add_argument("--closure", choices=["none", "lbfgs", "lightning"], default="none")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=3)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--mp-context", default=None)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--fail", choices=["none", "raise", "exit3", "setup"], default="none")
    p.add_argument("--input-sleep-ms", type=float, default=0.0)
    p.add_argument("--closure-sleep-ms", type=float, default=0.0)
    p.add_argument("--trace-step", action="store_true")
    p.add_argument("--no-loader", action="store_true")
    return p.parse_args()


def main():
    a = parse()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if a.compile:
        model = torch.compile(model, backend="eager")
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    disc = nn.Linear(4, 1) if a.gan else None
    if a.closure == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters(), max_iter=1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01) if disc is not None else None
    loss_fn = nn.CrossEntropyLoss()
    n = a.steps * a.accum * a.batch
    kw = {}
    if a.workers:
        kw = {"num_workers": a.workers, "multiprocessing_context": a.mp_context}
    loader = DataLoader(Slow(n, a.input_sleep_ms / 1e3), batch_size=a.batch, **kw)
    eval_loader = DataLoader(Slow(a.eval_batches * a.batch, 0), batch_size=a.batch)
    if a.trace_step:
        import traceml
    user_forwards = 0
    iterations = 0
    batches = iter(loader) if not a.no_loader else None
    fixed = next(iter(loader))
    if a.fail == "setup":  # a mistake in the script's set-up: no step ever runs
        raise RuntimeError("set-up failure on purpose")
    for it in range(a.steps):
        ctx = traceml.trace_step(model) if a.trace_step else None
        if ctx is not None:
            ctx.__enter__()
        for micro in range(a.accum):
            x, y = next(batches) if batches is not None else fixed
            if a.closure == "none":
                loss = loss_fn(model(x), y) / a.accum
                user_forwards += 1
                loss.backward()
        if a.closure != "none":
            def closure():
                nonlocal user_forwards
                opt.zero_grad()
                out = model(x)
                user_forwards += 1
                loss = loss_fn(out, y)
                loss.backward()
                if a.closure_sleep_ms:
                    time.sleep(a.closure_sleep_ms / 1e3)
                return loss
            opt.step(closure)
        else:
            opt.step()
            opt.zero_grad()
        if disc is not None:
            d_loss = disc(model(x).detach()).mean()
            d_loss.backward()
            opt_d.step()
            opt_d.zero_grad()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        iterations += 1
        if a.fail in ("raise", "exit3") and it == a.steps // 2:
            write_evidence(rank, iterations, user_forwards, a)
            if a.fail == "raise":
                raise RuntimeError("user failure on purpose")
            sys.exit(3)
        if a.eval_every and (it + 1) % a.eval_every == 0:
            with torch.no_grad():
                for ex, _ in eval_loader:
                    model(ex)
    write_evidence(rank, iterations, user_forwards, a)
    if world > 1:
        dist.destroy_process_group()


def write_evidence(rank, iterations, user_forwards, a):
    out = os.environ.get("EVIDENCE_DIR")
    if out:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "iterations": iterations, "forwards": user_forwards,
                       "pid": os.getpid(), "ppid": os.getppid()}, f)


if __name__ == "__main__":
    main()
