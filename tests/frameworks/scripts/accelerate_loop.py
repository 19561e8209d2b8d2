"""A plain training loop driven by Hugging Face Accelerate on a tiny MLP.

Never imports traceml unless ``--log-to``, which logs ``traceml.summary()``
from rank 0 at the end.  ``accelerator.accumulate`` handles gradient
accumulation: the wrapped optimizer only steps every ``--accum`` batches.
"""

from __future__ import annotations

import argparse
import time

import torch
from accelerate import Accelerator
from tiny_data import Pairs, write_evidence
from torch import nn
from torch.utils.data import DataLoader


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N optimizer steps")
    p.add_argument("--eval-rows", type=int, default=16)
    p.add_argument("--eval-sleep-ms", type=float, default=0.0)
    p.add_argument("--after-eval-sleep-ms", type=float, default=0.0,
                   help="work after each evaluation pass (metrics, checkpoint)")
    p.add_argument("--raw-eval-loader", action="store_true",
                   help="evaluate with a plain DataLoader (not prepared by Accelerate)")
    p.add_argument("--input-sleep-ms", type=float, default=0.0)
    p.add_argument("--log-to", choices=["wandb", "mlflow"], default=None,
                   help="on rank 0, log traceml.summary() there at the end")
    return p.parse_args()


def evaluate(accelerator: Accelerator, model: nn.Module, loader: DataLoader) -> int:  # type: ignore[type-arg]
    """One evaluation pass; returns how many batches it saw."""
    model.eval()
    num_batches = 0
    with torch.no_grad():
        for x, y in loader:
            accelerator.gather(nn.functional.mse_loss(model(x), y))
            num_batches += 1
    model.train()
    return num_batches


def log_summary(target: str) -> str:
    """The run so far, from inside the training script (R-API-4)."""
    import traceml

    summary = traceml.summary()
    assert summary, "traceml.summary() is empty"
    if target == "wandb":
        from traceml.integrations.wandb import log_summary as to_wandb

        return to_wandb(summary)
    from traceml.integrations.mlflow import log_summary as to_mlflow

    return to_mlflow(summary)


def main() -> None:
    a = parse()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=a.accum)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = a.steps * a.accum * a.batch * accelerator.num_processes
    train = DataLoader(Pairs(rows, a.input_sleep_ms), batch_size=a.batch)
    val = DataLoader(Pairs(a.eval_rows, a.eval_sleep_ms), batch_size=a.batch)
    model, optimizer, train = accelerator.prepare(model, optimizer, train)
    if not a.raw_eval_loader:
        val = accelerator.prepare(val)
    num_steps = num_eval_batches = 0
    for x, y in train:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            num_steps += 1
            if a.eval_every and num_steps % a.eval_every == 0:
                num_eval_batches += evaluate(accelerator, model, val)
                time.sleep(a.after_eval_sleep_ms / 1e3)
    run_id = log_summary(a.log_to) if a.log_to and accelerator.is_main_process else None
    write_evidence(optimizer_steps=num_steps, world_size=accelerator.num_processes,
                   evaluations=num_eval_batches, run_id=run_id)
    accelerator.end_training()


if __name__ == "__main__":
    main()
