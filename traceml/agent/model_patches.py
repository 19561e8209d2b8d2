"""The model wrappers inside a training rank (agent): ``Module.__call__`` (forward,
and the no-grad forwards that may be evaluation) and ``torch.autograd.backward``;
`traceml.agent.patches` installs them.  A Python frame is the cost per call here, so
the hot paths avoid helper calls."""

from __future__ import annotations

from collections.abc import Callable
from threading import get_ident
from typing import Any

import torch

from traceml.agent.probe import Probe
from traceml.wire.events import BACKWARD, END, END_UNCOUNTED, EVAL_FORWARD, FORWARD, NOGRAD_FORWARD


def compiling_check() -> Callable[[], bool]:
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


HOLDS_PARAMETERS: dict[int, bool] = {}


def _holds_parameters(module: Any) -> bool:
    """Whether a module has parameters, for the cache the wrapper reads by id
    (outermost calls only, so the cache stays small)."""
    if len(HOLDS_PARAMETERS) > 4096:
        HOLDS_PARAMETERS.clear()
    known = HOLDS_PARAMETERS[id(module)] = any(True for _ in module.parameters())
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


def wrap_module_call(probe: Probe) -> Callable[[Any], Any]:
    is_compiling = compiling_check()
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
                (evaluates_trained if HOLDS_PARAMETERS.get(id(self)) else evaluates)(clock())
                try:
                    return orig(self, *args, **kwargs)
                finally:
                    probe.mute -= 1
            timer = probe.cuda_timer
            t = clock()
            begins(t)
            watch = probe.forward_watch
            if watch is not None:  # no DataLoader (yet): a model's inputs are the batch
                held = HOLDS_PARAMETERS.get(id(self))
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
                counted = HOLDS_PARAMETERS.get(id(self))
                if counted is None:
                    counted = _holds_parameters(self)
                (ends if counted else ends_uncounted)(clock())
        return __call__
    return make


def wrap_backward(probe: Probe) -> Callable[[Any], Any]:
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
