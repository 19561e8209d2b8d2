"""Tiny synthetic data for the framework scripts: token sequences and regression pairs.

``sleep_ms`` makes ``__getitem__`` slow so a run is deliberately input-bound.
Writes per-rank evidence to ``$EVIDENCE_DIR/rank<R>.json`` for the tests.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torch.utils.data import Dataset

VOCAB = 64
SEQ_LEN = 16


class Tokens(Dataset):  # type: ignore[type-arg]
    """Random token ids; the labels are the inputs (causal LM)."""

    def __init__(self, num_rows: int, sleep_ms: float = 0.0) -> None:
        self.num_rows, self.sleep_s = num_rows, sleep_ms / 1e3

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


class Pairs(Dataset):  # type: ignore[type-arg]
    """Random (x, y) regression pairs."""

    def __init__(self, num_rows: int, sleep_ms: float = 0.0, dim: int = 16) -> None:
        self.num_rows, self.sleep_s, self.dim = num_rows, sleep_ms / 1e3, dim

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.dim, generator=g), torch.randn(1, generator=g)


def write_evidence(**fields: Any) -> None:
    """Per-rank facts the test compares with what traceml recorded."""
    out = os.environ.get("EVIDENCE_DIR")
    if not out:
        return
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), **fields}, f)
