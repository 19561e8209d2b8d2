"""The input wrappers inside a training rank (agent): the DataLoader fetch and a host
tensor's copy to a device; `traceml.agent.patches` installs them."""

from __future__ import annotations

from collections.abc import Callable
from threading import get_ident
from typing import Any

from traceml.agent.probe import Probe
from traceml.wire.events import COPY, END, END_EXHAUSTED, INPUT


def wrap_next(probe: Probe) -> Callable[[Any], Any]:
    clock = probe.clock
    begins, ends, exhausted = (probe.appenders[c] for c in (INPUT, END, END_EXHAUSTED))

    def make(orig: Any) -> Any:
        def __next__(self: Any) -> Any:
            if probe.off or get_ident() != probe.thread_id:
                return orig(self)
            begins(clock())
            try:
                batch = orig(self)
            except StopIteration:
                exhausted(clock())
                raise
            except BaseException:
                ends(clock())
                raise
            t = clock()
            watch = probe.fetch_watch
            if watch is not None:  # what the batch holds (`traceml.agent.batch`)
                watch.see(batch, t)
            ends(t)
            return batch
        return __next__
    return make


def wrap_copy(probe: Probe, pinning: bool = False) -> Callable[[Any], Any]:
    """``Tensor.to``/``cuda``/``pin_memory``: a host tensor copied to a device
    (into pinned memory: ``pinning``) outside the timed phases is input.  Logged
    once the result shows it was a copy; nothing is logged between the two
    clock reads, so the events stay in order."""
    clock = probe.clock
    begins, ends = probe.appenders[COPY], probe.appenders[END]

    def make(orig: Any) -> Any:
        def copy(self: Any, *args: Any, **kwargs: Any) -> Any:
            if (probe.mute or probe.opt_depth or probe.off or not self.is_cpu
                    or get_ident() != probe.thread_id):
                return orig(self, *args, **kwargs)
            start = clock()
            out = orig(self, *args, **kwargs)
            if out is not self and (pinning or not out.is_cpu):
                begins(start)
                ends(clock())
            return out
        copy.__doc__ = orig.__doc__
        copy.__wrapped__ = orig  # type: ignore[attr-defined]
        return copy
    return make
