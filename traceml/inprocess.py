"""Sessions whose ranks no launcher starts: the launcher's job done from inside
the user's process (launcher role, in the user process).

* `CollectorSession`: the collector process and the system sampler, and at the
  end the same final summary as ``traceml run``.  Ray Train's driver runs one
  (the Ray integration's ``fit``); its workers arm with `attach_rank`.
* `InProcessSession`: ``traceml.init()`` under plain ``python train.py``: a
  `CollectorSession` with the agent armed in this very process.

Nothing here writes into ``os.environ``.  The exit status ``traceml.init()``
records is 1 when an exception escaped the script, else 0 (an explicit
``sys.exit(n)`` is not visible from an atexit hook).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from traceml.collector.config import CollectorConfig
from traceml.config import DEFAULT_WINDOW_ROWS
from traceml.environment import AgentEnv, TorchRank
from traceml.launcher.collector_process import CollectorProcess, end_run, run_start
from traceml.launcher.system_sampler import SystemSampler
from traceml.security import TokenBook, client_keys_text, new_secret
from traceml.store import STORE_FILENAME


class CollectorSession:
    """Collector + system sampler for ranks this process does not launch.

    ``bind_host``/``connect_host``: where the collector listens and how the ranks
    reach it (127.0.0.1 when they run on this machine).  ``secret``: the session
    secret (None: a new one, known to this process and those it hands ``env`` to)."""

    def __init__(self, logs_dir: str, session_id: str, sample_interval_s: float,
                 bind_host: str = "127.0.0.1", connect_host: str = "127.0.0.1",
                 secret: str | None = None, in_process: bool = True,
                 tokens: bool = True) -> None:
        # ``tokens``: senders prove their identity (traceml.init(): this process is the one
        # rank, and makes its own token); another engine's ranks (Ray's workers) are not
        # this process's children, and get none: the collector then asks for none.
        self.session_dir = Path(logs_dir) / session_id
        self.session_dir.mkdir(parents=True, exist_ok=True)
        secret = secret or new_secret()
        self.collector = CollectorProcess(CollectorConfig(
            session_id=session_id, bind_host=bind_host, port=0,
            db_path=str(self.session_dir / STORE_FILENAME), parent_pid=os.getpid(),
            secret=secret, in_process=in_process, tokens=tokens))
        book = TokenBook(secret, session_id)
        self.env = AgentEnv(
            session_id=session_id, endpoint=f"tcp://{connect_host}:{self.collector.port}",
            launcher_pid=os.getpid(), sample_interval_s=sample_interval_s,
            session_dir=str(self.session_dir.resolve()),
            client_keys=client_keys_text(self.collector.keys),
            rank_token=book.rank(0) if tokens else None,
            control_endpoint=f"tcp://{connect_host}:{self.collector.ready['control_port']}")
        self.sampler = SystemSampler(self.env.endpoint, session_id, 0, sample_interval_s,
                                     self.collector.keys, token_of=lambda _: book.node)

    def start(self, command: Sequence[str], world_size: int) -> None:
        """Record the run's start (``world_size`` ranks expected) and start sampling."""
        self.collector.record(run_start(
            self.env.session_id, list(command), mode="run",
            summary_window_rows=DEFAULT_WINDOW_ROWS, expected_world_size=world_size,
            max_world_size=world_size))
        self.sampler.start()

    def finish(self, exit_code: int, html: bool = False) -> None:
        """Stop sampling and the collector; print and write the summary."""
        from traceml.launcher.ending import finish

        self.sampler.stop()
        alive = self.collector.alive()
        end = end_run(self.collector, exit_code)
        finish(self.session_dir, collector_alive=alive, html=html, end=end)


def attach_rank(env: AgentEnv, rank: TorchRank) -> Any:
    """Arm the agent in this process, a rank no launcher started (a Ray Train worker),
    whose training runs on the calling thread; returns the running agent, which the
    caller shuts down when the training ends."""
    from traceml.agent.runtime import AgentRuntime, identity_from

    runtime = AgentRuntime(env, identity_from(env, rank), thread_id=threading.get_ident())
    runtime.start()
    return runtime


class InProcessSession:
    """Collector + sampler + agent for one plain-Python training process."""

    def __init__(self, logs_dir: str, session_id: str, sample_interval_s: float) -> None:
        self.session = CollectorSession(logs_dir, session_id, sample_interval_s)
        self.env = self.session.env
        self.failed = False
        self._previous_hook = sys.excepthook
        self.runtime: Any = None

    def start(self) -> None:
        from traceml.agent.runtime import AgentRuntime, identity_from

        self.session.start([sys.executable, *sys.argv], world_size=1)
        rank = TorchRank(rank=0, local_rank=0, world_size=1)  # the one process is rank 0
        self.runtime = AgentRuntime(self.env, identity_from(self.env, rank))
        self.runtime.start()
        sys.excepthook = self._excepthook
        atexit.register(self.finish)  # after the runtime's: runs first at exit

    def _excepthook(self, kind: type[BaseException], value: BaseException,
                    tb: TracebackType | None) -> None:
        self.failed = True
        self._previous_hook(kind, value, tb)

    def finish(self) -> None:
        self.runtime.shutdown()
        self.session.finish(1 if self.failed else 0)
