"""The CUDA side of a training rank's steps (agent): on a sample of steps, the phases'
GPU time from CUDA events and the allocator's memory peaks, logged as device marks
that the sender thread resolves once the GPU has passed their events
(`traceml.agent.cuda_timing` has the timer and the sampling rule).  Never a
synchronize on the training path."""

from __future__ import annotations

import sys
import time
from typing import Any

from traceml.agent.cuda_timing import CudaPhaseTimer, SamplingRule, StepSampler, allocator_bytes
from traceml.agent.probe import Probe
from traceml.errors import WarnOnce
from traceml.wire.events import DEVICE_MARK_FIELDS


class DeviceSteps:
    """Which steps are timed (`StepSampler`), the timer that resolves their marks (armed
    in the probe only for a timed step), and the CUDA module they read."""

    def __init__(self, probe: Probe, warnings: WarnOnce) -> None:
        self.probe = probe
        self.warnings = warnings
        self.sampler = StepSampler()
        self.cuda_timer: CudaPhaseTimer | None = None
        self.cuda: Any = None  # torch.cuda once this rank has CUDA (a stand-in in tests)
        self.gpu_times_failed = False
        self.final = False  # at exit, marks whose GPU events are not done go without

    def mark_step(self, t: float | None = None) -> None:
        """Training thread, when an iteration's optimizer steps end (CUDA only).

        Most steps are not timed (`cuda_timing.StepSampler`): log an empty
        mark, without touching CUDA (so that the collector sees a step none of
        whose optimizer steps were timed, or only some).  Before a timed step,
        arm the phase timer; at its end, log its phases' CUDA events and the
        device memory peaks since the last timed step (stamped now, or ``t``)."""
        sampler = self.sampler
        sampler.last_t = now = self.probe.clock() if t is None else t
        left = sampler.left - 1
        if left > 1:
            sampler.left = left
            self.probe.marks.append((now, None))
        elif left == 1:  # the next step is timed
            sampler.left = left
            self.probe.marks.append((now, None))
            self._arm_timer()
        else:
            self._timed_step_ends(now)

    def _arm_timer(self) -> None:
        timer = self.cuda_timer
        if timer is not None and not self.gpu_times_failed:
            timer.take_step()  # anything recorded while it was not armed
            self.probe.cuda_timer = timer

    def _timed_step_ends(self, t: float) -> None:
        cuda = self.cuda
        if not cuda.is_initialized():
            self.sampler.left = 1  # no CUDA yet: try again at the next step end
            return
        began = time.perf_counter()
        peaks = self._read_peaks()
        cost_s = time.perf_counter() - began
        timer = self.cuda_timer
        spans = None
        if timer is None:  # CUDA came up during this step: time phases from the next
            timer = self.cuda_timer = CudaPhaseTimer(cuda, sys.modules["torch"]._C,
                                                     self.sampler.rule.share_within_s)
        elif self.probe.cuda_timer is timer:
            spans = timer.take_step()
            cost_s += timer.take_spent_s()
        self.probe.mark((peaks, spans), t)
        self.probe.cuda_timer = None
        if self.sampler.timed(t, cost_s) == 1:
            self._arm_timer()

    def _read_peaks(self) -> tuple[int, int]:
        """The allocator's peaks since the last read, which resets them."""
        cuda = self.cuda
        device = cuda.current_device()
        peaks = allocator_bytes(cuda, device, "peak")
        cuda.reset_peak_memory_stats(device)
        return peaks

    def flush_peaks(self) -> None:
        """At exit: the peaks of the steps since the last timed one, which no
        timed step will read, go with the last step (stamped at its end)."""
        sampler = self.sampler
        if self.cuda_timer is None or sampler.num_unread() <= 0 or sampler.last_t is None:
            return
        if self.cuda.is_initialized():
            self.probe.mark((self._read_peaks(), None), sampler.last_t)

    def watch(self, cuda: Any = None) -> bool:
        """Take CUDA memory peaks and phase GPU times when this rank has CUDA
        (``cuda``: a stand-in for ``torch.cuda``, in tests)."""
        if cuda is None:
            torch = sys.modules.get("torch")
            if torch is None or not torch.cuda.is_available():
                return False
            cuda = torch.cuda
        self.cuda = cuda
        self.probe.on_optimizer_end = self.mark_step
        return True

    def use_sampling(self, rule: SamplingRule) -> None:
        """Time steps by ``rule`` from the next step end on (`scripts/bench_overhead.py`
        compares rules); the steps counted so far start over."""
        self.sampler = StepSampler(rule)
        self.probe.cuda_timer = None
        if self.cuda_timer is not None:
            self.cuda_timer.share_within_s = rule.share_within_s

    def resolve(self, value: tuple[Any, Any] | None, give_up: bool = False
                     ) -> list[Any] | None:
        """A logged mark as `wire.events.DEVICE_MARK_FIELDS` (all None for an untimed
        step); None while the GPU has not passed its events (unless ``give_up``:
        then without GPU times)."""
        gpu: tuple[float | None, ...] = (None,) * (len(DEVICE_MARK_FIELDS) - 2)
        if value is None:
            return [None, None, *gpu]
        (allocated, reserved), spans = value
        timer = self.cuda_timer
        if spans is not None and timer is not None and not self.gpu_times_failed:
            try:
                resolved = timer.resolve(spans)
            except Exception as exc:  # the GPU times go, the rest stays
                self.gpu_times_failed = True
                self.warnings.to_stderr(
                    "gpu-times", f"GPU phase times disabled after an internal error: {exc!r}")
                resolved = None
            if resolved is None and not (self.final or give_up or self.gpu_times_failed):
                return None
            gpu = resolved or gpu
        return [allocated, reserved, *gpu]
