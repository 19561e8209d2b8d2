"""What each training batch holds: samples and tokens per step (agent side).

The rule (README, "Throughput"): a batch is what the DataLoader fetch returned,
or, in a loop without a DataLoader, what the outermost training forward
received (its positional arguments, else its keyword arguments).  Its first
tensor, depth first through tuples, lists, dicts (in key order) and
dataclasses, gives the samples: its leading dimension.  When that tensor is
2-D with an integer dtype it holds token ids, and its element count gives the
tokens (padding included).  No tensor, or a 0-d one: the batch is not
measured (None), never guessed.

The walk runs once: the path to the first tensor is kept as a chain of C-level
getters, so a batch costs a few getter calls and one shape compare.  Only a
change (a new shape, the last short batch of an epoch) is logged, as one
record `wire.events.BATCH_FIELDS`; the collector credits every fetch (or forward)
with the record in effect (`traceml.collector.steps`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

from traceml.agent.probe import Probe
from traceml.wire.events import BATCH_FROM_FETCH

MAX_DEPTH = 4  # nesting levels searched for the first tensor
MAX_ITEMS = 32  # items per level searched
_INTEGER_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
_FORCE = object()  # a "last shape" no batch has: the next batch takes the slow path

Getter = Callable[[Any], Any]


def first_tensor_path(batch: Any, depth: int = 0) -> tuple[Getter, ...] | None:
    """The getters leading from ``batch`` to its first tensor; None when there is none."""
    if isinstance(batch, torch.Tensor):
        return ()
    if depth >= MAX_DEPTH:
        return None
    steps: list[tuple[Getter, Any]] = []
    if isinstance(batch, (tuple, list)):
        steps = [(operator.itemgetter(i), v) for i, v in enumerate(batch[:MAX_ITEMS])]
    elif isinstance(batch, Mapping):
        steps = [(operator.itemgetter(k), batch[k]) for k in list(batch)[:MAX_ITEMS]]
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        steps = [(operator.attrgetter(f.name), getattr(batch, f.name, None))
                 for f in dataclasses.fields(batch)[:MAX_ITEMS]]
    for get, value in steps:
        rest = first_tensor_path(value, depth + 1)
        if rest is not None:
            return (get, *rest)
    return None


def batch_size(tensor: torch.Tensor | None) -> tuple[int | None, int | None]:
    """(samples, tokens) of a batch whose first tensor is ``tensor`` (see the rule)."""
    if tensor is None or tensor.dim() == 0:
        return None, None
    tokens = tensor.numel() if tensor.dim() == 2 and tensor.dtype in _INTEGER_DTYPES else None
    return int(tensor.shape[0]), tokens


class BatchWatch:
    """One source of batches (the DataLoader fetch, or the forward): logs its
    batches' sizes when they change, and tells the FLOP counter of new shapes."""

    def __init__(self, probe: Probe, source: int,
                 on_shape: Callable[[Any, float], float | None],
                 on_error: Callable[[BatchWatch, BaseException], None]) -> None:
        self.probe = probe
        self.source = source
        self.getters: tuple[Getter, ...] | None = None
        self.shape: Any = _FORCE
        # (shape key, time) -> FLOPs per step known for that shape (it may start a count)
        self.on_shape = on_shape
        self.on_error = on_error
        # Called after a batch that took the slow path (forced or new), whatever it holds.
        self.after_batch: Callable[[], None] | None = None

    def force(self) -> None:
        """Take the slow path at the next batch (another thread may call it)."""
        self.shape = _FORCE

    def see(self, batch: Any, t: float) -> None:
        """Training thread, once per batch: the fast path is a shape compare."""
        x = batch
        try:
            for get in self.getters or ():
                x = get(x)
            shape = x.shape
        except Exception:
            shape = None
        try:
            if shape == self.shape:  # a batch without a tensor: None both times
                return
        except Exception:  # not a tensor's shape there any more: walk again
            pass
        try:
            self._changed(batch, t)
        except Exception as exc:  # this batch source goes, training stays
            self.on_error(self, exc)

    def _changed(self, batch: Any, t: float) -> None:
        path = first_tensor_path(batch)
        self.getters = path
        tensor: Any = batch
        for get in path or ():
            tensor = get(tensor)
        found = tensor if path is not None else None
        samples, tokens = batch_size(found)
        self.shape = found.shape if found is not None else None
        key = (tuple(found.shape), str(found.dtype)) if found is not None else None
        flops = self.on_shape(key, t) if key is not None else None
        if self.source == BATCH_FROM_FETCH:
            self.probe.forward_watch = None  # a loop with a DataLoader: its fetches say
        self.probe.batches.append((t, samples, tokens, flops, self.source))
        after = self.after_batch
        if after is not None:  # a profiler capture's due work, at a batch (`agent.capture`)
            after()
