"""transformers.Trainer on a tiny GPT-2 built from a config (no downloads):
`traceml run examples/frameworks/train_hf.py`.

It never imports traceml unless you pass --callback, which adds
traceml.integrations.huggingface.TraceMLCallback for exact step boundaries.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(Dataset):  # type: ignore[type-arg]
    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--callback", action="store_true")
    args = parser.parse_args()
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=2, n_head=4)
    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="traceml-hf-"), max_steps=args.steps,
        per_device_train_batch_size=8, gradient_accumulation_steps=args.accum,
        eval_strategy="steps", eval_steps=10, logging_strategy="no", save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True,
    )
    callbacks = []
    if args.callback:
        from traceml.integrations.huggingface import TraceMLCallback

        callbacks.append(TraceMLCallback())
    trainer = Trainer(model=GPT2LMHeadModel(config), args=training, callbacks=callbacks,
                      train_dataset=RandomTokens(args.steps * args.accum * 8),
                      eval_dataset=RandomTokens(32))
    trainer.train()


if __name__ == "__main__":
    main()
