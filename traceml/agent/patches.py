"""The instrumentation points inside a training rank (agent).

Each patch has ``install()``/``uninstall()``; nothing is patched at import
time.  Every wrapper passes straight through when the probe is off, when it
runs on a thread other than the main one, or while a forward/backward is
already being timed, so nested modules and autograd re-entry cost one
attribute check.

Instrumented (SPEC R-AG-2):

* ``_BaseDataLoaderIter.__next__`` — input.
* ``Module.__call__`` — the outermost call with grad enabled is forward (a
  parameter-free module such as a loss adds time, not a forward count); not
  while torch.compile traces (no graph breaks) nor inside backward (activation
  checkpointing recomputes forward there).  Without grad it is a possible
  evaluation pass.
* ``Tensor.backward`` and ``torch.autograd.backward`` — backward, re-entrancy
  guarded.
* global optimizer step pre/post hooks — optimizer (patching the base class
  would do nothing: every optimizer overrides ``step``).
* ``GradScaler.step`` — optimizer, and a skipped step (inf gradients) still
  ends the iteration.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from threading import get_ident
from typing import Any

import torch
from torch.utils.data import dataloader as _dataloader

from traceml.agent.probe import Probe
from traceml.agent.steps import BACKWARD, FORWARD, INPUT, OPTIMIZER


def _compiling_check() -> Callable[[], bool]:
    compiler = getattr(torch, "compiler", None)
    fn = getattr(compiler, "is_compiling", None)
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
    tracker, clock = probe.tracker, probe.clock

    def make(orig: Any) -> Any:
        def __next__(self: Any) -> Any:
            if probe.off or get_ident() != probe.thread_id:
                return orig(self)
            try:
                tracker.enter(INPUT, clock())
            except Exception as exc:  # fail open
                probe.on_error(exc)
            exhausted = False
            try:
                return orig(self)
            except StopIteration:
                exhausted = True
                raise
            finally:
                try:
                    tracker.exit(clock(), True, exhausted)
                except Exception as exc:  # fail open
                    probe.on_error(exc)
        return __next__
    return make


_HOLDS_PARAMETERS: dict[int, bool] = {}


def _holds_parameters(module: Any) -> bool:
    """Whether a module has parameters; cached by id (outermost calls only)."""
    key = id(module)
    known = _HOLDS_PARAMETERS.get(key)
    if known is None:
        if len(_HOLDS_PARAMETERS) > 4096:
            _HOLDS_PARAMETERS.clear()
        known = _HOLDS_PARAMETERS[key] = any(True for _ in module.parameters())
    return known


def _wrap_module_call(probe: Probe) -> Callable[[Any], Any]:
    is_compiling = _compiling_check()
    grad_enabled = torch.is_grad_enabled
    tracker, clock = probe.tracker, probe.clock

    def make(orig: Any) -> Any:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if probe.mute or probe.off or is_compiling() or get_ident() != probe.thread_id:
                return orig(self, *args, **kwargs)
            probe.mute += 1
            timed = grad_enabled()
            timer = probe.cuda_timer if timed else None
            try:
                if timed:
                    tracker.enter(FORWARD, clock())
                    if timer is not None:
                        timer.start(FORWARD)
                else:
                    tracker.nograd_forward(clock())
            except Exception as exc:  # fail open
                probe.on_error(exc)
            try:
                return orig(self, *args, **kwargs)
            finally:
                probe.mute -= 1
                if timed:
                    if timer is not None:
                        timer.stop()
                    # A loss module's time is forward time, but only a module
                    # with parameters counts as a forward pass.
                    counted = _HOLDS_PARAMETERS.get(id(self))
                    if counted is None:
                        counted = _holds_parameters(self)
                    try:
                        tracker.exit(clock(), counted)
                    except Exception as exc:  # fail open
                        probe.on_error(exc)
        return __call__
    return make


def _wrap_backward(probe: Probe) -> Callable[[Any], Any]:
    tracker, clock = probe.tracker, probe.clock

    def make(orig: Any) -> Any:
        def backward(*args: Any, **kwargs: Any) -> Any:
            if probe.in_backward or probe.off or get_ident() != probe.thread_id:
                return orig(*args, **kwargs)
            probe.in_backward = True
            probe.mute += 1
            timer = probe.cuda_timer
            try:
                tracker.enter(BACKWARD, clock())
                if timer is not None:
                    timer.start(BACKWARD)
            except Exception as exc:  # fail open
                probe.on_error(exc)
            try:
                return orig(*args, **kwargs)
            finally:
                if timer is not None:
                    timer.stop()
                try:
                    tracker.exit(clock())
                except Exception as exc:  # fail open
                    probe.on_error(exc)
                probe.mute -= 1
                probe.in_backward = False
        backward.__doc__ = orig.__doc__
        backward.__wrapped__ = orig  # type: ignore[attr-defined]
        return backward
    return make


def _wrap_scaler_step(probe: Probe) -> Callable[[Any], Any]:
    def make(orig: Any) -> Any:
        def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if probe.opt_depth or probe.skip():
                return orig(self, optimizer, *args, **kwargs)
            before = probe.num_optimizer_calls
            probe.enter(OPTIMIZER)
            timer = probe.cuda_timer
            if timer is not None:
                timer.start(OPTIMIZER)
            probe.opt_depth += 1
            try:
                return orig(self, optimizer, *args, **kwargs)
            finally:
                probe.opt_depth -= 1
                if timer is not None:
                    timer.stop()
                probe.exit()
                probe.optimizer_done(skipped=probe.num_optimizer_calls == before)
        return step
    return make


class OptimizerHooks:
    """torch's global optimizer step hooks, as an install/uninstall pair."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.handles: list[Any] = []

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        probe = self.probe
        probe.num_optimizer_calls += 1
        if probe.skip():
            return
        depth = probe.opt_depth
        if depth and probe.tracker.depth(OPTIMIZER) == 0:
            depth = 0  # a previous step raised before its post hook ran
        if depth == 0:
            try:
                probe.tracker.enter(OPTIMIZER, probe.clock())
                if probe.cuda_timer is not None:
                    probe.cuda_timer.start(OPTIMIZER)
            except Exception as exc:  # fail open
                probe.on_error(exc)
        probe.opt_depth = depth + 1

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        probe = self.probe
        if probe.opt_depth == 0 or probe.skip():
            return
        probe.opt_depth -= 1
        if probe.opt_depth == 0:
            try:
                if probe.cuda_timer is not None:
                    probe.cuda_timer.stop()
                now = probe.clock()
                probe.tracker.exit(now)
                probe.tracker.optimizer_done(now)
            except Exception as exc:  # fail open
                probe.on_error(exc)

    def install(self) -> None:
        from torch.optim import optimizer as opt_mod

        self.handles = [
            opt_mod.register_optimizer_step_pre_hook(self._pre),
            opt_mod.register_optimizer_step_post_hook(self._post),
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


class Instrumentation:
    """All patches of one rank, installed and removed together."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.patches: list[Patch] = [
            Patch(_dataloader._BaseDataLoaderIter, "__next__", _wrap_next(probe)),
            Patch(torch.nn.Module, "__call__", _wrap_module_call(probe)),
            Patch(torch.Tensor, "backward", _wrap_backward(probe)),
            Patch(torch.autograd, "backward", _wrap_backward(probe)),
        ]
        self.patches += [Patch(cls, "step", _wrap_scaler_step(probe)) for cls in _scaler_classes()]
        self.hooks = OptimizerHooks(probe)
        self.installed = False

    def install(self) -> None:
        done: list[Patch] = []
        try:
            for patch in self.patches:
                patch.install()
                done.append(patch)
            self.hooks.install()
        except Exception:
            for patch in reversed(done):
                patch.uninstall()
            raise
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.hooks.uninstall()
        for patch in reversed(self.patches):
            patch.uninstall()
        self.installed = False
