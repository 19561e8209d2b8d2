"""``TraceMLCallback`` for ``transformers.Trainer``: exact step boundaries (user process).

    from traceml.integrations.huggingface import TraceMLCallback
    trainer = Trainer(..., callbacks=[TraceMLCallback()])

Under ``traceml run`` one traceml step spans ``on_step_begin`` to
``on_step_end``: the batch fetches of the step (the Trainer fetches every
micro-batch of a gradient-accumulation window first), forward and backward
of every micro-batch, clipping and the optimizer step.  Logging, evaluation
and checkpoints run after ``on_step_end`` and stay out of the steps.  Without
``traceml run`` it does nothing and warns once.
"""

from __future__ import annotations

from typing import Any

from traceml.integrations.boundaries import StepBoundaries
from traceml.integrations.requirement import missing_framework

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:
    raise missing_framework("huggingface", "transformers", "hf") from exc

__all__ = ["TraceMLCallback"]


class TraceMLCallback(TrainerCallback):
    """One traceml step per optimizer step of the Trainer."""

    def __init__(self) -> None:
        self._steps = StepBoundaries("traceml.integrations.huggingface.TraceMLCallback")

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        self._steps.begin()

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        self._steps.end()
