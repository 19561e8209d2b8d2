"""A Lightning Trainer on a tiny MLP: `traceml run examples/frameworks/train_lightning.py`,
or with two DDP ranks on gloo: `traceml run --nproc-per-node=2 examples/frameworks/train_lightning.py`.

Lightning takes the ranks from torchelastic's environment.  It never imports
traceml unless you pass --callback (traceml.integrations.lightning.TraceMLCallback).
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: list[torch.Tensor], idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def random_loader(num_rows: int) -> DataLoader:  # type: ignore[type-arg]
    data = TensorDataset(torch.randn(num_rows, 256), torch.randint(0, 10, (num_rows,)))
    return DataLoader(data, batch_size=64)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--callback", action="store_true")
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    callbacks = []
    if args.callback:
        from traceml.integrations.lightning import TraceMLCallback

        callbacks.append(TraceMLCallback())
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp" if world_size > 1 else "auto",
        max_steps=args.steps, accumulate_grad_batches=args.accum, val_check_interval=10,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=callbacks,
    )
    num_rows = args.steps * args.accum * 64 * world_size
    trainer.fit(Classifier(), random_loader(num_rows), random_loader(128))


if __name__ == "__main__":
    main()
