"""``TraceMLCallback`` for the Lightning ``Trainer``: exact step boundaries (user process).

    from traceml.integrations.lightning import TraceMLCallback
    trainer = L.Trainer(..., callbacks=[TraceMLCallback()])

Under ``traceml run`` a traceml step begins at ``on_train_batch_start`` and
ends at the ``on_train_batch_end`` after which ``trainer.global_step`` has
moved, so gradient accumulation (several batches per optimizer step) makes
one step.  Validation runs after the batch ends and stays out of the steps.
Without ``traceml run`` it does nothing and warns once.

Works with ``lightning`` (``lightning.pytorch``) or, without it, the older
``pytorch_lightning`` package.
"""

from __future__ import annotations

from typing import Any

from traceml.integrations.boundaries import StepBoundaries
from traceml.integrations.requirement import missing_framework

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:
    try:
        from pytorch_lightning import (  # type: ignore[assignment]
            Callback,
            LightningModule,
            Trainer,
        )
    except ImportError as exc:
        raise missing_framework("lightning", "lightning", "lightning") from exc

__all__ = ["TraceMLCallback"]


class TraceMLCallback(Callback):
    """One traceml step per optimizer step of the Trainer."""

    def __init__(self) -> None:
        self._steps = StepBoundaries("traceml.integrations.lightning.TraceMLCallback")
        self._global_step_at_begin: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A new fit: a window left open by an earlier one would never see its step move.
        self._global_step_at_begin = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._global_step_at_begin is None:
            self._global_step_at_begin = trainer.global_step
            self._steps.begin()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        begun = self._global_step_at_begin
        if begun is not None and trainer.global_step != begun:
            self._global_step_at_begin = None
            self._steps.end()
