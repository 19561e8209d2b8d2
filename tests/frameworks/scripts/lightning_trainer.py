"""A Lightning Trainer on a tiny MLP (automatic optimization: forward and backward
run inside ``optimizer.step(closure)``).

Never imports traceml unless ``--callback``.  Under ``traceml run
--nproc-per-node=2`` it trains with strategy ``ddp`` on gloo, taking the ranks
from torchelastic's environment.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import lightning as L
import torch
from tiny_data import Pairs, write_evidence
from torch import nn
from torch.utils.data import DataLoader


class Net(nn.Sequential):
    """An MLP whose forward can be made slow (a known forward time)."""

    def __init__(self, forward_sleep_ms: float) -> None:
        super().__init__(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        self.forward_sleep_s = forward_sleep_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_sleep_s and torch.is_grad_enabled():
            time.sleep(self.forward_sleep_s)
        return super().forward(x)


class Regressor(L.LightningModule):
    def __init__(self, forward_sleep_ms: float = 0.0, after_eval_sleep_ms: float = 0.0) -> None:
        super().__init__()
        self.net = Net(forward_sleep_ms)
        self.after_eval_sleep_s = after_eval_sleep_ms / 1e3
        self.num_eval_batches = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> None:
        x, y = batch
        self.num_eval_batches += 1
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        time.sleep(self.after_eval_sleep_s)  # work after a validation pass (metrics, ...)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class UserWork(L.Callback):
    """Work a user's callback does after each optimizer step (after TraceMLCallback's)."""

    def __init__(self, after_step_ms: float) -> None:
        self.after_step_s = after_step_ms / 1e3
        self.last_global_step = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step != self.last_global_step:
            self.last_global_step = trainer.global_step
            time.sleep(self.after_step_s)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0, help="validate every N optimizer steps")
    p.add_argument("--eval-rows", type=int, default=16)
    p.add_argument("--eval-sleep-ms", type=float, default=0.0)
    p.add_argument("--after-eval-sleep-ms", type=float, default=0.0)
    p.add_argument("--input-sleep-ms", type=float, default=0.0)
    p.add_argument("--forward-sleep-ms", type=float, default=0.0)
    p.add_argument("--after-step-sleep-ms", type=float, default=0.0)
    p.add_argument("--callback", action="store_true")
    return p.parse_args()


def loaders(a: argparse.Namespace, world: int) -> tuple[DataLoader, DataLoader | None]:  # type: ignore[type-arg]
    rows = a.steps * a.accum * a.batch * world
    train = DataLoader(Pairs(rows, a.input_sleep_ms), batch_size=a.batch)
    if not a.eval_every:
        return train, None
    return train, DataLoader(Pairs(a.eval_rows, a.eval_sleep_ms), batch_size=a.batch)


def main() -> None:
    a = parse()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    callbacks: list[L.Callback] = []
    if a.callback:
        from traceml.integrations.lightning import TraceMLCallback

        callbacks.append(TraceMLCallback())
    callbacks.append(UserWork(a.after_step_sleep_ms))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
        max_steps=a.steps, accumulate_grad_batches=a.accum,
        val_check_interval=a.eval_every * a.accum or None, limit_val_batches=1.0 if a.eval_every else 0,
        num_sanity_val_steps=2 if a.eval_every else 0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    train, val = loaders(a, world)
    module = Regressor(a.forward_sleep_ms, a.after_eval_sleep_ms)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    write_evidence(optimizer_steps=trainer.global_step, world_size=trainer.world_size,
                   evaluations=module.num_eval_batches)


if __name__ == "__main__":
    main()
