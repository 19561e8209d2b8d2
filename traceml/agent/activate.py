"""Decide whether this Python process is a training rank, and arm it (agent).

Called by the bootstrap ``sitecustomize`` in every Python process that
inherits traceml's PYTHONPATH entry.  Only training ranks of this session arm:
a process whose parent is the launcher (torch's elastic agent spawned it), or
with ``--no-python`` the first Python process of each rank.  DataLoader and
compile workers, forked children and unrelated subprocesses stay inert.

Arming is lazy: the patches go in when the script imports torch, so a script
that never imports torch pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from traceml import environment
from traceml.environment import AgentEnv, TorchRank


def is_training_rank(env: AgentEnv, rank: TorchRank) -> bool:
    """Whether this process, which torch gave ``rank``, is that rank's training
    process in this session (not a subprocess of it)."""
    if env.arm_dir is None:
        return os.getppid() == env.launcher_pid
    marker = os.path.join(env.arm_dir, f"rank{rank.rank}.restart{rank.restart_count}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        return False
    return True


def _start(env: AgentEnv, rank: TorchRank) -> None:
    try:
        from traceml.agent.runtime import AgentRuntime, identity_from

        AgentRuntime(env, identity_from(env, rank)).start()
    except Exception as exc:  # fail open
        print(f"traceml: warning: agent not started: {exc!r}", file=sys.stderr)


class _TorchImportWatcher(importlib.abc.MetaPathFinder):
    """Runs a callback right after ``import torch`` has finished executing."""

    def __init__(self, env: AgentEnv, rank: TorchRank) -> None:
        self.env = env
        self.rank = rank

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module
        env, rank = self.env, self.rank

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            _start(env, rank)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def main() -> None:
    """Entry point of the bootstrap sitecustomize."""
    try:
        env = environment.current()
        if env is None:
            return
        rank = TorchRank.from_env(os.environ)
        if rank is None or not is_training_rank(env, rank):
            return
        if env.mode == "watch" or "torch" in sys.modules:
            _start(env, rank)
        else:
            sys.meta_path.insert(0, _TorchImportWatcher(env, rank))
    except Exception as exc:  # fail open
        print(f"traceml: warning: agent not armed: {exc!r}", file=sys.stderr)
