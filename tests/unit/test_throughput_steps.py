"""Samples, tokens and FLOPs per step in the collector's step tracker (hand-built event
logs, fake clock), the batch rule of the agent's batch watch, and the wire checks."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from tests.raw_wire import empty_times
from tests.unit.test_steps import Script
from traceml.agent.batch import BatchWatch, batch_size, first_tensor_path
from traceml.agent.probe import Probe
from traceml.errors import ProtocolError
from traceml.wire.envelope import Envelope, decode, encode
from traceml.wire.events import (
    BACKWARD,
    BATCH,
    BATCH_FROM_FETCH,
    BATCH_FROM_FORWARD,
    CLOSE,
    END,
    FLOP_COUNT,
    FORWARD,
    INPUT,
    NOGRAD_FORWARD,
    OPTIMIZER,
    EventBatch,
)
from traceml.wire.identity import Sender


def batch(s: Script, samples: int | None, tokens: int | None = None,
          flops: float | None = None, source: int = BATCH_FROM_FETCH) -> None:
    s.events.append((BATCH, (samples, tokens, flops, source)))


def count(s: Script, flops: float | None, ran: bool = True) -> None:
    s.events.append((FLOP_COUNT, (flops, "fp32", 1.0, "cpu", None, None, ran)))


def fetch(s: Script, samples: int | None = None, changed: bool = False, **kw: Any) -> None:
    """A fetch whose batch record (when it changed) is logged as the fetch ends."""
    s.log(INPUT)
    s.t += 1
    if changed:
        batch(s, samples, **kw)
    s.log(END)


def test_every_fetch_of_a_step_adds_its_batch_and_eval_fetches_do_not() -> None:
    s = Script()
    fetch(s, 8, changed=True, tokens=8 * 16)
    for _ in range(3):  # gradient accumulation: 4 micro-batches
        s.phase(FORWARD, 1)
        s.phase(BACKWARD, 1)
        fetch(s)
    s.phase(FORWARD, 1)
    s.phase(BACKWARD, 1)
    s.phase(OPTIMIZER, 1)
    s.eval_pass(3)  # fetches for evaluation: dropped
    fetch(s, 3, changed=True, tokens=3 * 16)  # the last, short batch
    s.phase(FORWARD, 1)
    s.phase(BACKWARD, 1)
    s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    assert [(t.samples, t.tokens) for t in s.steps] == [(32, 512), (3, 48)]


def test_a_batch_that_could_not_be_read_leaves_the_step_unmeasured() -> None:
    s = Script()
    fetch(s, 8, changed=True)
    s.train_iter(fetch=0)
    fetch(s, None, changed=True)
    s.train_iter(fetch=0)
    s.log(CLOSE)
    assert [t.samples for t in s.steps] == [8, None]
    assert [t.tokens for t in s.steps] == [None, None]  # no token ids in either


def test_without_a_dataloader_each_counted_forward_adds_its_inputs() -> None:
    s = Script()
    for _ in range(3):
        batch(s, 4, source=BATCH_FROM_FORWARD)
        s.phase(FORWARD, 1)
        s.phase(FORWARD, 1, count=False)  # a loss module: no samples
        s.phase(BACKWARD, 1)
        s.phase(OPTIMIZER, 1)
    s.log(CLOSE)
    assert [t.samples for t in s.steps] == [4, 4, 4]
    assert s.steps[0].tokens is None  # no token ids


def test_no_batch_seen_is_not_measured() -> None:
    s = Script()
    for _ in range(2):
        s.train_iter()
    s.log(CLOSE)
    assert [t.samples for t in s.steps] == [None, None]


def test_the_counted_step_is_marked_and_its_count_carries_on() -> None:
    s = Script()
    fetch(s, 8, changed=True)
    s.train_iter(fetch=0)
    fetch(s, 8, changed=True)  # armed: a forced record, the count starts
    s.train_iter(fetch=0)
    count(s, 600.0)  # ...and ends after the optimizer step
    for _ in range(2):
        s.train_iter()
    fetch(s, 4, changed=True)  # a new shape: counted once more
    s.train_iter(fetch=0)
    count(s, 300.0)
    fetch(s, 8, changed=True, flops=600.0)  # a shape counted before: its record says
    s.train_iter(fetch=0)
    s.log(CLOSE)
    assert [t.flops for t in s.steps] == [None, 600.0, 600.0, 600.0, 300.0, 600.0]
    assert [t.flops_counted for t in s.steps] == [False, True, False, False, True, False]
    assert [t.samples for t in s.steps] == [8, 8, 8, 8, 4, 8]


def test_an_abstaining_count_that_did_not_run_marks_nothing() -> None:
    s = Script()
    fetch(s, 8, changed=True)
    s.train_iter(fetch=0)
    count(s, None, ran=False)  # torch.compile ran: nothing was counted
    s.train_iter()
    s.log(CLOSE)
    assert [t.flops_counted for t in s.steps] == [False, False]
    assert [t.flops for t in s.steps] == [None, None]


def test_an_evaluation_forward_does_not_count_forward_samples() -> None:
    s = Script()
    batch(s, 4, source=BATCH_FROM_FORWARD)
    s.phase(FORWARD, 1)
    s.phase(BACKWARD, 1)
    s.phase(OPTIMIZER, 1)
    s.log(NOGRAD_FORWARD)  # no grad: not a forward phase
    s.gap(1)
    s.log(CLOSE)
    assert [t.samples for t in s.steps] == [4]


# --- the agent's batch rule --------------------------------------------------------


@dataclasses.dataclass
class Sample:
    meta: str
    pixels: torch.Tensor


@pytest.mark.parametrize(("batch_obj", "expected"), [
    (torch.zeros(8, 3), (8, None)),
    ((torch.zeros(8, 3), torch.zeros(8)), (8, None)),
    ({"input_ids": torch.zeros(4, 16, dtype=torch.long), "labels": torch.zeros(4, 16)},
     (4, 64)),
    ([("text", {"ids": torch.zeros(2, 5, dtype=torch.int32)})], (2, 10)),
    (Sample("x", torch.zeros(6, 3, 4, 4)), (6, None)),
    ((torch.tensor(3.0),), (None, None)),  # 0-d: no batch dimension
    ({"name": "no tensor"}, (None, None)),
    (torch.zeros(4, 16, dtype=torch.bool), (4, None)),  # a mask, not token ids
])
def test_the_batch_rule(batch_obj: Any, expected: tuple[int | None, int | None]) -> None:
    path = first_tensor_path(batch_obj)
    tensor = batch_obj
    for get in path or ():
        tensor = get(tensor)
    assert batch_size(tensor if path is not None else None) == expected


def test_the_watch_logs_only_changes() -> None:
    probe = Probe(lambda: 0.0, lambda exc: None)
    seen: list[Any] = []
    watch = BatchWatch(probe, BATCH_FROM_FETCH, lambda key, t: seen.append(key) or None,
                       lambda w, exc: pytest.fail(repr(exc)))
    for i, n in enumerate((8, 8, 8, 3, 8)):
        watch.see({"x": torch.zeros(n, 2), "y": torch.zeros(n)}, float(i))
    assert [(r[0], r[1]) for r in probe.batches] == [(0.0, 8), (3.0, 3), (4.0, 8)]
    assert seen == [((8, 2), "torch.float32"), ((3, 2), "torch.float32"),
                    ((8, 2), "torch.float32")]
    watch.force()  # the sender arms a count: the next batch takes the slow path
    watch.see({"x": torch.zeros(8, 2)}, 5.0)
    assert len(probe.batches) == 4


# --- the wire -----------------------------------------------------------------------


def payload(**kw: Any) -> dict[str, Any]:
    """An events payload as the collector reads it off the wire (JSON lists)."""
    return json.loads(json.dumps(EventBatch(0, 0.0, empty_times(), **kw).payload()))


def test_batches_and_counts_are_checked() -> None:
    good = EventBatch(0, 0.0, empty_times(), batches=[(1.0, 8, None, None, BATCH_FROM_FETCH)],
                      flop_counts=[(2.0, 6e9, "bf16", 0.9, "NVIDIA H200", 132, None, True)])
    message = decode(encode(Envelope("s", Sender("rank", "h", 1, 0, 0), 0, 0.0, good))).message
    assert isinstance(message, EventBatch)
    checked = message
    assert checked.batches == [[1.0, 8, None, None, 0]]
    assert checked.flop_counts[0][1] == 6e9
    for bad in (payload(batches=[(1.0, "8", None, None, 0)]),
                payload(batches=[(1.0, 8, None, None, 7)]),
                payload(flop_counts=[(2.0, 6e9, "bf16", 0.9, "x", 132, None, "yes")])):
        with pytest.raises(ProtocolError):
            EventBatch.from_payload(bad)
