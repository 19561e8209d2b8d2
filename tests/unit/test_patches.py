"""The real patches on real torch, in this process: counts, exclusivity,
GradScaler skips, activation checkpointing, and a clean uninstall."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from traceml.agent.patches import Instrumentation
from traceml.agent.probe import Probe
from traceml.agent.steps import StepTiming, StepTracker


@pytest.fixture
def steps() -> Iterator[list[StepTiming]]:
    out: list[StepTiming] = []
    tracker = StepTracker(out.append)
    errors: list[BaseException] = []
    inst = Instrumentation(Probe(tracker, time.perf_counter, errors.append))
    inst.install()
    try:
        yield out
    finally:
        inst.uninstall()
        tracker.close()
    assert errors == []


def _loader(n: int = 6) -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(TensorDataset(torch.randn(n * 4, 8), torch.randn(n * 4, 1)), batch_size=4)


def test_plain_loop(steps: list[StepTiming]) -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _loader():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    steps_seen = len(steps) + 1  # the last one closes at exit
    assert steps_seen == 6
    assert all(t.counts == (1, 1, 1, 1) for t in steps)


def test_activation_checkpointing_counts_forward_once(steps: list[StepTiming]) -> None:
    inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    head = nn.Linear(8, 1)
    opt = torch.optim.SGD(list(inner.parameters()) + list(head.parameters()), lr=0.1)

    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return head(checkpoint(inner, x, use_reentrant=False))

    net = Net()
    for x, y in _loader(4):
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    assert len(steps) == 3
    assert all(t.counts[1] <= 1 and t.counts[2] == 1 for t in steps)


def test_grad_scaler_skip_is_recognised(steps: list[StepTiming]) -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for i, (x, y) in enumerate(_loader(4)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if i == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert len(steps) == 3
    assert [t.num_skipped for t in steps] == [0, 1, 0]


def test_uninstall_restores_torch() -> None:
    before = (nn.Module.__call__, torch.Tensor.backward, torch.autograd.backward)
    tracker = StepTracker(lambda t: None)
    inst = Instrumentation(Probe(tracker, time.perf_counter, lambda e: None))
    inst.install()
    assert nn.Module.__call__ is not before[0]
    inst.uninstall()
    assert (nn.Module.__call__, torch.Tensor.backward, torch.autograd.backward) == before


def test_internal_error_fails_open() -> None:
    errors: list[BaseException] = []

    def boom(t: StepTiming) -> None:
        raise RuntimeError("agent bug")

    probe = Probe(StepTracker(boom), time.perf_counter, errors.append)
    inst = Instrumentation(probe)
    inst.install()
    try:
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _loader(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # training goes on although the tracker raises
    finally:
        inst.uninstall()
    assert errors and "agent bug" in str(errors[0])
