"""The agent's communication timing on real torch.distributed (gloo, one rank, in
this process): DDP's hook registered or wrapped, collectives and Work.wait
timed, everything put back on uninstall."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from traceml import phases
from traceml.agent.comm import CommTiming
from traceml.agent.patches import Instrumentation
from traceml.agent.probe import Probe
from traceml.protocol import END

COMM = phases.code("communication")


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def probe(group: None) -> Iterator[Probe]:
    errors: list[BaseException] = []
    warnings: list[str] = []
    probe = Probe(time.perf_counter, errors.append)
    inst = Instrumentation(probe, warnings.append)
    inst.install()
    try:
        yield probe
    finally:
        inst.uninstall()
    assert errors == [] and warnings == []


def _train(model: nn.Module, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def test_ddp_keeps_its_own_hook_and_its_wait_is_timed(probe: Probe) -> None:
    model = DDP(_net())
    _train(model)
    assert model._comm_hooks == []  # torch's C++ all-reduce, no Python hook per bucket
    # Each backward: the exposed wait opened when compute ended, closed after DDP's.
    opened = probe.streams[COMM]
    assert len(opened) == 2
    closes = [t for t in probe.streams[END] if any(0 < t - o < 0.5 for o in opened)]
    assert len(closes) >= 2
    assert probe.spans == []  # DDP's own buckets are not spans: in flight not measured


def test_the_scripts_hook_runs_and_its_result_is_used(probe: Probe) -> None:
    model = DDP(_net())
    calls: list[Any] = []

    # Unannotated: torch compares the annotation object with dist.GradBucket, and
    # this module's annotations are strings.
    def doubling(state, bucket):  # type: ignore[no-untyped-def]
        calls.append(state)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer() * 2)
        return future

    model.register_comm_hook("my-state", doubling)
    net = model.module
    x = torch.randn(4, 16)
    model(x).sum().backward()
    assert len(probe.spans) == 1 and len(probe.streams[COMM]) == 1
    grad = net[2].bias.grad.clone()
    net.zero_grad()
    net(x).sum().backward()  # the plain gradient, without DDP
    assert calls == ["my-state"]
    assert torch.allclose(grad, 2 * net[2].bias.grad)


def test_a_builtin_hook_stays_torchs_and_its_wait_is_timed(probe: Probe) -> None:
    model = DDP(_net())
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    _train(model, steps=1)
    assert len(probe.streams[COMM]) == 1 and probe.spans == []


def test_collectives_the_script_calls_are_timed_sync_and_async(probe: Probe) -> None:
    t = torch.ones(3)
    dist.all_reduce(t)
    assert len(probe.streams[COMM]) == 1 and len(probe.spans) == 1
    work = dist.all_reduce(t, async_op=True)
    assert len(probe.spans) == 1  # in flight until waited for
    work.wait()
    assert len(probe.streams[COMM]) == 3  # the call, then the wait
    assert len(probe.streams[END]) == 3 and len(probe.spans) == 2
    dist.barrier()
    assert len(probe.spans) == 3


def test_a_collective_on_another_thread_is_not_the_trainings(probe: Probe) -> None:
    import threading

    worker = threading.Thread(target=dist.all_reduce, args=(torch.ones(2),))
    worker.start()
    worker.join()
    assert probe.streams[COMM] == [] and probe.spans == []


def test_uninstall_puts_every_function_back(group: None) -> None:
    before = {name: getattr(dist, name) for name in ("all_reduce", "barrier", "all_gather")}
    wait, register, init = dist.Work.wait, DDP.register_comm_hook, DDP.__init__
    comm = CommTiming(Probe(time.perf_counter, lambda e: None), lambda m: None)
    comm.install()
    assert dist.all_reduce is not before["all_reduce"] and dist.Work.wait is not wait
    comm.uninstall()
    assert {name: getattr(dist, name) for name in before} == before
    assert dist.Work.wait is wait and DDP.register_comm_hook is register
    assert DDP.__init__ is init
