"""The instrumentation points inside a training rank (agent).

Each patch has ``install()``/``uninstall()``; nothing is patched at import
time.  Every wrapper passes straight through when the probe is off, when it
runs on a thread other than the main one, or while a forward/backward is
already being timed, so nested modules and autograd re-entry cost one
attribute check.  A timed wrapper only appends ``clock()`` to its event code's
list (codes in `traceml.wire.events`): the step state machine runs in the
collector process (`traceml.collector.steps`), so the training thread pays a
clock read and a list append per event.  Python frames are the other cost per
step, so the hot paths avoid helper calls.

Instrumented (SPEC R-AG-2):

* ``_BaseDataLoaderIter.__next__`` — input.
* ``Module.__call__`` — the outermost call with grad enabled is forward (a
  parameter-free module such as a loss adds time, not a forward count); not
  while torch.compile traces (no graph breaks) nor inside backward (activation
  checkpointing recomputes forward there).  Without grad it is a possible
  evaluation pass: ``EVAL_FORWARD`` for a module that has run with grad (the
  trained model), ``NOGRAD_FORWARD`` for any other (a frozen teacher, a metric).
* ``torch.autograd.backward`` — backward, re-entrancy guarded
  (``Tensor.backward`` calls it; not patching both saves a frame a step).
* global optimizer step pre/post hooks — optimizer (patching the base class
  would do nothing: every optimizer overrides ``step``).
* ``GradScaler.step`` — optimizer, and a skipped step (inf gradients) still
  ends the iteration.

The fetch (else the outermost forward) also hands its batch to the probe's
batch watch (`traceml.agent.batch`): a shape compare per batch, a record when
the size changes.
* ``Tensor.to``/``Tensor.cuda``/``Tensor.pin_memory`` — input: a copy of a host
  tensor to a device (or into pinned memory) on the training thread outside
  forward, backward and the optimizer step, the batch's way to the device.
  Installed only when the process can see an accelerator (`copy_timing`): on
  a CPU-only host no such copy exists, and every ``.to`` would pay a Python
  frame for nothing.  With one it costs a frame per call and, inside a
  forward, one attribute check.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from threading import get_ident
from typing import Any

import torch
from torch.utils.data import dataloader as _dataloader

from traceml.agent.comm import CommTiming
from traceml.agent.probe import Probe
from traceml.wire.events import (
    BACKWARD,
    COPY,
    END,
    END_EXHAUSTED,
    END_UNCOUNTED,
    EVAL_FORWARD,
    FORWARD,
    INPUT,
    NOGRAD_FORWARD,
    OPTIMIZER,
    OPTIMIZER_END,
    OPTIMIZER_SKIPPED,
)


def _compiling_check() -> Callable[[], bool]:
    """torch's "is dynamo tracing this code" check: False when run eagerly and
    constant True while dynamo traces, so a traced wrapper takes the plain
    path (no graph break).  The dynamo-only variant is one Python frame.
    Never touches ``torch._dynamo`` unless torch is older than 2.3: importing
    it has side effects on the user's process."""
    compiler = getattr(torch, "compiler", None)
    fn = getattr(compiler, "is_dynamo_compiling", None) or getattr(compiler, "is_compiling", None)
    if fn is None:  # torch < 2.3
        fn = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return fn if fn is not None else (lambda: False)


class Patch:
    """Replace one attribute; put the original back on uninstall."""

    def __init__(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        self.owner, self.name, self.make = owner, name, make
        self.original: Any = None

    def install(self) -> None:
        self.original = self.owner.__dict__[self.name]
        setattr(self.owner, self.name, self.make(self.original))

    def uninstall(self) -> None:
        if self.original is not None:
            setattr(self.owner, self.name, self.original)
            self.original = None


def _wrap_next(probe: Probe) -> Callable[[Any], Any]:
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


_HOLDS_PARAMETERS: dict[int, bool] = {}


def _holds_parameters(module: Any) -> bool:
    """Whether a module has parameters, for the cache the wrapper reads by id
    (outermost calls only, so the cache stays small)."""
    if len(_HOLDS_PARAMETERS) > 4096:
        _HOLDS_PARAMETERS.clear()
    known = _HOLDS_PARAMETERS[id(module)] = any(True for _ in module.parameters())
    return known


def _is_torchs_dispatch(orig: Any) -> bool:
    """Whether ``orig`` is torch's own ``Module.__call__`` (>= 2.1), which only
    picks ``_compiled_call_impl`` when set, else ``_call_impl``.  The wrapper
    then makes that choice itself, so a module call costs no extra frame.  Any
    other ``__call__`` (another tool's patch, a torch that does more there) is
    called as it is."""
    code = getattr(orig, "__code__", None)
    return (orig is torch.nn.Module.__dict__.get("_wrapped_call_impl") and code is not None
            and set(code.co_names) == {"_compiled_call_impl", "_call_impl"})


def _wrap_module_call(probe: Probe) -> Callable[[Any], Any]:
    is_compiling = _compiling_check()
    grad_enabled = torch.is_grad_enabled
    clock = probe.clock
    begins, evaluates, evaluates_trained, ends, ends_uncounted = (
        probe.appenders[c] for c in (FORWARD, NOGRAD_FORWARD, EVAL_FORWARD, END, END_UNCOUNTED))

    def make(orig: Any) -> Any:
        # torch's dispatch, inline: nested calls (every submodule of a timed
        # forward, the common case) cost this frame instead of torch's.
        foreign = None if _is_torchs_dispatch(orig) else orig

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if probe.mute or probe.off or is_compiling() or get_ident() != probe.thread_id:
                if foreign is not None:
                    return foreign(self, *args, **kwargs)
                compiled = self._compiled_call_impl
                if compiled is not None:
                    return compiled(*args, **kwargs)
                return self._call_impl(*args, **kwargs)
            probe.mute += 1
            if not grad_enabled():
                # A module known from a timed forward with parameters trains.
                (evaluates_trained if _HOLDS_PARAMETERS.get(id(self)) else evaluates)(clock())
                try:
                    return orig(self, *args, **kwargs)
                finally:
                    probe.mute -= 1
            timer = probe.cuda_timer
            t = clock()
            begins(t)
            watch = probe.forward_watch
            if watch is not None:  # no DataLoader (yet): a model's inputs are the batch
                held = _HOLDS_PARAMETERS.get(id(self))
                if held is None:
                    held = _holds_parameters(self)
                if held:  # not a loss module's
                    watch.see(args or kwargs, t)
            if timer is not None:
                probe.guarded(timer.start, FORWARD)
            try:
                if foreign is not None:
                    return foreign(self, *args, **kwargs)
                compiled = self._compiled_call_impl
                if compiled is not None:
                    return compiled(*args, **kwargs)
                return self._call_impl(*args, **kwargs)
            finally:
                probe.mute -= 1
                if timer is not None:
                    probe.guarded(timer.stop)
                # A loss module's time is forward time, but only a module
                # with parameters counts as a forward pass.
                counted = _HOLDS_PARAMETERS.get(id(self))
                if counted is None:
                    counted = _holds_parameters(self)
                (ends if counted else ends_uncounted)(clock())
        return __call__
    return make


def _wrap_backward(probe: Probe) -> Callable[[Any], Any]:
    clock = probe.clock
    begins, ends = probe.appenders[BACKWARD], probe.appenders[END]

    def make(orig: Any) -> Any:
        def backward(*args: Any, **kwargs: Any) -> Any:
            if probe.in_backward or probe.off or get_ident() != probe.thread_id:
                return orig(*args, **kwargs)
            probe.in_backward = True
            probe.mute += 1
            timer = probe.cuda_timer
            begins(clock())
            on_backward = probe.on_backward
            if on_backward is not None:
                try:
                    on_backward(args[0] if args else kwargs.get("tensors"))
                except Exception as exc:
                    probe.on_error(exc)
            if timer is not None:
                probe.guarded(timer.start, BACKWARD)
            try:
                return orig(*args, **kwargs)
            finally:
                if timer is not None:
                    probe.guarded(timer.stop)
                ends(clock())
                probe.mute -= 1
                probe.in_backward = False
        backward.__doc__ = orig.__doc__
        backward.__wrapped__ = orig  # type: ignore[attr-defined]
        return backward
    return make


class _AddedPatch(Patch):
    """Set an attribute the owner only inherits; delete it on uninstall."""

    def install(self) -> None:
        self.original = getattr(self.owner, self.name)
        assert self.name not in self.owner.__dict__, f"{self.name} is already patched"
        setattr(self.owner, self.name, self.make(self.original))

    def uninstall(self) -> None:
        if self.original is not None:
            delattr(self.owner, self.name)
            self.original = None


def _wrap_copy(probe: Probe, pinning: bool = False) -> Callable[[Any], Any]:
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


def copy_timing() -> bool:
    """Whether host-to-device copies can happen here (an accelerator is visible)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def _copy_patches(probe: Probe) -> list[Patch]:
    return [_AddedPatch(torch.Tensor, "to", _wrap_copy(probe)),
            _AddedPatch(torch.Tensor, "cuda", _wrap_copy(probe)),
            _AddedPatch(torch.Tensor, "pin_memory", _wrap_copy(probe, pinning=True))]


def _optimizer_begins(probe: Probe) -> None:
    """The outermost optimizer step of an iteration begins (training thread)."""
    probe.log(OPTIMIZER)
    if probe.cuda_timer is not None:
        probe.guarded(probe.cuda_timer.start, OPTIMIZER)


def _optimizer_ends(probe: Probe, skipped: bool) -> None:
    """The outermost optimizer step of an iteration ended (training thread)."""
    if probe.cuda_timer is not None:
        probe.guarded(probe.cuda_timer.stop)
    t = probe.clock()  # one clock read: the device mark belongs to this end
    probe.appenders[OPTIMIZER_SKIPPED if skipped else OPTIMIZER_END](t)
    if probe.on_optimizer_end is not None:
        probe.guarded(probe.on_optimizer_end, t)


def _wrap_scaler_step(probe: Probe) -> Callable[[Any], Any]:
    def make(orig: Any) -> Any:
        def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if probe.opt_depth or probe.skip():
                return orig(self, optimizer, *args, **kwargs)
            before = probe.num_inner_steps
            _optimizer_begins(probe)
            probe.opt_depth += 1
            try:
                return orig(self, optimizer, *args, **kwargs)
            finally:
                probe.opt_depth -= 1
                _optimizer_ends(probe, skipped=probe.num_inner_steps == before)
        return step
    return make


class OptimizerHooks:
    """torch's global optimizer step hooks, as an install/uninstall pair."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.handles: list[Any] = []

    def _hooks(self) -> tuple[Callable[..., None], Callable[..., None]]:
        probe = self.probe
        clock = probe.clock
        begins, ends = probe.appenders[OPTIMIZER], probe.appenders[OPTIMIZER_END]

        # Without CUDA, begin and end are one event each, logged here rather
        # than through the helpers: a frame less per hook call.
        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            if probe.off or get_ident() != probe.thread_id:
                return
            if probe.opt_depth == 0:
                if probe.cuda_timer is None:
                    begins(clock())
                else:
                    _optimizer_begins(probe)
            else:  # inside a GradScaler step (or a wrapping optimizer): it did step
                probe.num_inner_steps += 1
            probe.opt_depth += 1

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            if probe.opt_depth == 0 or probe.off or get_ident() != probe.thread_id:
                return
            probe.opt_depth -= 1
            if probe.opt_depth == 0:
                if probe.cuda_timer is None and probe.on_optimizer_end is None:
                    ends(clock())
                else:
                    _optimizer_ends(probe, skipped=False)

        return pre, post

    def install(self) -> None:
        from torch.optim import optimizer as opt_mod

        pre, post = self._hooks()
        self.handles = [
            opt_mod.register_optimizer_step_pre_hook(pre),
            opt_mod.register_optimizer_step_post_hook(post),
        ]

    def uninstall(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _scaler_classes() -> list[type]:
    classes: list[type] = []
    amp = sys.modules.get("torch.amp.grad_scaler")
    if amp is None:
        try:
            import torch.amp.grad_scaler as amp
        except ImportError:
            amp = None
    if amp is not None:
        classes.append(amp.GradScaler)
    try:
        cuda_amp: Any = importlib.import_module("torch.cuda.amp")
    except ImportError:
        cuda_amp = None
    cuda_scaler: Any = getattr(cuda_amp, "GradScaler", None)
    if cuda_scaler is not None and "step" in cuda_scaler.__dict__:
        classes.append(cuda_scaler)
    return classes


def _wrap_compile(probe: Probe, module_call: Patch) -> Callable[[Any], Any]:
    """``torch.compile``, which afterwards tells dynamo to run the ``Module.__call__``
    wrapper as it is and compile what it calls: otherwise a compiled module's
    frame is the wrapper's, and dynamo's messages (recompiles, graph breaks) name
    traceml/agent/patches.py instead of the model's forward.  Dynamo is imported
    by torch.compile itself; traceml never imports it."""
    def make(orig: Any) -> Any:
        @functools.wraps(orig)
        def compile(*args: Any, **kwargs: Any) -> Any:
            probe.compiled = True  # FLOPs are not counted in compiled regions
            compiled = orig(*args, **kwargs)
            try:
                wrapper: Any = torch.nn.Module.__dict__.get("__call__")
                skip_code = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
                if (skip_code is not None and wrapper is not None
                        and wrapper is not module_call.original):
                    skip_code(wrapper.__code__)
            except Exception:  # only dynamo's messages are at stake: never the compile
                pass
            return compiled
        return compile
    return make


class Instrumentation:
    """All patches of one rank, installed and removed together."""

    def __init__(self, probe: Probe, copies: bool | None = None) -> None:
        self.probe = probe
        self.patches: list[Patch] = [
            Patch(_dataloader._BaseDataLoaderIter, "__next__", _wrap_next(probe)),
            Patch(torch.nn.Module, "__call__", _wrap_module_call(probe)),
            Patch(torch.autograd, "backward", _wrap_backward(probe)),
        ]
        self.patches += [Patch(cls, "step", _wrap_scaler_step(probe)) for cls in _scaler_classes()]
        if "compile" in vars(torch):
            self.patches.append(Patch(torch, "compile", _wrap_compile(probe, self.patches[1])))
        if copy_timing() if copies is None else copies:
            self.patches += _copy_patches(probe)
        self.hooks = OptimizerHooks(probe)
        self.comm = CommTiming(probe, _compiling_check())
        self.installed = False

    def install(self) -> None:
        # Cached by id: modules of an earlier install may be gone, their ids reused.
        _HOLDS_PARAMETERS.clear()
        done: list[Patch] = []
        try:
            for patch in self.patches:
                patch.install()
                done.append(patch)
            self.hooks.install()
            self.comm.install()
        except Exception:
            self.comm.uninstall()
            self.hooks.uninstall()
            for patch in reversed(done):
                patch.uninstall()
            raise
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.comm.uninstall()
        self.hooks.uninstall()
        for patch in reversed(self.patches):
            patch.uninstall()
        self.installed = False
