"""The agent's communication timing on real torch.distributed (gloo, one rank, in
this process): DDP's hook registered or wrapped, collectives and Work.wait
timed, everything put back on uninstall."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from traceml import phases
from traceml.agent.comm import CommTiming
from traceml.agent.ddp_buckets import MAX_HOOKED_PARAMS, first_bucket
from traceml.agent.patches import Instrumentation
from traceml.agent.probe import Probe
from traceml.collector.rank_steps import merge_events
from traceml.collector.step_parts import StepTiming
from traceml.collector.steps import StepTracker
from traceml.wire.events import END

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
    _train(model, steps=4)
    assert model._comm_hooks == []  # torch's C++ all-reduce, no Python hook per bucket
    steps = _steps(probe)
    assert [t.counts[COMM] for t in steps] == [1, 1, 1, 1]  # each backward: DDP's wait
    # In flight from its first bucket's launch to the end of its wait, once DDP has
    # rebuilt its buckets (first backward) and recorded them (the next one).
    assert [t.collective_s is None for t in steps] == [True, True, False, False]
    for step in steps[2:]:
        exposed, backward = step.phase_s[COMM], step.phase_s[phases.code("backward")]
        assert step.collective_s is not None
        assert exposed <= step.collective_s <= exposed + backward


def test_in_flight_comes_from_a_hook_on_each_parameter_of_ddps_first_bucket(
        probe: Probe) -> None:
    # DDP caps its first bucket at 1 MiB: the last layer and the 600 x 600 one
    # before it (1.4 MB in all) fill it.
    net = nn.Sequential(nn.Linear(16, 600), nn.Linear(600, 600), nn.Linear(600, 1))
    model = DDP(net)
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
    hooked = [name for name, p in net.named_parameters() if p._post_accumulate_grad_hooks]
    assert hooked == ["1.weight", "1.bias", "2.weight", "2.bias"]
    probe.spans.clear()
    with model.no_sync():  # no all-reduce launched: no span
        model(torch.randn(4, 16)).sum().backward()
    assert probe.spans == []
    model(torch.randn(4, 16)).sum().backward()
    assert len(probe.spans) == 1


def test_ddps_first_bucket_record_is_read_as_ddp_writes_it() -> None:
    assert first_bucket({"rebuilt_per_bucket_param_indices": "9 8 7 6, 5 4 2 3 1 0"}) == [
        9, 8, 7, 6]
    assert first_bucket({"rebuilt_per_bucket_param_indices": "3 2 1 0"}) == [3, 2, 1, 0]
    for record in ({}, {"rebuilt_per_bucket_param_indices": ""}, None,
                   {"rebuilt_per_bucket_param_indices": "a b, 1"}):
        assert first_bucket(record) == []


def test_a_first_bucket_of_many_tiny_parameters_gets_a_bounded_number_of_hooks(
        probe: Probe) -> None:
    net = nn.Sequential(*(nn.LayerNorm(8) for _ in range(20)))
    model = DDP(net)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
    num_hooked = sum(bool(p._post_accumulate_grad_hooks) for p in net.parameters())
    assert num_hooked == MAX_HOOKED_PARAMS
    assert len(probe.spans) == 1


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
        # The bucket is late by 50 ms from its hook's call, inside backward: what
        # the hook and backward did after that call is all that may shorten the
        # wait (the hook's own time is communication too, `hook`).
        backward = step.phase_s[phases.code("backward")]
        hook = step.phase_s[phases.code("hook")]
        assert 0 < hook < 0.01
        assert step.phase_s[COMM] >= 0.05 - backward - hook
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


def test_accumulation_under_no_sync_still_gets_its_in_flight_span(probe: Probe) -> None:
    model = DDP(_net())
    added = []  # spans each backward added, by step
    for _ in range(4):  # 6 micro-batches a step, the last one synced
        before = len(probe.spans)
        counts = []
        for micro in range(6):
            loss = model(torch.randn(4, 16)).sum()
            if micro < 5:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            counts.append(len(probe.spans) - before)
            before = len(probe.spans)
        added.append(counts)
    # The record is read at synced backwards only, so the span comes by the third
    # step; a no_sync() backward launches nothing and adds none.
    assert added[2:] == [[0, 0, 0, 0, 0, 1]] * 2, added


def test_a_deleted_model_frees_what_its_first_bucket_hooked(probe: Probe) -> None:
    net = _net()
    model = DDP(net)
    _train(model, steps=3)
    hooked = next(p for p in net.parameters() if p._post_accumulate_grad_hooks)
    gone = weakref.ref(hooked)
    del model, net, hooked
    gc.collect()
    assert gone() is None


def test_a_model_with_the_scripts_hook_has_its_buckets_in_flight_one_by_one(
        probe: Probe) -> None:
    def passing(state, bucket):  # type: ignore[no-untyped-def]
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    net = nn.Sequential(nn.Linear(16, 600), nn.Linear(600, 600), nn.Linear(600, 1))
    model = DDP(net, bucket_cap_mb=1)
    model.register_comm_hook(None, passing)
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
    probe.spans.clear()
    model(torch.randn(4, 16)).sum().backward()
    assert len(probe.spans) == 2  # its two buckets, no first-bucket span over them


def test_uninstall_takes_the_first_bucket_hooks_off(group: None) -> None:
    probe = Probe(time.perf_counter, lambda exc: (_ for _ in ()).throw(exc))
    inst = Instrumentation(probe)
    inst.install()
    net = _net()
    model = DDP(net)
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
    assert any(p._post_accumulate_grad_hooks for p in net.parameters())
    inst.uninstall()
    assert not any(p._post_accumulate_grad_hooks for p in net.parameters())


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


# -- CUDA DDP: the wait on the GPU, from events the fake GPU clock stamps ----------


def _gpu_probe(probe: Probe) -> Any:
    """Arm ``probe`` as on a step the CUDA path times, with stand-in events."""
    from tests.unit.test_cuda_timing import FakeCuda
    from traceml.agent.cuda_timing import CudaPhaseTimer

    cuda = FakeCuda()
    probe.cuda_timer = CudaPhaseTimer(cuda, share_within_s=0.0)
    return cuda


def test_on_cuda_ddps_wait_is_the_gpu_time_between_compute_queued_and_its_wait(
        probe: Probe, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DDP model on CUDA (its device stood in): each timed backward records one event
    once backward's compute is queued and one after DDP's reducer, which queued its
    own finalisation (the stream's wait for the all-reduces) in between; the
    communication span nests in backward and is taken out of its GPU time.  No host
    communication event: host time there is not the GPU's."""
    import traceml.agent.comm as comm

    monkeypatch.setattr(comm, "_on_host", lambda ddp: False)
    model = DDP(_net())
    assert probe.on_backward is not None and probe.on_backward.__name__ == "mark_exposed_gpu"
    cuda = _gpu_probe(probe)
    stand_in = _GpuStandIn(cuda, compute_ms=4.0, wait_ms=3.0)
    for p in model.parameters():  # the last gradient queues the "reducer's" finalisation
        p.register_post_accumulate_grad_hook(stand_in.grad_ready)
    stand_in.expect = sum(1 for _ in model.parameters())
    loss = model(torch.randn(4, 16)).sum()
    loss.register_hook(lambda grad: stand_in.compute())  # backward's kernels, queued
    loss.backward()  # the agent's wrapper times backward on the GPU, as on a timed step
    spans = probe.cuda_timer.take_step()
    gpu = dict(zip((p.name for p in phases.gpu_timed()), probe.cuda_timer.resolve(spans)))
    assert gpu["communication"] == pytest.approx(3.0)  # the stream's wait, alone
    assert gpu["backward"] == pytest.approx(4.0)  # compute only: the wait taken out
    times, _ = probe.take(float("inf"))
    assert times[COMM] == []  # nothing on the host clock


def test_on_cuda_an_untimed_step_records_nothing(probe: Probe,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import traceml.agent.comm as comm

    monkeypatch.setattr(comm, "_on_host", lambda ddp: False)
    model = DDP(_net())
    assert probe.cuda_timer is None
    model(torch.randn(4, 16)).sum().backward()
    times, _ = probe.take(float("inf"))
    assert times[COMM] == []


def test_on_cuda_in_flight_runs_from_the_first_buckets_gradients_to_the_end_of_ddps_wait(
        probe: Probe, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA DDP model (its device stood in): on a timed backward, a hook on each
    parameter of DDP's first bucket records an event on the GPU (the last one
    counts); DDP's wait ends the span.  Each gradient takes 1 ms of the fake GPU's
    clock: the first bucket (the last two layers) is ready 2 gradients and the 3 ms
    wait before the end, so 5 ms in flight, 3 of them exposed.  Untimed backwards
    run without the hooks; a no_sync() backward launches nothing: none in flight."""
    import traceml.agent.comm as comm

    monkeypatch.setattr(comm, "_on_host", lambda ddp: False)
    net = nn.Sequential(nn.Linear(16, 600), nn.Linear(600, 600), nn.Linear(600, 1))
    model = DDP(net)
    for _ in range(2):  # untimed: DDP rebuilds its buckets; nothing hooked yet
        model(torch.randn(4, 16)).sum().backward()
    assert not any(p._post_accumulate_grad_hooks for p in net.parameters())
    cuda = _gpu_probe(probe)
    stand_in = _GpuStandIn(cuda, compute_ms=4.0, wait_ms=3.0, grad_ms=1.0)
    for p in model.parameters():  # before the agent's: each gradient moves the clock first
        p.register_post_accumulate_grad_hook(stand_in.grad_ready)
    stand_in.expect = sum(1 for _ in model.parameters())
    ours = {name: len(p._post_accumulate_grad_hooks) for name, p in net.named_parameters()}

    def timed_backward() -> dict[str, float | None]:
        stand_in.seen = 0
        loss = model(torch.randn(4, 16)).sum()
        loss.register_hook(lambda grad: stand_in.compute())
        loss.backward()
        timer = probe.cuda_timer
        times = timer.resolve(timer.take_step())
        return dict(zip((*(p.name for p in phases.gpu_timed()), "in_flight"), times))

    gpu = timed_backward()
    assert gpu["in_flight"] == pytest.approx(5.0)
    assert gpu["communication"] == pytest.approx(3.0)
    assert gpu["backward"] == pytest.approx(4.0 + 6 * 1.0)  # kernels and gradients
    # The hooks went with the timed backward: the stand-in's alone are left.
    assert {name: len(p._post_accumulate_grad_hooks) for name, p in net.named_parameters()
            } == ours
    with model.no_sync():
        assert timed_backward()["in_flight"] is None


class _GpuStandIn:
    """The fake GPU clock moving as backward's kernels and DDP's wait would move it."""

    def __init__(self, cuda: Any, compute_ms: float, wait_ms: float, grad_ms: float = 0.0
                 ) -> None:
        self.cuda, self.compute_ms, self.wait_ms = cuda, compute_ms, wait_ms
        self.grad_ms = grad_ms  # each gradient's accumulation
        self.expect = 0
        self.seen = 0

    def compute(self) -> None:
        self.cuda.gpu_ms += self.compute_ms

    def grad_ready(self, param: Any) -> None:
        self.cuda.gpu_ms += self.grad_ms
        self.seen += 1
        if self.seen == self.expect:  # as DDP's reducer: its finalisation, at the end
            torch.autograd.Variable._execution_engine.queue_callback(self.finalise)

    def finalise(self) -> None:
        self.cuda.gpu_ms += self.wait_ms
