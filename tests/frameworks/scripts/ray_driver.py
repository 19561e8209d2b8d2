"""A Ray Train driver: the minimal TorchTrainer example of Ray Train's docs (a model
made ready with prepare_model, a DataLoader with prepare_data_loader, a report with a
checkpoint each epoch) on 2 CPU workers (gloo), connected to a running cluster.

``--traced``: the one traceml line, ``fit(trainer, ...)`` instead of ``trainer.fit()``.
``--slow-rank R --slow-ms MS``: rank R's forward takes MS longer.
``--fail-rank R --fail {raise,exit}``: rank R raises, or its process exits, mid-epoch.
``--max-failures N``: Ray restarts the worker group up to N times; rank R then fails in
its first attempt only.
Writes ``--out``: the result's metrics, or the error's type; each worker writes the
steps it took to EVIDENCE_DIR.
"""

import argparse
import json
import os
import tempfile
import time

import ray
import ray.train
import ray.train.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, slow_s):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.slow_s = slow_s

    def forward(self, x):
        time.sleep(0.005 + self.slow_s)  # device time, and the slow rank's extra
        return self.layers(x)


def first_attempt(config):
    """Always, without restarts; with them, whether this rank has not failed before."""
    if not config["max_failures"]:
        return True
    marker = os.path.join(config["evidence"], "failed-once")
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def train_func(config):
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    slow_s = config["slow_ms"] / 1e3 if rank == config["slow_rank"] else 0.0
    model = ray.train.torch.prepare_model(Net(slow_s))
    data = TensorDataset(torch.randn(config["batches"] * 16, 32), torch.randn(config["batches"] * 16, 1))
    loader = ray.train.torch.prepare_data_loader(DataLoader(data, batch_size=8, shuffle=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    for epoch in range(config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if rank == config["fail_rank"] and steps == config["fail_at"] and first_attempt(config):
                if config["fail"] == "exit":
                    os._exit(3)
                raise RuntimeError("rank failed on purpose")
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
        with open(os.path.join(config["evidence"], f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "steps": steps}, f)
        metrics = {"loss": loss.item(), "epoch": epoch}
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(model.module.state_dict(), os.path.join(tmp, "model.pt"))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--traced", action="store_true")
    p.add_argument("--logs-dir", default="./logs")
    p.add_argument("--session-id", default=None)
    p.add_argument("--html", action="store_true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batches", type=int, default=15)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-at", type=int, default=10)
    p.add_argument("--fail", choices=["raise", "exit"], default="raise")
    p.add_argument("--max-failures", type=int, default=0)
    a = p.parse_args()
    ray.init(address=a.address, log_to_driver=False)
    config = {"epochs": a.epochs, "batches": a.batches, "slow_rank": a.slow_rank,
              "slow_ms": a.slow_ms, "fail_rank": a.fail_rank, "fail_at": a.fail_at,
              "fail": a.fail, "evidence": os.environ["EVIDENCE_DIR"],
              "max_failures": a.max_failures}
    trainer = ray.train.torch.TorchTrainer(
        train_func, train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(
            storage_path=a.storage,
            failure_config=ray.train.FailureConfig(max_failures=a.max_failures)))
    out = {}
    try:
        if a.traced:
            from traceml.integrations.ray import fit
            result = fit(trainer, logs_dir=a.logs_dir, session_id=a.session_id, html=a.html)
        else:
            result = trainer.fit()
        out["metrics"] = result.metrics
    except Exception as exc:
        out["error"] = type(exc).__name__
    out["loop"] = trainer.train_loop_per_worker is train_func
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
