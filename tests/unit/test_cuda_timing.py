"""CUDA phase timing logic with stand-in events and allocator (no GPU here):
exclusive times, steps that wait until the GPU has passed their events,
shared phase boundaries, and which steps are timed."""

from __future__ import annotations

import random
from typing import Any

import pytest

from traceml.agent.cuda_timing import (
    EVERY_STEP,
    CudaPhaseTimer,
    SamplingRule,
    StepSampler,
    allocator_bytes,
)
from traceml.wire.events import BACKWARD, FORWARD, OPTIMIZER


class FakeCuda:
    """torch.cuda stand-in: events take the fake GPU clock when recorded."""

    def __init__(self) -> None:
        self.gpu_ms = 0.0
        self.done_until = float("inf")
        self.streams_made = 0
        self.events_made = 0
        self.records = 0
        self.record_s = 0.0  # training-thread time a record takes, on `clock`
        self.clock: Any = None

    def Stream(self, stream_id: int, device_index: int, device_type: int) -> Any:  # noqa: N802
        self.streams_made += 1
        return ("stream", stream_id, device_index, device_type)

    def Event(self, enable_timing: bool = False) -> Any:  # noqa: N802 (torch's name)
        cuda = self
        cuda.events_made += 1

        class Event:
            t = 0.0
            stream: Any = None

            def record(self, stream: Any = None) -> None:
                cuda.records += 1
                if cuda.clock is not None:
                    cuda.clock.now += cuda.record_s
                self.t = cuda.gpu_ms
                self.stream = stream

            def query(self) -> bool:
                return self.t <= cuda.done_until

            def elapsed_time(self, end: Any) -> float:
                return float(end.t - self.t)

        return Event()


def test_plain_step() -> None:
    cuda = FakeCuda()
    timer = CudaPhaseTimer(cuda)
    for phase, ms in ((FORWARD, 2.0), (BACKWARD, 4.0), (OPTIMIZER, 1.0)):
        timer.start(phase)
        cuda.gpu_ms += ms
        timer.stop()
    spans = timer.take_step()
    assert timer.resolve(spans) == (2.0, 4.0, 1.0, None, None)  # no collective waited on: not measured


def test_closure_is_exclusive_and_waits_for_gpu() -> None:
    cuda = FakeCuda()
    timer = CudaPhaseTimer(cuda)
    timer.start(OPTIMIZER)
    cuda.gpu_ms += 0.5
    timer.start(FORWARD)
    cuda.gpu_ms += 2.0
    timer.stop()
    timer.start(BACKWARD)
    cuda.gpu_ms += 3.0
    timer.stop()
    cuda.gpu_ms += 1.0
    timer.stop()
    spans = timer.take_step()
    cuda.done_until = 4.0  # the GPU has not reached the optimizer's end yet
    assert timer.resolve(spans) is None
    cuda.done_until = float("inf")
    assert timer.resolve(spans) == (2.0, 3.0, 1.5, None, None)


class FakeTorchC:
    """torch._C's raw current-device and current-stream lookups."""

    def __init__(self) -> None:
        self.current = 3  # the stream id `torch.cuda.stream(...)` would select

    def _cuda_getDevice(self) -> int:  # noqa: N802 (torch's name)
        return 0

    def _cuda_getCurrentStream(self, device: int) -> tuple[int, int, int]:  # noqa: N802
        return self.current, device, 1


def test_events_record_on_the_current_stream_each_built_once() -> None:
    cuda, torch_c = FakeCuda(), FakeTorchC()
    timer = CudaPhaseTimer(cuda, torch_c)
    for stream_id, phase in ((3, FORWARD), (7, BACKWARD), (3, OPTIMIZER)):
        torch_c.current = stream_id  # `with torch.cuda.stream(s):` switches it
        timer.start(phase)
        timer.stop()
    spans = timer.take_step()
    assert [(start.stream[1], end.stream[1]) for _, start, end, _ in spans] == [
        (3, 3), (7, 7), (3, 3)]
    assert spans[0][1].stream is spans[2][2].stream
    assert cuda.streams_made == 2  # one Stream object per stream, not per event


class StatsCuda:
    """torch.cuda stand-in for the allocator's nested statistics."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self.stats = stats
        self.reads = 0

    def memory_stats_as_nested_dict(self, device: int) -> dict[str, Any]:
        self.reads += 1
        return self.stats


def test_allocator_bytes_come_from_one_raw_read() -> None:
    def stat(current: int, peak: int) -> dict[str, Any]:
        return {"all": {"current": current, "peak": peak, "allocated": 0, "freed": 0},
                "large_pool": {"current": 0, "peak": 0}}

    cuda = StatsCuda({"allocated_bytes": stat(100, 300), "reserved_bytes": stat(512, 1024),
                      "num_alloc_retries": 0})
    assert allocator_bytes(cuda, 0, "peak") == (300, 1024)
    assert allocator_bytes(cuda, 0, "current") == (100, 512)
    assert cuda.reads == 2  # one read per call, both figures from it
    # torch returns {} before the allocator is set up: zeros, as memory_allocated() gives
    assert allocator_bytes(StatsCuda({}), 0, "peak") == (0, 0)


class FakeClock:
    """The training thread's clock (seconds), moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_phase(timer: CudaPhaseTimer, cuda: FakeCuda, clock: FakeClock, phase: int,
              gpu_ms: float, gap_s: float = 1e-6) -> None:
    """One phase that queues ``gpu_ms`` of GPU work, ``gap_s`` after the last one."""
    clock.now += gap_s
    timer.start(phase)
    cuda.gpu_ms += gpu_ms
    clock.now += 50e-6
    timer.stop()


def test_consecutive_phases_share_one_boundary_event() -> None:
    cuda, clock = FakeCuda(), FakeClock()
    timer = CudaPhaseTimer(cuda, clock=clock)
    # model forward, loss forward, backward, optimizer: each right after the last
    for phase, ms in ((FORWARD, 2.0), (FORWARD, 0.5), (BACKWARD, 4.0), (OPTIMIZER, 1.0)):
        run_phase(timer, cuda, clock, phase, ms)
    spans = timer.take_step()
    assert cuda.records == 5  # not 8: one event ends a phase and starts the next
    assert timer.resolve(spans) == (2.5, 4.0, 1.0, None, None)
    # The step's events go back to the pool once each: the next step makes none.
    for phase, ms in ((FORWARD, 2.0), (BACKWARD, 4.0)):
        run_phase(timer, cuda, clock, phase, ms)
    assert cuda.events_made == 5
    assert timer.resolve(timer.take_step()) == (2.0, 4.0, 0.0, None, None)


def test_a_gap_with_work_in_it_keeps_its_own_boundaries() -> None:
    """Gradient clipping between backward and the optimizer step: the training
    thread spent more than a launch in between, so the clip's GPU time goes to
    no phase, as without sharing."""
    cuda, clock = FakeCuda(), FakeClock()
    timer = CudaPhaseTimer(cuda, clock=clock)
    run_phase(timer, cuda, clock, FORWARD, 2.0)
    run_phase(timer, cuda, clock, BACKWARD, 4.0)
    cuda.gpu_ms += 3.0  # clip_grad_norm_'s kernels
    run_phase(timer, cuda, clock, OPTIMIZER, 1.0, gap_s=80e-6)
    assert cuda.records == 5
    assert timer.resolve(timer.take_step()) == (2.0, 4.0, 1.0, None, None)


def test_no_boundary_is_shared_across_streams_steps_or_when_told_not_to() -> None:
    cuda, clock, torch_c = FakeCuda(), FakeClock(), FakeTorchC()
    timer = CudaPhaseTimer(cuda, torch_c, clock=clock)
    run_phase(timer, cuda, clock, FORWARD, 1.0)
    torch_c.current = 7  # the backward runs on another stream
    run_phase(timer, cuda, clock, BACKWARD, 1.0)
    timer.take_step()
    run_phase(timer, cuda, clock, FORWARD, 1.0)  # the next step's first phase
    assert cuda.records == 6
    unshared = CudaPhaseTimer(cuda, clock=clock, share_within_s=EVERY_STEP.share_within_s)
    for phase in (FORWARD, BACKWARD, OPTIMIZER):
        run_phase(unshared, cuda, clock, phase, 1.0)
    assert cuda.records == 6 + 6


def test_the_timer_counts_the_time_its_records_take() -> None:
    cuda, clock = FakeCuda(), FakeClock()
    cuda.clock, cuda.record_s = clock, 8e-6
    timer = CudaPhaseTimer(cuda, clock=clock)
    run_phase(timer, cuda, clock, FORWARD, 1.0)
    run_phase(timer, cuda, clock, BACKWARD, 1.0)  # shares the forward's end: one record
    assert timer.take_spent_s() == pytest.approx(3 * 8e-6)
    assert timer.take_spent_s() == 0.0


# -- which steps are timed ---------------------------------------------------------------

def timed_steps(sampler: StepSampler, num_steps: int, step_s: float, cost_s: float
                ) -> list[int]:
    """Drive ``sampler`` as the runtime does: the indices of the timed step ends."""
    timed, t = [], sampler.last_t or 0.0
    for i in range(num_steps):
        t += step_s
        sampler.left -= 1
        if sampler.left == 0:
            timed.append(i)
            sampler.timed(t, cost_s)
    return timed


def test_every_one_of_the_first_steps_is_timed() -> None:
    sampler = StepSampler(SamplingRule(), random.Random(1))
    timed = timed_steps(sampler, 1000, step_s=1.4e-3, cost_s=60e-6)
    assert timed[:25] == list(range(25))
    assert 26 not in timed or 27 not in timed  # then a sample
    assert sampler.every == 5 and len(timed) - 25 == (1000 - 25) // 5  # one step in five


@pytest.mark.parametrize(("step_s", "cost_s", "every"), [
    (1.4e-3, 60e-6, 5),  # launch-bound: 1 % of the step, 14 µs, is the budget
    (20e-3, 60e-6, 3),  # a long step: 20 µs is
    (20e-3, 10e-6, 1),  # a cheap timed step: every step
    (0.1e-3, 60e-6, 60),
    (0.01e-3, 60e-6, 64),  # at least one step in 64
])
def test_one_step_in_each_block_of_every_is_timed(step_s: float, cost_s: float,
                                                   every: int) -> None:
    sampler = StepSampler(SamplingRule(), random.Random(2))
    timed = timed_steps(sampler, 25 + every * 200, step_s, cost_s)
    assert sampler.every == every == SamplingRule().every(cost_s, step_s)
    blocks = [0] * 200
    for i in timed[25:]:
        blocks[(i - 25) // every] += 1
    assert blocks == [1] * 200
    # ... so the expected cost per step stays within the budget
    budget = min(20e-6, 0.01 * step_s)
    assert cost_s / every <= budget or every == 64


def test_the_timed_step_moves_within_its_block() -> None:
    """A loop that does something every 10th step (logging) is not always or
    never the timed one."""
    sampler = StepSampler(SamplingRule(), random.Random(3))
    timed = timed_steps(sampler, 25 + 10 * 100, step_s=1e-3, cost_s=100e-6)  # every 10
    assert sampler.every == 10
    assert len({i % 10 for i in timed[25:]}) == 10


def test_every_adapts_to_the_observed_step_length_and_cost() -> None:
    sampler = StepSampler(SamplingRule(), random.Random(4))
    timed_steps(sampler, 200, step_s=1.4e-3, cost_s=60e-6)
    assert sampler.every == 5
    timed_steps(sampler, 400, step_s=20e-3, cost_s=60e-6)  # the steps get longer
    assert sampler.every == 3
    timed_steps(sampler, 400, step_s=20e-3, cost_s=30e-6)  # the records get cheaper
    assert sampler.every == 2


def test_one_slow_timed_step_does_not_move_every() -> None:
    """A timed step preempted for 10 ms (or a checkpoint pause between steps) is
    one sample of the last 9: the median ignores it."""
    sampler = StepSampler(SamplingRule(), random.Random(5))
    timed_steps(sampler, 100, step_s=1.4e-3, cost_s=60e-6)
    sampler.left = sampler.gap = 1  # the next step end is timed, one step after the last
    timed_steps(sampler, 1, step_s=1.4e-3, cost_s=10e-3)
    assert sampler.every == 5


def test_the_old_path_times_every_step() -> None:
    sampler = StepSampler(EVERY_STEP)
    assert timed_steps(sampler, 100, step_s=1e-4, cost_s=1e-3) == list(range(100))


def test_the_wait_on_communication_nests_in_backward_and_leaves_its_compute() -> None:
    """CUDA DDP (`traceml.agent.comm`): the compute stream's wait for the all-reduces,
    timed inside backward, is communication; backward keeps its own kernels' time."""
    from traceml import phases

    comm = phases.code("communication")
    cuda = FakeCuda()
    timer = CudaPhaseTimer(cuda, share_within_s=0.0)
    timer.start(FORWARD)
    cuda.gpu_ms += 2.0
    timer.stop()
    timer.start(BACKWARD)
    cuda.gpu_ms += 4.0  # backward's kernels
    timer.start(comm)
    cuda.gpu_ms += 3.0  # the stream waits for NCCL
    timer.stop()
    timer.stop()
    assert timer.resolve(timer.take_step()) == (2.0, 4.0, 0.0, 3.0, None)


def test_in_flight_starts_at_the_first_ddp_models_first_bucket() -> None:
    """A backward through two DDP models (a GAN's generator step): the first model to
    have its first bucket ready starts the span; the other's later stamps move nothing,
    the first's own later parameters do (its bucket is ready at the last of them)."""
    from traceml import phases

    comm = phases.code("communication")
    cuda = FakeCuda()
    timer = CudaPhaseTimer(cuda, share_within_s=0.0)
    first, second = object(), object()
    timer.start(BACKWARD)
    cuda.gpu_ms += 2.0
    timer.first_bucket_ready(first)
    cuda.gpu_ms += 1.0
    timer.first_bucket_ready(first)  # its bucket's last parameter: ready at 3 ms
    cuda.gpu_ms += 2.0
    timer.first_bucket_ready(second)  # the other model's, later: not the start
    cuda.gpu_ms += 1.0
    timer.start(comm)
    cuda.gpu_ms += 4.0
    timer.stop()
    timer.stop()
    assert timer.resolve(timer.take_step()) == (0.0, 6.0, 0.0, 4.0, 7.0)
