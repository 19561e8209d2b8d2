"""CUDA phase timing logic with stand-in events (no GPU here): exclusive
times, and steps that wait until the GPU has passed their events."""

from __future__ import annotations

from typing import Any

from traceml.agent.cuda_timing import CudaPhaseTimer, allocator_bytes
from traceml.protocol import BACKWARD, FORWARD, OPTIMIZER


class FakeCuda:
    """torch.cuda stand-in: events take the fake GPU clock when recorded."""

    def __init__(self) -> None:
        self.gpu_ms = 0.0
        self.done_until = float("inf")
        self.streams_made = 0

    def Stream(self, stream_id: int, device_index: int, device_type: int) -> Any:  # noqa: N802
        self.streams_made += 1
        return ("stream", stream_id, device_index, device_type)

    def Event(self, enable_timing: bool = False) -> Any:  # noqa: N802 (torch's name)
        cuda = self

        class Event:
            t = 0.0
            stream: Any = None

            def record(self, stream: Any = None) -> None:
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
    assert timer.resolve(spans) == (2.0, 4.0, 1.0)


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
    assert timer.resolve(spans) == (2.0, 3.0, 1.5)


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
