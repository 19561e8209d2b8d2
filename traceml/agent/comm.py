"""Communication timing inside a training rank (agent side).

Two numbers per step (SPEC R-COMM-1):

* **exposed** communication, a phase like the others: the time the training
  thread is blocked on collectives.  DDP blocks at the end of backward, where
  its reducer waits for every bucket's all-reduce; a collective the script
  calls blocks for its whole call (synchronous) or inside ``Work.wait()``
  (``async_op=True``); FSDP waits inside forward and backward.
* **in flight**: every collective's launch-to-completion interval, logged as a
  span; the collector takes their union per step, so the part that backward
  compute hid is ``in flight - exposed``.

DDP keeps torch's own C++ all-reduce: a Python communication hook costs
10-25 µs per gradient bucket on the training thread, more than the rest of the
agent per step.  Instead, once the process has a DDP model, each backward puts
a prehook on its graph's root; as the engine starts it queues an autograd
final callback, which runs when backward's compute is done and before DDP's
reducer (which queues its own when its last bucket is ready) waits for the
all-reduces: that opens the exposed phase, and a callback queued from it,
run after DDP's, closes it.  One prehook and two callbacks per backward,
nothing per bucket.  A hook the script registers (Python already) is wrapped
to log each bucket's span too; it still runs, and its result is used.
DDP's own buckets are not spans, so a DDP step's in-flight time is null
unless the script registered a hook.

Python collectives (``torch.distributed.all_reduce`` and the others in
``COLLECTIVES``), as the script or FSDP calls them, are wrapped at module
level; ``Work.wait`` is wrapped for the asynchronous ones.

On gloo every time is the host clock.  A CUDA collective's future completes
when its kernels are queued, not done, so in flight is not measured there
(no spans: the step's in-flight time is null, never a wrong number); the
exposed phase still is, being host time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from threading import get_ident
from typing import Any

import torch
import torch.distributed as dist

from traceml import phases
from traceml.agent.probe import Probe
from traceml.protocol import END

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "broadcast", "broadcast_object_list", "all_to_all", "all_to_all_single", "reduce",
    "gather", "scatter", "barrier", "all_reduce_coalesced", "all_gather_coalesced",
)
"""The torch.distributed functions timed (those this torch has)."""

MAX_PENDING_WORKS = 1024
"""Asynchronous collectives remembered until their ``wait()``; a script that
never waits for its works cannot grow this past the bound."""

COMM = phases.code("communication")


def _takes_part(probe: Probe) -> bool:
    """Whether a collective call here is the training's: on the training thread,
    or on an autograd thread while the training thread waits in backward."""
    return not probe.off and not probe.in_comm and (
        get_ident() == probe.thread_id or probe.in_backward)


class CommTiming:
    """The DDP hook, the collective wrappers and ``Work.wait``, installed together."""

    def __init__(self, probe: Probe, warn: Callable[[str], None]) -> None:
        self.probe = probe
        self.warn = warn
        self._works: dict[int, float] = {}  # id(work) -> launch time
        self._originals: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        if not dist.is_available():
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        self._opens = self._exposed_callbacks()
        targets: list[tuple[Any, str, Callable[[Any], Any]]] = [
                   (DDP, "__init__", self._wrap_ddp_init),
                   (DDP, "register_comm_hook", self._wrap_register),
                   (dist.Work, "wait", self._wrap_wait)]
        c10d = dist.distributed_c10d
        for name in COLLECTIVES:
            for owner in (dist, c10d):
                if name in vars(owner):
                    targets.append((owner, name, self._wrap_collective))
        for owner, name, wrap in targets:
            if name in vars(owner):
                original = vars(owner)[name]
                self._originals.append((owner, name, original))
                setattr(owner, name, wrap(original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals = []
        self.probe.on_backward = None

    # -- DDP -------------------------------------------------------------------

    def _wrap_ddp_init(self, orig: Any) -> Any:
        probe, mark = self.probe, self.mark_exposed

        @functools.wraps(orig)
        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:
            orig(ddp, *args, **kwargs)
            # From now on each backward marks where its compute ends (DDP waits
            # from there): one prehook per backward, nothing per bucket.
            probe.on_backward = mark
        return __init__

    def mark_exposed(self, tensors: Any) -> None:
        """Backward begins (training thread): a prehook on the graph's root queues,
        once the engine runs, the callbacks that time DDP's wait at its end."""
        root = tensors[0] if isinstance(tensors, (tuple, list)) and tensors else tensors
        node = getattr(root, "grad_fn", None)
        if node is not None:
            node.register_prehook(self._queue_exposed)

    def _exposed_callbacks(self) -> Callable[[], None]:
        probe, clock, engine = self.probe, self.probe.clock, _engine()
        begins, ends = probe.appenders[COMM], probe.appenders[END]

        def closes() -> None:  # after DDP's reducer finalised backward
            ends(clock())

        def opens() -> None:  # backward's compute is done: DDP waits from here
            begins(clock())
            engine.queue_callback(closes)
        return opens

    def _queue_exposed(self, grad_outputs: Any) -> None:
        # Queued as the engine starts: before DDP queues its finalisation (when
        # its last bucket is ready), so this one runs first.
        _engine().queue_callback(self._opens)

    def _wrap_register(self, orig: Any) -> Any:
        timing = self

        @functools.wraps(orig)
        def register_comm_hook(ddp: Any, state: object, hook: Callable[..., Any]) -> None:
            orig(ddp, state, timing.timed_hook(hook))
        return register_comm_hook

    def timed_hook(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """The script's own ``hook`` (Python, so it pays a Python call per bucket
        already) with each bucket's launch and completion logged as a span."""
        probe, clock, spans = self.probe, self.probe.clock, self.probe.spans.append

        @functools.wraps(hook)
        def timed(state: object, bucket: Any) -> Any:
            if probe.off or probe.in_comm:
                return hook(state, bucket)
            launch = clock()
            probe.in_comm = True
            try:
                future = hook(state, bucket)
            finally:
                probe.in_comm = False
            if bucket.buffer().is_cuda:
                return future

            def done(f: Any) -> Any:
                spans((launch, clock()))
                return f.value()
            return future.then(done)
        return timed

    # -- collectives the script (or FSDP) calls ----------------------------------

    def _wrap_collective(self, orig: Any) -> Any:
        probe, works, clock = self.probe, self._works, self.probe.clock
        begins, ends, spans = probe.appenders[COMM], probe.appenders[END], probe.spans.append

        @functools.wraps(orig)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if not _takes_part(probe):
                return orig(*args, **kwargs)
            probe.in_comm = True
            launch = clock()
            begins(launch)
            try:
                work = orig(*args, **kwargs)
            finally:
                now = clock()
                ends(now)
                probe.in_comm = False
            if work is None:  # synchronous: done when it returns
                if not _on_cuda(args, kwargs):
                    spans((launch, now))
            elif len(works) < MAX_PENDING_WORKS and not _on_cuda(args, kwargs):
                works[id(work)] = launch
            return work
        return collective

    def _wrap_wait(self, orig: Any) -> Any:
        probe, works, clock = self.probe, self._works, self.probe.clock
        begins, ends, spans = probe.appenders[COMM], probe.appenders[END], probe.spans.append

        @functools.wraps(orig)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if not _takes_part(probe):
                return orig(work, *args, **kwargs)
            launch = works.pop(id(work), None)
            probe.in_comm = True
            start = clock()
            begins(start)
            # Complete before it was waited for: it ended by then at the latest.
            complete = launch is not None and work.is_completed()
            try:
                return orig(work, *args, **kwargs)
            finally:
                now = clock()
                ends(now)
                probe.in_comm = False
                if launch is not None:
                    spans((launch, start if complete else now))
        return wait


def _engine() -> Any:
    """torch's autograd engine, which runs the final callbacks of a backward."""
    return torch.autograd.Variable._execution_engine


def _on_cuda(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a collective's first tensor argument lives on a GPU."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return bool(value.is_cuda)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return bool(value[0].is_cuda)
    return False
