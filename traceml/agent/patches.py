"""The instrumentation points inside a training rank, installed and removed together
(agent): the wrappers live by what they time (`input_patches`, `model_patches`,
`optimizer_patches`; communication: `comm`).

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
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import dataloader as _dataloader

from traceml.agent.comm import CommTiming
from traceml.agent.input_patches import wrap_copy, wrap_next
from traceml.agent.model_patches import (
    HOLDS_PARAMETERS,
    compiling_check,
    wrap_backward,
    wrap_module_call,
)
from traceml.agent.optimizer_patches import OptimizerHooks, scaler_classes, wrap_scaler_step
from traceml.agent.probe import Probe


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


def copy_timing() -> bool:
    """Whether host-to-device copies can happen here (an accelerator is visible)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def _copy_patches(probe: Probe) -> list[Patch]:
    return [_AddedPatch(torch.Tensor, "to", wrap_copy(probe)),
            _AddedPatch(torch.Tensor, "cuda", wrap_copy(probe)),
            _AddedPatch(torch.Tensor, "pin_memory", wrap_copy(probe, pinning=True))]


def _wrap_compile(probe: Probe, module_call: Patch) -> Callable[[Any], Any]:
    """``torch.compile``, which afterwards tells dynamo to run the ``Module.__call__``
    wrapper as it is and compile what it calls: otherwise a compiled module's
    frame is the wrapper's, and dynamo's messages (recompiles, graph breaks) name
    traceml/agent/model_patches.py instead of the model's forward.  Dynamo is imported
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
            Patch(_dataloader._BaseDataLoaderIter, "__next__", wrap_next(probe)),
            Patch(torch.nn.Module, "__call__", wrap_module_call(probe)),
            Patch(torch.autograd, "backward", wrap_backward(probe)),
        ]
        self.patches += [Patch(cls, "step", wrap_scaler_step(probe)) for cls in scaler_classes()]
        if "compile" in vars(torch):
            self.patches.append(Patch(torch, "compile", _wrap_compile(probe, self.patches[1])))
        if copy_timing() if copies is None else copies:
            self.patches += _copy_patches(probe)
        self.hooks = OptimizerHooks(probe)
        self.comm = CommTiming(probe, compiling_check())
        self.installed = False

    def install(self) -> None:
        # Cached by id: modules of an earlier install may be gone, their ids reused.
        HOLDS_PARAMETERS.clear()
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
