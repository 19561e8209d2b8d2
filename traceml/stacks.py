"""Python stacks of a rank, as stall and crash reports carry them (shared).

Taken three ways: by the agent's sender thread from the training thread
(``sys._current_frames()``, a stall), from an exception's traceback (a crash),
or parsed from the text ``faulthandler`` writes when the launcher signals a
rank whose Python cannot run (a C call holding the GIL) or when a rank dies
of a fatal signal.  Every stack is a tuple of `Frame`, outermost first, as a
traceback prints.  Shared by the agent, the launcher and the diagnosis, so it
imports only the standard library and the phase table.
"""

from __future__ import annotations

import os
import re
import signal
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from traceml import phases

MAX_FRAMES = 48
"""Frames a report keeps: the innermost ones."""

_MAX_TEXT = 300


@dataclass(frozen=True)
class Frame:
    """One frame of a stack."""

    file: str
    line: int
    function: str

    @property
    def user(self) -> bool:
        """Whether this is the script's code, not Python's, torch's or traceml's."""
        return is_user_file(self.file)

    def short(self) -> str:
        """``train.py:42 in forward``."""
        return f"{os.path.basename(self.file)}:{self.line} in {self.function}"

    def to_json(self) -> list[Any]:
        return [self.file, self.line, self.function]


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.add(os.path.dirname(os.path.abspath(__file__)))  # traceml itself
    return tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs if d))


_LIBRARY_DIRS = _library_dirs()
_LIBRARY_PATTERN = re.compile(r"[/\\](site-packages|dist-packages)[/\\]|[/\\]lib[/\\]python\d")


def is_user_file(path: str) -> bool:
    """A file of the user's code: not frozen or generated, not under this or another
    Python's library folders (a worker's interpreter may differ from the launcher's)."""
    if not path or path.startswith("<"):
        return False
    return not (path.startswith(_LIBRARY_DIRS) or _LIBRARY_PATTERN.search(path))


def of_frame(frame: FrameType | None, limit: int = MAX_FRAMES) -> tuple[Frame, ...]:
    """The stack of a running frame, outermost first (its innermost ``limit`` frames)."""
    out: list[Frame] = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        out.append(Frame(code.co_filename, frame.f_lineno or 0, code.co_name))
        frame = frame.f_back
    return tuple(reversed(out))


def of_traceback(tb: TracebackType | None, limit: int = MAX_FRAMES) -> tuple[Frame, ...]:
    """The frames an exception passed through, outermost first (the innermost ``limit``)."""
    out: list[Frame] = []
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append(Frame(code.co_filename, tb.tb_lineno or 0, code.co_name))
        tb = tb.tb_next
    return tuple(out[-limit:])


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FILE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str, thread_id: int | None) -> tuple[Frame, ...]:
    """The stack of thread ``thread_id`` in ``faulthandler``'s output (its last dump
    when there are several); the current thread's when that one is not listed."""
    blocks: list[tuple[int, bool, list[Frame]]] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            blocks.append((int(head.group(2), 16), head.group(1) == "Current thread", []))
            continue
        frame = _FILE.match(line)
        if frame and blocks:
            blocks[-1][2].append(Frame(frame.group(1)[:_MAX_TEXT], int(frame.group(2)),
                                       frame.group(3)[:_MAX_TEXT]))
    chosen = [b for b in blocks if b[0] == thread_id] or [b for b in blocks if b[1]] or blocks
    if not chosen:
        return ()
    return tuple(reversed(chosen[-1][2]))[-MAX_FRAMES:]


def to_json(frames: Iterable[Frame]) -> list[list[Any]]:
    return [f.to_json() for f in frames]


def from_json(items: Any) -> tuple[Frame, ...]:
    """Frames from :func:`to_json`; ValueError when malformed."""
    if not isinstance(items, list) or len(items) > MAX_FRAMES:
        raise ValueError(f"a stack is a list of at most {MAX_FRAMES} frames")
    out = []
    for item in items:
        if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str)
                or type(item[1]) is not int or not isinstance(item[2], str)):
            raise ValueError("a frame is [file, line, function]")
        out.append(Frame(item[0][:_MAX_TEXT], item[1], item[2][:_MAX_TEXT]))
    return tuple(out)


# Frames that say which phase a stack is in: (phase, file path ending, functions;
# None: any function of that file).  The innermost match wins (a closure's
# forward inside the optimizer step is forward; DDP's buffer broadcast inside
# forward is communication).
_MARKERS: tuple[tuple[str, str, frozenset[str] | None], ...] = (
    ("input", "torch/utils/data/dataloader.py", frozenset({"__next__"})),
    ("input", "traceml/agent/input_patches.py", frozenset({"__next__"})),
    ("forward", "torch/nn/modules/module.py", frozenset({"_call_impl", "_wrapped_call_impl"})),
    ("forward", "traceml/agent/model_patches.py", frozenset({"__call__"})),
    ("backward", "torch/_tensor.py", frozenset({"backward"})),
    ("backward", "torch/autograd/__init__.py", frozenset({"backward", "grad"})),
    ("backward", "torch/autograd/graph.py", frozenset({"_engine_run_backward"})),
    ("backward", "traceml/agent/model_patches.py", frozenset({"backward"})),
    ("optimizer", "torch/optim/optimizer.py", None),
    ("optimizer", "torch/amp/grad_scaler.py", frozenset({"step"})),
    ("communication", "torch/distributed/distributed_c10d.py", None),
    ("communication", "torch/distributed/c10d_logger.py", None),
    ("communication", "traceml/agent/comm.py", None),
)
assert {m[0] for m in _MARKERS} <= {p.name for p in phases.PHASES}


def norm_path(path: str) -> str:
    """A path with forward slashes."""
    return path.replace("\\", "/")


def phase_of(frames: Sequence[Frame]) -> str | None:
    """The innermost phase a stack is in; None: outside every phase."""
    found = None
    for frame in frames:
        path = norm_path(frame.file)
        for phase, ending, functions in _MARKERS:
            if path.endswith(ending) and (functions is None or frame.function in functions):
                found = phase
                break
        else:
            if "/torch/optim/" in path and frame.function == "step":  # an optimizer's own file
                found = "optimizer"
    return found


def user_frame(frames: Sequence[Frame]) -> Frame | None:
    """The innermost frame of the user's code."""
    return next((f for f in reversed(frames) if f.user), None)


def where(frames: Sequence[Frame]) -> str:
    """Where a stack stands, for one line: its innermost user frame, and the innermost
    frame when that is library code (``train.py:42 in forward (threading.py:331 in wait)``)."""
    if not frames:
        return "no Python frame"
    user, inner = user_frame(frames), frames[-1]
    if user is None:
        return inner.short()
    return user.short() if user is inner else f"{user.short()} ({inner.short()})"


# -- the files a rank's faulthandler writes (agent and launcher) --------------------------

STACKS_DIR = "stacks"
"""The session folder's subfolder for rank heartbeats and faulthandler output."""

STACK_SIGNAL = int(getattr(signal, "SIGRTMIN", signal.SIGUSR2)) + (
    7 if hasattr(signal, "SIGRTMIN") else 0)
"""The signal on which a rank's faulthandler writes every thread's stack: a
real-time signal nobody else uses (SIGUSR2 where there are none).  The launcher
sends it only to a rank whose heartbeat file says it is registered."""


@dataclass(frozen=True)
class StackFiles:
    """A rank's heartbeat (JSON, touched by its sender thread) and faulthandler files."""

    heartbeat: str
    dump: str  # what STACK_SIGNAL writes
    fatal: str  # what a fatal signal (SIGSEGV, SIGABRT, ...) writes

    @classmethod
    def of(cls, session_dir: str, rank: int, pid: int) -> StackFiles:
        base = os.path.join(session_dir, STACKS_DIR, f"r{rank}-{pid}")
        return cls(base + ".json", base + ".dump", base + ".fatal")
