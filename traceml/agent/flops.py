"""FLOPs per training step, counted once per batch shape (agent side).

After the warm-up's optimizer steps (``runtime.FLOPS_AFTER_STEPS``, seen by the
sender thread, which then arms the count), the next batch whose
shape has no count yet starts torch's own FLOP counter
(`torch.utils.flop_counter.FlopCounterMode`, forward and backward); the
iteration's optimizer step ends it.  The count is logged as one record
(`wire.events.FLOP_COUNT_FIELDS`) at that moment: the collector marks the step it
lands in as counted, and the summary leaves that step out of its timing window
(the counter slows the step it runs in).  Later batches of the same shape reuse
the count, so no other step pays anything; a new shape (the last short batch of
an epoch) is counted once more, up to ``MAX_FLOP_COUNTS`` shapes.

The counter also notes each counted op's dtype and device, so the summary can
pick the peak of the dtype the matmuls ran in (float32 on CUDA with TF32
allowed counts as tf32).  Where counting cannot be trusted it abstains with the
reason: the counter failed, torch.compile ran (compiled regions run outside
the counter), or no op it knows ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from traceml.agent.probe import Probe

MAX_FLOP_COUNTS = 8  # batch shapes counted per rank; later new shapes are not
MAX_BATCHES_PER_COUNT = 256  # a count still open after this many batches is dropped

_COMPILED = "torch.compile ran: compiled regions run outside torch's FLOP counter"
_COUNTER_CLASS: Any = None


def _counter_class() -> Any:
    """FlopCounterMode, noting the FLOPs of each (device, dtype) too."""
    global _COUNTER_CLASS
    if _COUNTER_CLASS is not None:
        return _COUNTER_CLASS
    from torch.utils.flop_counter import FlopCounterMode

    class DtypeFlopCounter(FlopCounterMode):
        def __init__(self) -> None:
            super().__init__(display=False)
            self.by_kind: dict[tuple[str, str], int] = {}
            self.failure: str | None = None

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            # Called with the op's output, after it ran: a formula that fails here
            # must not reach the user's forward, so the count abstains instead.
            try:
                before = self.get_total_flops()
                super()._count_flops(  # type: ignore[no-untyped-call]
                    func_packet, out, args, kwargs)
                added = self.get_total_flops() - before
                if added:
                    kind = _kind(func_packet, args)
                    self.by_kind[kind] = self.by_kind.get(kind, 0) + added
            except Exception as exc:
                self.failure = self.failure or f"counting {func_packet} failed: {exc!r}"
            return out

    _COUNTER_CLASS = DtypeFlopCounter
    return _COUNTER_CLASS


def _kind(func_packet: Any, args: Any) -> tuple[str, str]:
    """(device, dtype name) of an op's first tensor argument."""
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if tensor is None:
        return ("unknown", "unknown")
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        tensor.dtype, str(tensor.dtype).removeprefix("torch."))
    device = str(tensor.device)
    if dtype == "fp32" and tensor.device.type == "cuda" and _tf32_allowed(func_packet):
        dtype = "tf32"
    return (device, dtype)


def _tf32_allowed(func_packet: Any) -> bool:
    if "convolution" in str(func_packet):
        return bool(torch.backends.cudnn.allow_tf32)
    return bool(torch.backends.cuda.matmul.allow_tf32)


def _device_name(device: str) -> tuple[str, int | None]:
    """The name torch reports for ``device`` and its multiprocessor count (CUDA/ROCm)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type, None
    props = torch.cuda.get_device_properties(dev)
    return torch.cuda.get_device_name(dev), int(props.multi_processor_count)


def dominant(by_kind: dict[tuple[str, str], int]) -> tuple[str | None, float | None, str | None]:
    """(dtype, its share of the FLOPs, device) of the kind with the most FLOPs."""
    total = sum(by_kind.values())
    if not total:
        return None, None, None
    (device, dtype), flops = max(by_kind.items(), key=lambda kv: kv[1])
    return dtype, flops / total, device


class FlopCounting:
    """The counts of one rank: which batch shapes are counted, and the one running."""

    def __init__(self, probe: Probe, enabled: bool,
                 on_error: Callable[[str, BaseException], None]) -> None:
        self.probe = probe
        self.enabled = enabled
        self.on_error = on_error
        self.known: dict[Any, float | None] = {}  # shape key -> FLOPs per step (None: failed)
        self.armed = False  # warm-up is over (set by the sender thread)
        self.counter: Any = None  # the running count
        self.key: Any = None
        self.num_batches = 0
        self._chained: Callable[..., None] | None = None
        self._linked = False  # _optimizer_ended is in probe.on_optimizer_end's chain
        self.force_batches: Callable[[], None] = lambda: None  # the watches' next batch: slow path

    def arm(self) -> None:
        """Warm-up is over (sender thread): the next batch is counted if its shape is new."""
        if self.enabled and not self.armed:
            self.armed = True
            self.force_batches()

    def waiting(self) -> bool:
        """Armed, but nothing counted or counting yet (sender thread: force again)."""
        return self.armed and not self.known and self.counter is None

    def on_shape(self, key: Any, t: float) -> float | None:
        """Training thread, a batch of a new shape (or forced): its FLOPs per step,
        when known; starts a count when due."""
        if self.counter is not None:
            self.num_batches += 1
            if self.num_batches > MAX_BATCHES_PER_COUNT:
                self.stop(reason=f"no optimizer step within {MAX_BATCHES_PER_COUNT} batches")
            else:
                self.force_batches()  # see each micro-batch while the count runs
            return None
        if key in self.known or not self.armed or len(self.known) >= MAX_FLOP_COUNTS:
            return self.known.get(key)
        self.start(key)
        return None

    def start(self, key: Any) -> None:
        self.key = key
        self.num_batches = 0
        if self.probe.compiled:  # nothing to run: the answer is known
            self._record(self.probe.clock(), None, {}, _COMPILED, ran=False)
            return
        try:
            counter = _counter_class()()
            counter.__enter__()
        except Exception as exc:
            self._record(self.probe.clock(), None, {}, f"the FLOP counter failed: {exc!r}",
                         ran=False)
            return
        self.counter = counter
        if not self._linked:  # still in a chain from an earlier count: it passes through
            self._chained = self.probe.on_optimizer_end
            self.probe.on_optimizer_end = self._optimizer_ended
            self._linked = True
        self.force_batches()

    def _optimizer_ended(self, t: float | None = None) -> None:
        """The counted iteration's optimizer step ended (training thread)."""
        chained = self._chained
        try:
            if chained is not None:
                chained() if t is None else chained(t)
        finally:  # the count ends with its step, whatever the device mark did
            if self.counter is not None:
                self.stop(t)

    def stop(self, t: float | None = None, reason: str | None = None) -> None:
        """End the running count and log it (training thread, or at exit)."""
        counter, self.counter = self.counter, None
        if counter is None:
            return
        if self.probe.on_optimizer_end == self._optimizer_ended:
            self.probe.on_optimizer_end = self._chained
            self._chained = None
            self._linked = False
        # else another hook chained onto this one since (a profiler capture's): this
        # one stays in its chain and passes through (the count is over)
        now = self.probe.clock() if t is None else t
        try:
            counter.__exit__(None, None, None)
        except Exception as exc:
            reason = reason or f"the FLOP counter failed: {exc!r}"
        flops: float | None = float(counter.get_total_flops())
        reason = reason or counter.failure
        if self.probe.compiled and reason is None:
            reason = _COMPILED
        if not flops and reason is None:
            reason = "no operation torch's FLOP counter knows ran in the counted step"
        self._record(now, None if reason else flops, counter.by_kind, reason, ran=True)

    def _record(self, t: float, flops: float | None, by_kind: dict[tuple[str, str], int],
                reason: str | None, ran: bool) -> None:
        self.known[self.key] = flops
        dtype, share, device = dominant(by_kind)
        name, sm = None, None
        if device is not None:
            try:
                name, sm = _device_name(device)
            except Exception as exc:
                self.on_error("flops-device", exc)
        self.probe.flop_counts.append((t, flops, dtype, share, name, sm, reason, ran))
