"""When DDP's gradient all-reduce starts, at no cost per bucket (agent side).

DDP launches its buckets' all-reduces from C++ as their gradients become ready,
and waits for them at the end of backward; on gloo no hook of torch's says when
one completes, and a Python comm hook would cost a Python call per bucket and an
extra pass over the gradients (the default path divides while it copies them
into the bucket; a hook must divide on its own).  So for DDP's built-in
all-reduce the in-flight span is DDP's own "backward communication time" (what
its runtime logging reports): from the launch of its **first bucket** to the
end of its wait for every bucket, which `traceml.agent.comm` times already.

The first bucket is launched when the last of its gradients is accumulated.  Once
DDP has rebuilt its buckets in gradient-ready order (after its first backward),
its logging record says which parameters the first bucket holds; a
post-accumulate-grad hook on each of them (a handful: the first bucket is capped
at 1 MiB; at most `MAX_HOOKED_PARAMS` hooks) stamps the time, and the latest
stamp of a backward is the launch.  A backward under ``no_sync()`` launches
nothing and stamps nothing; a model with a comm hook of the script's own has its
buckets timed one by one instead.  A record that does not match the model
leaves the span out (in flight not measured).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

MAX_HOOKED_PARAMS = 8
"""More parameters than this in the first bucket (many tiny ones): only the last
eight DDP saw ready are hooked."""

MAX_READS = 5
"""DDP's logging record is read (about 0.2 ms) at most this many times, at the
first backward passes after its buckets were rebuilt, then never again."""


class FirstBucket:
    """One DDP model's first-bucket launch time in the running backward."""

    def __init__(self, ddp: Any, parameters: Sequence[Any], clock: Callable[[], float],
                 on_gpu: Callable[[FirstBucket], None] | None = None) -> None:
        """``clock`` stamps the launch (gloo); ``on_gpu`` instead (CUDA) records it on
        the GPU (`cuda_timing.CudaPhaseTimer.first_bucket_ready`), hooked on the
        timed steps only (`attach` and `detach` around them)."""
        self._ddp = weakref.ref(ddp)
        self._parameters = [weakref.ref(p) for p in parameters]
        self._clock = clock
        self._on_gpu = on_gpu
        self._handles: list[Any] = []
        # The first bucket's parameters, hooked; weakly: a deleted model frees them.
        self._hooked: list[weakref.ref[Any]] = []
        self._reads = 0
        self.launched: float | None = None  # the running backward's first-bucket launch

    @property
    def model(self) -> Any:
        """The DDP model; None once it is gone."""
        return self._ddp()

    def arm(self) -> None:
        """At a backward's start (training thread): forget a launch no wait closed,
        and hook the first bucket once DDP has rebuilt its buckets (at most
        `MAX_READS` tries)."""
        self.launched = None
        if self._hooked or self._reads >= MAX_READS:
            return
        ddp = self._ddp()
        if (ddp is None or not getattr(ddp, "_has_rebuilt_buckets", False)
                or not getattr(ddp, "require_backward_grad_sync", True)):
            return  # no record yet, or a no_sync() backward (it would not have one either)
        self._reads += 1
        indices = first_bucket(ddp._get_ddp_logging_data())
        if not indices:
            return
        found = [self._parameters[i]() for i in indices if i < len(self._parameters)]
        params = [p for p in found if p is not None]
        if len(params) != len(indices):
            self._reads = MAX_READS  # the record does not match the model: give up
            return
        self._hooked = [weakref.ref(p) for p in params[-MAX_HOOKED_PARAMS:]]
        self.attach()

    def attach(self) -> None:
        """Hook the first bucket's parameters (again, after `detach`)."""
        if not self._handles:
            self._handles = [p.register_post_accumulate_grad_hook(self._stamp)
                             for ref in self._hooked if (p := ref()) is not None]

    def detach(self) -> None:
        """Take the hooks off, keeping what to hook (`scripts/bench_overhead.py --ddp`
        times blocks without them)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _stamp(self, param: Any) -> None:
        # Not under no_sync() (nothing is launched).  On gloo, not with a comm hook
        # the script registered either: its buckets are spans one by one
        # (`comm.timed_hook`); on CUDA they are not, and this is the launch.
        ddp = self._ddp()
        if ddp is None or not getattr(ddp, "require_backward_grad_sync", False):
            return
        if self._on_gpu is not None:  # CUDA: hooked for a timed backward only
            self._on_gpu(self)
        elif not getattr(ddp, "_comm_hooks", None):
            self.launched = self._clock()

    def take(self) -> float | None:
        """The running backward's launch time, if its first bucket was launched; reset."""
        launched, self.launched = self.launched, None
        return launched

    def remove(self) -> None:
        """Take the hooks off for good."""
        self.detach()
        self._hooked = []
        self._reads = MAX_READS


def first_bucket(record: Any) -> list[int]:
    """The parameter indices of DDP's first rebuilt bucket, from its logging record
    (``rebuilt_per_bucket_param_indices``: ``"9 8 7 6, 5 4 2 3 1 0"``); [] when absent."""
    text = record.get("rebuilt_per_bucket_param_indices") if isinstance(record, dict) else None
    if not isinstance(text, str) or not text.strip():
        return []
    head = text.split(",")[0].split()
    return [int(i) for i in head] if all(i.isdigit() for i in head) else []
