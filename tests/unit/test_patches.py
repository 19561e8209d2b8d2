"""The real patches on real torch, in this process: counts, exclusivity,
GradScaler skips, activation checkpointing, and a clean uninstall."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from traceml.agent.patches import Instrumentation
from traceml.agent.probe import Probe
from traceml.collector.rank_steps import merge_events
from traceml.collector.step_parts import StepTiming
from traceml.collector.steps import StepTracker


class Steps:
    """The steps of the events logged so far: the log drained as the sender
    thread does, replayed as the collector does."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.done: list[StepTiming] = []
        self.tracker = StepTracker(self.done.append)

    def __call__(self) -> list[StepTiming]:
        times, marks = self.probe.take(float("inf"))
        self.tracker.replay(merge_events(times, [list(m) for m in marks], []))
        return self.done


@pytest.fixture
def steps() -> Iterator[Steps]:
    errors: list[BaseException] = []
    probe = Probe(time.perf_counter, errors.append)
    inst = Instrumentation(probe)
    inst.install()
    try:
        yield Steps(probe)
    finally:
        inst.uninstall()
    assert errors == []


def _loader(n: int = 6) -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(TensorDataset(torch.randn(n * 4, 8), torch.randn(n * 4, 1)), batch_size=4)


def test_plain_loop(steps: Steps) -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _loader():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    done = steps()
    assert len(done) + 1 == 6  # the last one closes at exit
    assert all(t.counts == (1, 1, 1, 1, 0, 0) for t in done)
    assert not any(steps.probe.streams)  # the take emptied the log


def test_activation_checkpointing_counts_forward_once(steps: Steps) -> None:
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
    done = steps()
    assert len(done) == 3
    assert all(t.counts[1] <= 1 and t.counts[2] == 1 for t in done)


def test_grad_scaler_skip_is_recognised(steps: Steps) -> None:
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
    done = steps()
    assert len(done) == 3
    assert [t.num_skipped for t in done] == [0, 1, 0]


def test_uninstall_restores_torch() -> None:
    before = (nn.Module.__call__, torch.Tensor.backward, torch.autograd.backward)
    inst = Instrumentation(Probe(time.perf_counter, lambda e: None))
    inst.install()
    assert nn.Module.__call__ is not before[0]
    inst.uninstall()
    assert (nn.Module.__call__, torch.Tensor.backward, torch.autograd.backward) == before


class BrokenTimer:
    """A CUDA phase timer whose events fail, as after a CUDA error."""

    def start(self, phase: int) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def stop(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_failing_timer_fails_open() -> None:
    errors: list[BaseException] = []
    probe = Probe(time.perf_counter, errors.append)
    probe.cuda_timer = BrokenTimer()
    inst = Instrumentation(probe)
    inst.install()
    try:
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = model.weight.detach().clone()
        for x, y in _loader(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # training goes on although the timer raises
    finally:
        inst.uninstall()
    assert errors and "illegal memory access" in str(errors[0])
    assert not torch.equal(before, model.weight)  # the optimizer still stepped


def test_installing_does_not_import_dynamo() -> None:
    """Importing torch._dynamo has side effects on a user's process (a DDP gloo
    job that never compiles was seen hanging at exit once it was imported)."""
    code = (
        "import sys, time, torch\n"
        "from traceml.agent.patches import Instrumentation\n"
        "from traceml.agent.probe import Probe\n"
        "inst = Instrumentation(Probe(time.perf_counter, print))\n"
        "inst.install()\n"
        "torch.nn.Linear(2, 2)(torch.randn(1, 2)).sum().backward()\n"
        "inst.uninstall()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


class CountingCall:
    """What ``Module.compile()`` puts in ``_compiled_call_impl``, counted."""

    def __init__(self, module: nn.Module, calls: list[int]) -> None:
        self.module, self.calls = module, calls

    def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls.append(1)
        return self.module._call_impl(*args, **kwargs)


def test_a_module_call_patched_by_another_tool_is_called_as_it_is() -> None:
    """On torch's own ``Module.__call__`` the wrapper makes torch's dispatch
    choice itself (a compiled module goes to its compiled call); a ``__call__``
    another tool installed first is called through, and still timed."""
    torchs = nn.Module.__call__
    seen: list[str] = []

    def theirs(self: nn.Module, *args: object, **kwargs: object) -> object:
        seen.append(type(self).__name__)
        return torchs(self, *args, **kwargs)

    for foreign in (False, True):
        nn.Module.__call__ = theirs if foreign else torchs  # type: ignore[method-assign]
        probe = Probe(time.perf_counter, print)
        steps, inst = Steps(probe), Instrumentation(probe)
        inst.install()
        try:
            model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            compiled_calls: list[int] = []
            model[1]._compiled_call_impl = CountingCall(model[1], compiled_calls)
            for x, y in _loader(3):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        finally:
            inst.uninstall()
            nn.Module.__call__ = torchs  # type: ignore[method-assign]
        assert [t.counts for t in steps()] == [(1, 1, 1, 1, 0, 0)] * 2
        assert len(compiled_calls) == 3  # the nested compiled module ran compiled
        assert seen == (["Sequential", "Linear", "Linear"] * 3 if foreign else [])


def test_evaluating_the_trained_model_is_told_from_a_teacher(steps: Steps) -> None:
    from traceml.wire.events import EVAL_FORWARD, NOGRAD_FORWARD

    model, teacher = nn.Linear(8, 1), nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with torch.no_grad():
        teacher(x)
    model(x).sum().backward()
    opt.step()
    with torch.no_grad():
        model(x)  # the trained model, evaluated
        teacher(x)
    times, _ = steps.probe.take(float("inf"))
    assert len(times[EVAL_FORWARD]) == 1 and len(times[NOGRAD_FORWARD]) == 2


def test_host_to_device_copies_are_timed_outside_the_phases_only() -> None:
    # No accelerator here: the meta device stands in for one (a non-CPU result).
    from traceml.wire.events import COPY

    probe = Probe(time.perf_counter, lambda e: None)
    inst = Instrumentation(probe, copies=True)

    class Casts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.to("meta")  # inside forward: forward time
            return self.lin(x.to(torch.float32))

    model = Casts()
    inst.install()
    try:
        x = torch.randn(4, 8)
        assert x.to("meta").device.type == "meta"
        assert x.to(torch.float32) is x  # no copy: nothing logged
        model(x).sum().backward()
        assert torch.Tensor.to.__doc__ == torch._C.TensorBase.to.__doc__
    finally:
        inst.uninstall()
    assert "to" not in torch.Tensor.__dict__
    times, _ = probe.take(float("inf"))
    assert len(times[COPY]) == 1


def test_copies_are_not_patched_without_an_accelerator() -> None:
    inst = Instrumentation(Probe(time.perf_counter, lambda e: None))
    assert torch.cuda.is_available() or not any(p.name == "to" for p in inst.patches)
