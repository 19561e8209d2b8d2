"""Communication timing inside a training rank (agent side).

Two numbers per step (SPEC R-COMM-1):

* **exposed** communication, a phase like the others: the time the training
  thread is blocked on collectives.  DDP blocks at the end of backward, where
  its reducer waits for every bucket's all-reduce; a collective the script
  calls blocks for its whole call (synchronous) or inside ``Work.wait()``
  (``async_op=True``); FSDP waits inside forward and backward.
* **in flight**: every collective's launch-to-completion interval, logged as a
  span; the collector takes their union per step, so the part that backward
  compute hid is ``in flight - exposed - hook``.

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
DDP's own buckets are not spans one by one: its in-flight span is DDP's own
"backward communication time", from its first bucket's launch (a
post-accumulate-grad hook on each parameter of that bucket, at most eight,
`traceml.agent.ddp_buckets`) to the end of its wait.

Python collectives (``torch.distributed.all_reduce`` and the others in
``COLLECTIVES``), as the script or FSDP calls them, are wrapped at module
level (one wrapper under both of its names, passed straight through while
torch.compile traces); ``Work.wait`` is wrapped for the asynchronous ones, and
DDP's ``_sync_buffers`` (its C++ broadcast of BatchNorm statistics before each
forward) is timed too.

On gloo every time is the host clock.  On CUDA the host clock says nothing: a
NCCL collective returns once its kernels are queued and DDP's reducer makes
streams wait, not the host, so host time would read as free communication.
There, on the steps the CUDA path times (`traceml.agent.cuda_timing`), the same
two callbacks record CUDA events on the current stream instead: the first once
backward's compute is queued, the second after DDP's reducer has made the
stream wait for its all-reduces (and queued the copy of their results into the
gradients).  The GPU time between them is the time the compute stream waited
on communication, ``gpu_communication_ms``, nested in backward's GPU time and
taken out of it.  Nothing per bucket, no synchronisation, no host event.
COMMUNICATION-BOUND reads it on CUDA (`traceml.diagnosis.communication`);
`scripts/gpu_check.sh` checks it against the check's own CUDA events.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from threading import get_ident
from typing import Any

import torch
import torch.distributed as dist

from traceml import phases
from traceml.agent.ddp_buckets import FirstBucket
from traceml.agent.probe import Probe
from traceml.wire.events import END

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "broadcast", "broadcast_object_list", "all_to_all", "all_to_all_single", "reduce",
    "gather", "scatter", "barrier", "all_reduce_coalesced", "all_gather_coalesced",
)
"""The torch.distributed functions timed (those this torch has)."""

COMM = phases.code("communication")
HOOK = phases.code("hook")


class CommTiming:
    """DDP's wait, the collective wrappers and ``Work.wait``, installed together."""

    def __init__(self, probe: Probe, is_compiling: Callable[[], bool]) -> None:
        self.probe = probe
        self.is_compiling = is_compiling
        # An asynchronous collective's launch, until its wait(); gone with the work.
        self._works: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        self._originals: list[tuple[Any, str, Any]] = []
        self._handle: Any = None  # the prehook on the running backward's root
        self.first_buckets: list[FirstBucket] = []  # each host DDP model's (in flight)
        self.gpu_first_buckets: list[FirstBucket] = []  # each CUDA DDP model's
        self._opens = self._exposed_callbacks()
        self._gpu_opens = self._gpu_callbacks()
        self._queued = self._opens  # what the root's prehook queues (gloo's or the GPU's)

    def install(self) -> None:
        if not dist.is_available():
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Inside DDP's __init__, not around it: warnings DDP gives its caller
        # still point at the script's line.
        self._patch(DDP, "_ddp_init_helper", self._wrap_ddp_init)
        self._patch(DDP, "register_comm_hook", self._wrap_register)
        self._patch(DDP, "_sync_buffers", self._wrap_sync_buffers)
        self._patch(dist.Work, "wait", self._wrap_wait)
        c10d = dist.distributed_c10d
        for name in COLLECTIVES:
            # One wrapper under both names, so torch.compile's remapping of a
            # collective to its traceable form still finds the original.
            original = vars(c10d).get(name)
            if original is not None:
                wrapped = self._patch(c10d, name, self._wrap_collective)
                if vars(dist).get(name) is original:
                    self._originals.append((dist, name, original))
                    setattr(dist, name, wrapped)

    def _patch(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> Any:
        original = vars(owner).get(name)
        if original is None:
            return None
        self._originals.append((owner, name, original))
        wrapped = wrap(original)
        setattr(owner, name, wrapped)
        return wrapped

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals = []
        self.probe.on_backward = None
        for first in (*self.first_buckets, *self.gpu_first_buckets):
            first.remove()
        self.first_buckets.clear()  # the same list: the callbacks hold it
        self.gpu_first_buckets.clear()

    def _takes_part(self, args: tuple[Any, ...] = (), kwargs: Any = None) -> bool:
        """Whether a collective call here is the training's and can be timed: on
        the training thread, or on an autograd thread running the backward the
        training thread waits in; host tensors (a CUDA collective returns when
        its kernels are queued: its time is the GPU's, not measured here)."""
        probe = self.probe
        if probe.off or probe.in_comm or self.is_compiling():
            return False
        if get_ident() != probe.thread_id and not (probe.in_backward and _in_graph_task()):
            return False
        return not _on_cuda(args, kwargs or {})

    # -- DDP -------------------------------------------------------------------

    def _wrap_ddp_init(self, orig: Any) -> Any:
        probe, mark, firsts = self.probe, self.mark_exposed, self.first_buckets
        mark_gpu, gpu_firsts, ready = self.mark_exposed_gpu, self.gpu_first_buckets, self._ready

        @functools.wraps(orig)
        def _ddp_init_helper(ddp: Any, parameters: Any, *args: Any, **kwargs: Any) -> None:
            orig(ddp, parameters, *args, **kwargs)
            # From now on each backward marks where its compute ends (DDP waits
            # from there): one prehook per backward, nothing per bucket.  On
            # CUDA DDP's reducer makes streams wait, not the host: the same
            # callbacks record CUDA events instead, on the timed steps only.
            on_host = _on_host(ddp)
            if on_host:
                probe.on_backward = mark
            elif probe.on_backward is None:  # CUDA: GPU events on the timed steps only
                probe.on_backward = mark_gpu
            hooked = firsts if on_host else gpu_firsts
            try:
                for first in [f for f in hooked if f.model in (ddp, None)]:  # set up
                    first.remove()  # again, or its model is gone
                    hooked.remove(first)
                hooked.append(FirstBucket(ddp, list(parameters), probe.clock,
                                          None if on_host else ready))
            except Exception as exc:
                probe.on_error(exc)
        return _ddp_init_helper

    def _ready(self, first: FirstBucket) -> None:
        """A CUDA DDP model's first bucket is ready (autograd's thread, timed steps)."""
        timer = self.probe.cuda_timer
        if timer is not None and not self.probe.off:
            self.probe.guarded(timer.first_bucket_ready, first)

    def mark_exposed(self, tensors: Any) -> None:
        """Backward begins (training thread): a prehook on the graph's root queues,
        once the engine runs, the callbacks that time DDP's wait at its end; each
        DDP model's first bucket is hooked once its buckets are rebuilt."""
        for first in self.first_buckets:
            first.arm()
        self._hook_root(tensors, self._opens)

    def mark_exposed_gpu(self, tensors: Any) -> None:
        """A CUDA DDP model's backward begins (training thread): on a step the CUDA
        path times, the same prehook queues the callbacks that record DDP's wait on
        the GPU (`_gpu_callbacks`); on the other steps, nothing."""
        if self.probe.cuda_timer is None:
            return
        self._hook_root(tensors, self._gpu_opens)
        if self._handle is not None:  # its callbacks will take the hooks off again
            for first in self.gpu_first_buckets:  # in flight: hooked for this backward
                first.arm()
                first.attach()

    def _hook_root(self, tensors: Any, opens: Callable[[], None]) -> None:
        """A prehook on the graph's root that queues ``opens`` as the engine starts
        (``_handle``; None without a graph)."""
        root = tensors[0] if isinstance(tensors, (tuple, list)) and tensors else tensors
        node = getattr(root, "grad_fn", None)
        self._handle = None
        if node is not None:
            self._queued = opens
            self._handle = node.register_prehook(self._queue_exposed)

    def _gpu_callbacks(self) -> Callable[[], None]:
        probe, engine, firsts = self.probe, _engine(), self.gpu_first_buckets

        def closes() -> None:  # after DDP's reducer made the stream wait for its work
            timer = probe.cuda_timer
            if timer is not None:
                probe.guarded(timer.stop)
            for first in firsts:  # untimed backwards run without the hooks
                first.detach()

        def opens() -> None:  # backward's compute is queued: the stream waits from here
            timer = probe.cuda_timer
            if timer is None:
                return
            try:
                timer.start(COMM)
                engine.queue_callback(closes)
            except Exception as exc:
                probe.on_error(exc)
        return opens

    def _queue_exposed(self, grad_outputs: Any) -> None:
        # Queued as the engine starts: before DDP queues its finalisation (when
        # its last bucket is ready), so this one runs first.  The hook goes at
        # once: a graph kept for another backward gets a fresh one then.
        try:
            self._handle.remove()
            _engine().queue_callback(self._queued)
        except Exception as exc:
            self.probe.on_error(exc)

    def _exposed_callbacks(self) -> Callable[[], None]:
        probe, clock, engine = self.probe, self.probe.clock, _engine()
        begins, ends = probe.appenders[COMM], probe.appenders[END]
        spans, firsts = probe.spans.append, self.first_buckets

        def closes() -> None:  # after DDP's reducer finalised backward
            now = clock()
            ends(now)
            for first in firsts:  # DDP's all-reduce: first launch to the end of its wait
                launched = first.take()
                if launched is not None:
                    spans((launched, now))

        def opens() -> None:  # backward's compute is done: DDP waits from here
            try:
                begins(clock())
                engine.queue_callback(closes)
            except Exception as exc:
                probe.on_error(exc)
        return opens

    def _wrap_sync_buffers(self, orig: Any) -> Any:
        """DDP's broadcast of its buffers (BatchNorm statistics) in forward: a
        blocking collective the wrappers below do not see (it is C++)."""
        timing = self

        @functools.wraps(orig)
        def _sync_buffers(ddp: Any) -> Any:
            if not _on_host(ddp) or not timing._takes_part():
                return orig(ddp)
            return timing._timed(orig, (ddp,), {})
        return _sync_buffers

    def _wrap_register(self, orig: Any) -> Any:
        timing = self

        @functools.wraps(orig)
        def register_comm_hook(ddp: Any, state: object, hook: Callable[..., Any]) -> None:
            orig(ddp, state, timing.timed_hook(hook))
        return register_comm_hook

    def timed_hook(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """The script's own ``hook`` (Python, so it pays a Python call per bucket
        already) with each bucket's launch and completion logged as a span.

        The hook's synchronous part (what it does before it returns its future:
        compression, PowerSGD's matrices, launching its collectives) is the
        ``hook`` phase, communication, not backward: on gloo it runs on the
        training thread, inside backward.  Its result is returned untouched."""
        probe, clock, spans = self.probe, self.probe.clock, self.probe.spans.append
        begins, ends = probe.appenders[HOOK], probe.appenders[END]

        @functools.wraps(hook)
        def timed(state: object, bucket: Any) -> Any:
            if probe.off or probe.in_comm:
                return hook(state, bucket)
            on_host = not bucket.buffer().is_cuda
            # A phase only on the training thread (the one whose events make steps).
            on_thread = on_host and get_ident() == probe.thread_id
            launch = clock()
            if on_thread:
                begins(launch)
            probe.in_comm = True
            try:
                future = hook(state, bucket)
            finally:
                probe.in_comm = False
                if on_thread:
                    ends(clock())
            if not on_host:
                return future

            def done(f: Any) -> Any:
                spans((launch, clock()))
                return f.value()
            return future.then(done)
        return timed

    # -- collectives the script (or FSDP) calls ----------------------------------

    def _timed(self, call: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        """``call`` as exposed communication; its span too when it is synchronous,
        its launch kept for its wait() when it returns a work."""
        probe = self.probe
        probe.in_comm = True
        launch = probe.clock()
        probe.appenders[COMM](launch)
        try:
            work = call(*args, **kwargs)
        finally:
            now = probe.clock()
            probe.appenders[END](now)
            probe.in_comm = False
        if work is None or not isinstance(work, dist.Work):  # synchronous: done now
            probe.spans.append((launch, now))
        else:
            self._works[work] = launch
        return work

    def _wrap_collective(self, orig: Any) -> Any:
        timing = self

        @functools.wraps(orig)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if not timing._takes_part(args, kwargs):
                return orig(*args, **kwargs)
            return timing._timed(orig, args, kwargs)
        return collective

    def _wrap_wait(self, orig: Any) -> Any:
        timing, probe, works = self, self.probe, self._works

        @functools.wraps(orig)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            # Only the works of collectives timed at their launch (host tensors).
            launch = works.pop(work, None)
            if launch is None or not timing._takes_part():
                return orig(work, *args, **kwargs)
            start = complete = None
            probe.in_comm = True
            try:
                start = probe.clock()
                probe.appenders[COMM](start)
                # Complete before it was waited for: it ended by then at the latest.
                complete = work.is_completed()
                return orig(work, *args, **kwargs)
            finally:
                now = probe.clock()
                if start is not None:
                    probe.appenders[END](now)
                probe.in_comm = False
                if start is not None:
                    probe.spans.append((launch, start if complete else now))
        return wait


def _engine() -> Any:
    """torch's autograd engine, which runs the final callbacks of a backward."""
    return torch.autograd.Variable._execution_engine


def _on_host(ddp: Any) -> bool:
    """Whether a DDP model's parameters live on the CPU (gloo): its waits are host time."""
    return getattr(ddp, "device_type", "cpu") == "cpu"


def _in_graph_task() -> bool:
    """Whether this thread runs a backward for the autograd engine now."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _on_cuda(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a collective's first tensor argument lives on a GPU."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return bool(value.is_cuda)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return bool(value[0].is_cuda)
    return False
