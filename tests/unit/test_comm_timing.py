"""The agent's communication timing on real torch.distributed (gloo, one rank, in
this process): DDP's hook registered or wrapped, collectives and Work.wait
timed, everything put back on uninstall."""

from __future__ import annotations

import threading
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
from traceml.collector.rank_steps import merge_events
from traceml.collector.steps import StepTiming, StepTracker
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
    probe = Probe(time.perf_counter, errors.append)
    inst = Instrumentation(probe)
    inst.install()
    try:
        yield probe
    finally:
        inst.uninstall()
    assert errors == []


def _train(model: nn.Module, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def _steps(probe: Probe) -> list[StepTiming]:
    """The steps the collector makes of what the probe logged so far."""
    done: list[StepTiming] = []
    tracker = StepTracker(done.append)
    times, _ = probe.take(float("inf"))
    tracker.replay(merge_events(times, [], [], [list(s) for s in probe.take_spans()]))
    tracker.close()
    return done


def test_ddp_keeps_its_own_hook_and_its_wait_is_timed(probe: Probe) -> None:
    model = DDP(_net())
    _train(model)
    assert model._comm_hooks == []  # torch's C++ all-reduce, no Python hook per bucket
    steps = _steps(probe)
    assert [t.counts[COMM] for t in steps] == [1, 1]  # each backward: DDP's wait
    assert probe.spans == []  # DDP's own buckets are not spans: in flight not measured
    assert all(t.collective_s is None for t in steps)


def test_the_wait_at_the_end_of_backward_is_communication_not_backward(probe: Probe) -> None:
    # A bucket that completes 50 ms late (a slow link): DDP's reducer waits for it
    # after backward's compute, and that wait must read as communication.
    def late(state, bucket):  # type: ignore[no-untyped-def]  (torch checks the annotation)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        buffer = bucket.buffer()
        threading.Timer(0.05, lambda: future.set_result(buffer)).start()
        return future

    model = DDP(_net())
    model.register_comm_hook(None, late)
    _train(model)
    steps = _steps(probe)
    assert len(steps) == 2
    for step in steps:
        # The bucket is late by 50 ms from its hook, inside backward: what backward
        # computed after the hook is all that may shorten the wait.
        backward = step.phase_s[phases.code("backward")]
        assert step.phase_s[COMM] >= 0.05 - backward
        assert backward < 0.04 and step.phase_s[COMM] > backward
        assert step.collective_s is not None and step.collective_s >= step.phase_s[COMM] * 0.9


@pytest.mark.parametrize("options", [
    {"static_graph": True}, {"find_unused_parameters": True},
    {"gradient_as_bucket_view": True}, {}])  # {}: buffers broadcast before forward
def test_ddp_options_train_as_without_the_agent(group: None, options: dict[str, Any]) -> None:
    def train(instrumented: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
        probe = Probe(time.perf_counter, lambda exc: (_ for _ in ()).throw(exc))
        inst = Instrumentation(probe)
        if instrumented:
            inst.install()
        try:
            model = DDP(net, **options)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(4):
                opt.zero_grad()
                loss = model(torch.randn(8, 16, generator=torch.Generator().manual_seed(i)))
                if i == 1:  # gradient accumulation without a sync, then with one
                    with model.no_sync():
                        loss.sum().backward()
                    continue
                loss.sum().backward(retain_graph=i == 2)
                opt.step()
            return [p.detach().clone() for p in net.parameters()]
        finally:
            inst.uninstall()
    for a, b in zip(train(True), train(False)):
        assert torch.equal(a, b)


def test_a_kept_graph_gets_one_exposed_wait_per_backward(probe: Probe) -> None:
    model = DDP(_net())
    loss = model(torch.randn(4, 16)).sum()
    for _ in range(4):
        loss.backward(retain_graph=True)
    assert len(probe.streams[COMM]) == 4  # not 1, 3, 6, 10: each prehook goes once fired


def test_an_agent_failure_in_backward_never_reaches_the_training(
        group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[BaseException] = []
    probe = Probe(time.perf_counter, errors.append)
    inst = Instrumentation(probe)
    inst.install()
    try:
        model = DDP(_net())
        import traceml.agent.comm as comm

        def broken() -> Any:
            raise RuntimeError("engine gone")
        monkeypatch.setattr(comm, "_engine", broken)
        model(torch.randn(4, 16)).sum().backward()  # the user's backward still works
    finally:
        inst.uninstall()
    assert [str(e) for e in errors] == ["engine gone"]


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
    worker = threading.Thread(target=dist.all_reduce, args=(torch.ones(2),))
    worker.start()
    worker.join()
    assert probe.streams[COMM] == [] and probe.spans == []


def test_uninstall_puts_every_function_back(group: None) -> None:
    before = {name: getattr(dist, name) for name in ("all_reduce", "barrier", "all_gather")}
    wait, register, init = dist.Work.wait, DDP.register_comm_hook, DDP._ddp_init_helper
    comm = CommTiming(Probe(time.perf_counter, lambda e: None), lambda: False)
    comm.install()
    assert dist.all_reduce is not before["all_reduce"] and dist.Work.wait is not wait
    comm.uninstall()
    assert {name: getattr(dist, name) for name in before} == before
    assert dist.Work.wait is wait and DDP.register_comm_hook is register
    assert DDP._ddp_init_helper is init
