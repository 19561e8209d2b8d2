"""The rank's process sampler on a fake clock: a sample at the first call (the
start sample), then one per interval, and one when asked at exit."""

from __future__ import annotations

from traceml.agent.process_sampler import ProcessSampler
from traceml.wire.rows import PROCESS_FIELDS, ProcessRows


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_call_samples_then_one_per_interval() -> None:
    clock = FakeClock()
    sampler = ProcessSampler(1.0, clock)
    clock.now += 0.1  # the sender's first tick
    (first,) = sampler.sample()
    assert first[PROCESS_FIELDS.index("rss_bytes")] > 0
    assert first[PROCESS_FIELDS.index("cpu_pct")] >= 0.0
    clock.now += 0.5
    assert sampler.sample() == []
    clock.now += 0.5
    assert len(sampler.sample()) == 1
    clock.now += 0.9
    assert sampler.sample() == []


def test_the_exit_sample_is_taken_at_the_next_call_due_or_not() -> None:
    clock = FakeClock()
    sampler = ProcessSampler(1.0, clock)
    clock.now += 0.1
    assert len(sampler.sample()) == 1
    clock.now += 0.2
    sampler.sample_at_next_call()
    messages = sampler.produce()
    assert [type(m) for m in messages] == [ProcessRows]
    assert len(messages[0].rows) == 1
    clock.now += 0.1
    assert sampler.sample() == []  # the next is due one interval after the exit sample
