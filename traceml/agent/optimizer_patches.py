"""The optimizer step inside a training rank (agent): torch's global optimizer step
hooks and ``GradScaler.step`` (a skipped step, inf gradients, still ends the
iteration); `traceml.agent.patches` installs them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from threading import get_ident
from typing import Any

from traceml.agent.probe import Probe
from traceml.wire.events import OPTIMIZER, OPTIMIZER_END, OPTIMIZER_SKIPPED


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


def wrap_scaler_step(probe: Probe) -> Callable[[Any], Any]:
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


def scaler_classes() -> list[type]:
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
