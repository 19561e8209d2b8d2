"""``traceml.init()`` under plain ``python train.py``: the launcher's job done
from inside the single training process (launcher role, in the user process).

It starts the collector process and the system sampler, arms the agent in
this process, and at exit writes and prints the same final summary as
``traceml run``.  It never writes into ``os.environ``.  The exit status it
records is 1 when an exception escaped the script, else 0 (an explicit
``sys.exit(n)`` is not visible from an atexit hook).
"""

from __future__ import annotations

import atexit
import os
import sys
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


class InProcessSession:
    """Collector + sampler + agent for one plain-Python training process."""

    def __init__(self, logs_dir: str, session_id: str, sample_interval_s: float) -> None:
        self.session_dir = Path(logs_dir) / session_id
        self.session_dir.mkdir(parents=True, exist_ok=True)
        secret = new_secret()  # the collector and this process alone know it
        self.collector = CollectorProcess(CollectorConfig(
            session_id=session_id, bind_host="127.0.0.1", port=0,
            db_path=str(self.session_dir / STORE_FILENAME), parent_pid=os.getpid(),
            secret=secret, in_process=True, tokens=True))
        tokens = TokenBook(secret, session_id)
        self.env = AgentEnv(
            session_id=session_id, endpoint=f"tcp://127.0.0.1:{self.collector.port}",
            launcher_pid=os.getpid(), sample_interval_s=sample_interval_s,
            session_dir=str(self.session_dir.resolve()),
            client_keys=client_keys_text(self.collector.keys), rank_token=tokens.rank(0))
        self.sampler = SystemSampler(self.env.endpoint, session_id, 0, sample_interval_s,
                                     self.collector.keys, token_of=lambda _: tokens.node)
        self.failed = False
        self._previous_hook = sys.excepthook
        self.runtime: Any = None

    def start(self) -> None:
        from traceml.agent.runtime import AgentRuntime, identity_from

        self.collector.record(run_start(
            self.env.session_id, [sys.executable, *sys.argv], mode="run",
            summary_window_rows=DEFAULT_WINDOW_ROWS, expected_world_size=1, max_world_size=1))
        self.sampler.start()
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
        from traceml.launcher.ending import finish

        self.runtime.shutdown()
        self.sampler.stop()
        alive = self.collector.alive()
        end = end_run(self.collector, 1 if self.failed else 0)
        finish(self.session_dir, collector_alive=alive, end=end)
