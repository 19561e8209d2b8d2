"""transformers.Trainer on a 2-layer GPT-2 built from a config (no downloads).

Never imports traceml unless ``--callback``.  Options: gradient accumulation,
an evaluation pass every few steps, a slow dataset (input-bound).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
from tiny_data import Tokens, write_evidence
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class UserWork(TrainerCallback):
    """Work a user's callbacks do after each evaluation pass and after each step."""

    def __init__(self, after_eval_ms: float, after_step_ms: float) -> None:
        self.after_eval_s, self.after_step_s = after_eval_ms / 1e3, after_step_ms / 1e3

    def on_evaluate(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(self.after_eval_s)

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(self.after_step_s)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-rows", type=int, default=16)
    p.add_argument("--eval-sleep-ms", type=float, default=0.0)
    p.add_argument("--after-eval-sleep-ms", type=float, default=0.0,
                   help="work after each evaluation pass (metrics, checkpoint)")
    p.add_argument("--after-step-sleep-ms", type=float, default=0.0,
                   help="a user callback's work after each step (after TraceMLCallback's)")
    p.add_argument("--input-sleep-ms", type=float, default=0.0)
    p.add_argument("--callback", action="store_true")
    return p.parse_args()


def tiny_model() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def main() -> None:
    a = parse()
    torch.manual_seed(0)
    rows = a.steps * a.accum * a.batch * int(os.environ.get("WORLD_SIZE", "1"))
    evaluating = a.eval_every > 0
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-"), max_steps=a.steps,
        per_device_train_batch_size=a.batch, per_device_eval_batch_size=a.batch,
        gradient_accumulation_steps=a.accum, learning_rate=1e-3,
        eval_strategy="steps" if evaluating else "no", eval_steps=a.eval_every or None,
        logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=True, dataloader_num_workers=0,
    )
    callbacks: list[TrainerCallback] = []
    if a.callback:
        from traceml.integrations.huggingface import TraceMLCallback

        callbacks.append(TraceMLCallback())
    callbacks.append(UserWork(a.after_eval_sleep_ms, a.after_step_sleep_ms))
    trainer = Trainer(
        model=tiny_model(), args=args, train_dataset=Tokens(rows, a.input_sleep_ms),
        eval_dataset=Tokens(a.eval_rows, a.eval_sleep_ms) if evaluating else None,
        callbacks=callbacks,
    )
    trainer.train()
    evaluations = sum(1 for entry in trainer.state.log_history if "eval_loss" in entry)
    write_evidence(optimizer_steps=trainer.state.global_step, world_size=trainer.args.world_size,
                   evaluations=evaluations)


if __name__ == "__main__":
    main()
