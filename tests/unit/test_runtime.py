"""AgentRuntime in this process, its sender thread not started: the sender's
side (draining the log, device marks, the last flush) is driven by hand on real
patches, and its messages are replayed as the collector does."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.unit.test_cuda_timing import FakeCuda
from traceml.agent.cuda_timing import TIMED, SamplingRule
from traceml.agent.patches import Instrumentation
from traceml.agent.probe import Probe
from traceml.agent.runtime import AgentRuntime
from traceml.collector.rank_steps import RankSteps
from traceml.environment import AgentEnv
from traceml.wire.envelope import Envelope, Message, decode, encode
from traceml.wire.events import CLOSE, END, INPUT, EventBatch
from traceml.wire.identity import Sender
from traceml.wire.records import Bye


@pytest.fixture
def runtime() -> Iterator[AgentRuntime]:
    env = AgentEnv(session_id="unit", endpoint="tcp://127.0.0.1:9", launcher_pid=os.getppid())
    rt = AgentRuntime(env, Sender("rank", socket.gethostname(), os.getpid(), 0, rank=0))
    yield rt
    if rt.instrumentation is not None:
        rt.instrumentation.uninstall()


def install(rt: AgentRuntime) -> None:
    rt.instrumentation = Instrumentation(rt.probe)
    rt.instrumentation.install()


def train(iterations: int) -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(iterations * 4, 8), torch.randn(iterations * 4, 1))
    for x, y in DataLoader(data, batch_size=4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


class Collector:
    """The collector's side of this rank's events messages, through the wire
    encoding."""

    def __init__(self) -> None:
        self.rank_steps = RankSteps()

    def steps(self, messages: list[Message]) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for message in messages:
            if isinstance(message, EventBatch):
                wire = decode(encode(Envelope("unit", Sender("rank", "h", 1, 0, rank=0), 0, 0.0,
                                              message))).message
                assert isinstance(wire, EventBatch)
                rows += [r.columns() for r in self.rank_steps.feed_batch(wire)]
        return rows


def test_the_last_flush_ships_everything_up_to_exit(runtime: AgentRuntime) -> None:
    install(runtime)
    train(5)
    runtime.probe.log(CLOSE)  # what shutdown logs before stopping the sender
    messages = runtime._bye()
    steps = Collector().steps(messages)
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    assert all((s["num_input"], s["num_forward"], s["num_backward"], s["num_optimizer"])
               == (1, 1, 1, 1) for s in steps)
    assert all(s["rss_bytes"] > 0 for s in steps)  # stamped by the sender thread
    last = messages[-1]
    assert isinstance(last, Bye) and last.num_batches == 1 and last.t is not None
    assert not any(runtime.probe.streams)


def test_events_wait_for_the_flush_interval_and_travel_in_order(runtime: AgentRuntime) -> None:
    install(runtime)
    collector = Collector()
    train(3)
    first = runtime._drain_events()  # the first tick sends at once
    train(3)
    assert runtime._drain_events() == []  # within the flush interval: kept
    assert not any(runtime.probe.streams)  # ... but taken from the training thread's log
    runtime.probe.log(CLOSE)
    steps = collector.steps(first) + collector.steps(runtime._bye())
    assert [s["step"] for s in steps] == list(range(6))
    assert [m.batch for m in first if isinstance(m, EventBatch)] == [0] and len(first) == 1


class TickingModel(nn.Module):
    """A model during whose forward the sender thread ticks: the batch carries
    that forward's start, the next one its end."""

    def __init__(self, runtime: AgentRuntime, collector: Collector) -> None:
        super().__init__()
        self.runtime, self.collector = runtime, collector
        self.layer = nn.Linear(8, 1)
        self.steps: list[dict[str, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runtime._send_now = True
        self.steps += self.collector.steps(self.runtime._drain_events())
        return self.layer(x)


def test_a_tick_in_the_middle_of_a_step_splits_nothing(runtime: AgentRuntime) -> None:
    install(runtime)
    collector = Collector()
    model = TickingModel(runtime, collector)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    for x, y in DataLoader(data, batch_size=4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    runtime.probe.log(CLOSE)
    steps = model.steps + collector.steps(runtime._bye())
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all((s["num_input"], s["num_forward"], s["num_backward"], s["num_optimizer"])
               == (1, 1, 1, 1) for s in steps)
    assert runtime.outbox.num_batches == 5


def test_a_take_keeps_what_was_stamped_after_its_horizon() -> None:
    """An event stamped before the horizon may still be on its way when the
    log is taken; those stamped after it wait for the next take, so every take
    is a complete prefix of the timeline."""
    probe = Probe(lambda: 0.0, print)
    for t in (1.0, 2.0, 3.0):
        probe.log(INPUT, t)
    probe.log(END, 2.5)
    probe.mark("peaks", 1.5)
    probe.mark("later", 9.0)
    times, marks = probe.take(2.6)
    assert (times[INPUT], times[END], marks) == ([1.0, 2.0], [2.5], [(1.5, "peaks")])
    probe.log(INPUT, 4.0)
    times, marks = probe.take(float("inf"))
    assert (times[INPUT], times[END], marks) == ([3.0, 4.0], [], [(9.0, "later")])
    assert not any(probe.streams) and not probe.marks


def test_trace_step_exit_keeps_the_device_mark_in_its_step(runtime: AgentRuntime) -> None:
    """On CUDA, step_exit logs the step's memory peaks and CUDA spans (peaks
    only here, as before the phase timer starts): they land in the step that
    is ending."""
    runtime.probe.on_optimizer_end = lambda t=None: runtime.probe.mark(((1, 2), None), t)
    install(runtime)
    model = nn.Linear(8, 1)
    with torch.no_grad():
        for _ in range(3):  # an inference loop: no optimizer, manual boundaries
            runtime.step_enter()
            with torch.enable_grad():
                model(torch.randn(4, 8))
            runtime.step_exit()
    runtime.probe.log(CLOSE)
    steps = Collector().steps(runtime._bye())
    assert len(steps) == 3
    assert all((s["peak_allocated_bytes"], s["peak_reserved_bytes"]) == (1, 2)
               for s in steps)


class StandInTimer:
    """A CUDA phase timer whose GPU has passed the events up to ``done`` spans
    (each span stands for 1 ms of forward), or that fails."""

    def __init__(self) -> None:
        self.done = 0
        self.error: Exception | None = None

    def start(self, phase: int) -> None:
        pass

    def stop(self) -> None:
        pass

    def resolve(self, spans: list[int]) -> tuple[float | None, ...] | None:
        if self.error is not None:
            raise self.error
        rest = (0.0,) * (len(TIMED) - 1)  # forward's ms, the other phases' 0
        # ...and nothing in flight (no DDP wait)
        return (float(len(spans)), *rest, None) if max(spans) < self.done else None


def log_device_marks(runtime: AgentRuntime, timer: StandInTimer) -> None:
    runtime.probe.cuda_timer = timer  # armed: every step timed
    runtime.device.cuda_timer = timer  # type: ignore[assignment]  # resolves the marks
    ends = iter(range(1000))
    runtime.probe.on_optimizer_end = lambda t=None: runtime.probe.mark(
        ((100, 200), [next(ends)]), t)


def test_events_after_a_mark_the_gpu_has_not_passed_wait_for_it(
        runtime: AgentRuntime) -> None:
    timer = StandInTimer()
    log_device_marks(runtime, timer)
    install(runtime)
    collector = Collector()
    train(4)
    timer.done = 2  # the GPU is two iterations behind
    runtime._send_now = True
    steps = collector.steps(runtime._drain_events())
    # Step 1 ended where iteration 2 began; step 2's mark and all after it wait.
    assert [s["step"] for s in steps] == [0, 1]
    assert runtime.probe._held_marks and runtime.probe.num_held() > 0
    timer.done = 10  # the GPU catches up while the training thread logs nothing
    runtime._send_now = True
    steps += collector.steps(runtime._drain_events())
    assert [s["step"] for s in steps] == [0, 1, 2]  # step 3 is open until exit
    runtime.probe.log(CLOSE)
    steps += collector.steps(runtime._bye())
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(s["gpu_forward_ms"] == 1.0 and s["peak_reserved_bytes"] == 200 for s in steps)


def _train_with_failing_gpu_timer(runtime: AgentRuntime) -> list[dict[str, Any]]:
    """Three steps whose GPU timer raises; the steps the collector makes of them."""
    timer = StandInTimer()
    timer.error = RuntimeError("CUDA error: an illegal memory access")
    log_device_marks(runtime, timer)
    install(runtime)
    train(3)
    runtime.probe.log(CLOSE)
    return Collector().steps(runtime._bye())


def test_a_failing_gpu_timer_drops_gpu_times_not_steps(
        runtime: AgentRuntime, capsys: pytest.CaptureFixture[str]) -> None:
    steps = _train_with_failing_gpu_timer(runtime)
    assert len(steps) == 3
    assert all(s["gpu_forward_ms"] is None and s["peak_allocated_bytes"] == 100 for s in steps)
    assert capsys.readouterr().err.count("GPU phase times disabled") == 1


def test_each_distinct_agent_failure_warns_once(
        runtime: AgentRuntime, capsys: pytest.CaptureFixture[str]) -> None:
    _train_with_failing_gpu_timer(runtime)  # the GPU times fail: their warning
    runtime._fail(RuntimeError("first"))  # then the step instrumentation, twice
    runtime._fail(RuntimeError("again"))
    err = capsys.readouterr().err
    assert err.count("traceml: warning: GPU phase times disabled") == 1
    assert err.count("traceml: warning: step instrumentation disabled") == 1
    assert "first" in err and "again" not in err


# -- the CUDA path on a stand-in torch.cuda: which steps are timed, and their peaks --------

class StandInCuda(FakeCuda):
    """torch.cuda with a caching allocator whose peak the training loop sets."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 1000
        self.peak = 1000
        self.num_reads = 0

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def memory_stats_as_nested_dict(self, device: int) -> dict[str, Any]:
        self.num_reads += 1
        return {"allocated_bytes": {"all": {"current": self.current, "peak": self.peak}},
                "reserved_bytes": {"all": {"current": 2 * self.current, "peak": 2 * self.peak}}}

    def reset_peak_memory_stats(self, device: int) -> None:
        self.peak = self.current

    def use(self, nbytes: int) -> None:
        """A step holds ``nbytes`` more for a moment."""
        self.peak = max(self.peak, self.current + nbytes)


class GpuModel(nn.Module):
    """Its forward queues 2 ms of GPU work and allocates the step's transient memory."""

    def __init__(self, cuda: StandInCuda) -> None:
        super().__init__()
        self.cuda = cuda
        self.layer = nn.Linear(8, 1)
        self.step_bytes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cuda.gpu_ms += 2.0
        self.cuda.use(self.step_bytes)
        out: torch.Tensor = self.layer(x)
        out.register_hook(lambda grad: self._gpu(3.0))  # backward: 3 ms
        return out

    def _gpu(self, ms: float) -> None:
        self.cuda.gpu_ms += ms


def train_on_stand_in(runtime: AgentRuntime, step_bytes: list[int],
                      num_optimizers: int = 1) -> list[dict[str, Any]]:
    """One iteration per ``step_bytes`` entry (its transient allocation), through the
    real patches, then exit as shutdown does; the steps the collector makes."""
    cuda = runtime.device.cuda
    install(runtime)
    models = [GpuModel(cuda) for _ in range(num_optimizers)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for opt in opts:  # the optimizer step: 1 ms (after traceml's hook has begun timing it)
        opt.register_step_pre_hook(lambda *args: models[0]._gpu(1.0))
    data = TensorDataset(torch.randn(len(step_bytes) * 4, 8), torch.randn(len(step_bytes) * 4, 1))
    for nbytes, (x, y) in zip(step_bytes, DataLoader(data, batch_size=4)):
        for model, opt in zip(models, opts):
            model.step_bytes = nbytes
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    runtime.device.flush_peaks()  # what shutdown does before it logs CLOSE
    runtime.probe.log(CLOSE)
    return Collector().steps(runtime._bye())


SAMPLED = SamplingRule(first_steps=5, budget_s=1e-12, max_every=4)
"""Every one of the first 5 steps timed, then one in each block of 4."""


def test_only_sampled_steps_carry_gpu_times_and_peaks_cover_the_steps_between(
        runtime: AgentRuntime) -> None:
    cuda = StandInCuda()
    runtime.device.watch(cuda)
    runtime.device.use_sampling(SAMPLED)
    step_bytes = [(s * 7919) % 5000 + (100_000 if s % 7 == 3 else 0) for s in range(42)]
    steps = train_on_stand_in(runtime, step_bytes)
    assert [s["step"] for s in steps] == list(range(42))
    timed = [s["step"] for s in steps if s["gpu_forward_ms"] is not None]
    # The first step starts the timer; the next 4 are timed, then one in each block of 4.
    assert timed[:4] == [1, 2, 3, 4]
    blocks = [sum(1 for i in timed if 5 + 4 * b <= i < 9 + 4 * b) for b in range(9)]
    assert blocks == [1] * 9
    assert all((s["gpu_forward_ms"], s["gpu_backward_ms"], s["gpu_optimizer_ms"])
               == (2.0, 3.0, 1.0) for s in steps if s["step"] in timed)
    assert all(s["gpu_backward_ms"] is None for s in steps if s["step"] not in timed)
    # Peaks only on the timed steps (and at exit on the last step): each the highest
    # since the previous one, so no step's peak is lost.
    read = [s["step"] for s in steps if s["peak_allocated_bytes"] is not None]
    assert set(read) == {0, *timed, 41}
    assert cuda.num_reads == len(read)
    previous = -1
    for i in read:
        covered = step_bytes[previous + 1:i + 1]
        assert steps[i]["peak_allocated_bytes"] == 1000 + max(covered)
        assert steps[i]["peak_reserved_bytes"] == 2 * (1000 + max(covered))
        previous = i
    assert max(s["peak_allocated_bytes"] or 0 for s in steps) == 1000 + max(step_bytes)
    # Events only on the timed steps: at most 2 per phase, fewer where phases follow
    # each other at once.
    assert 4 * len(timed) <= cuda.records <= 6 * len(timed)


def test_a_step_whose_optimizer_steps_were_partly_timed_has_no_gpu_times(
        runtime: AgentRuntime) -> None:
    """Two optimizers per iteration (a GAN): two step ends per step, sampled one
    at a time after the first steps; a step carries GPU times only when both
    were timed, never half of them."""
    runtime.device.watch(StandInCuda())
    runtime.device.use_sampling(SAMPLED)
    steps = train_on_stand_in(runtime, [0] * 30, num_optimizers=2)
    assert len(steps) == 30
    gpu = [(s["gpu_forward_ms"], s["gpu_backward_ms"], s["gpu_optimizer_ms"]) for s in steps]
    assert set(gpu) == {(4.0, 6.0, 2.0), (None, None, None)}
    assert gpu[1] == (4.0, 6.0, 2.0)  # the first steps: every step end timed
