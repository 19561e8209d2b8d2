"""``traceml run``: launch through torch's elastic machinery with the agent
injected, the collector alongside, and the end-of-run output (launcher side).
"""

from __future__ import annotations

import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import traceml
from traceml.collector.server import CollectorConfig
from traceml.collector.store import STORE_FILENAME
from traceml.config import DEFAULT_AGGREGATOR_PORT, RunConfig
from traceml.environment import AgentEnv
from traceml.errors import UsageError
from traceml.launcher.collector_process import CollectorProcess
from traceml.launcher.ending import finish
from traceml.launcher.system_sampler import SystemSampler

SITE_DIR = str(Path(__file__).resolve().parent.parent / "agent" / "site_dir")


def exit_status_of(exc: BaseException) -> int:
    """The training's exit status, as a shell would report it."""
    if isinstance(exc, SignalException):
        return 128 + int(exc.sigval)
    if isinstance(exc, ChildFailedError):
        _, failure = exc.get_first_failure()
        code = int(failure.exitcode)
        return 128 - code if code < 0 else code
    raise exc


def run_torch(torch_args: Any) -> int:
    """torchrun's own launch path; returns the training's exit status."""
    try:
        torchrun.run(torch_args)
    except (ChildFailedError, SignalException) as exc:
        if isinstance(exc, ChildFailedError):
            print(exc.format_msg(), file=sys.stderr)
        return exit_status_of(exc)
    return 0


def check_script(cfg: RunConfig) -> None:
    if cfg.module or cfg.no_python:
        return
    if not Path(cfg.training_script).is_file():
        raise UsageError(f"traceml {cfg.command}: training script not found: "
                         f"{cfg.training_script!r} (give a path to a .py file, or -m MODULE)")


def session_dir_for(cfg: RunConfig) -> Path:
    path = Path(cfg.logs_dir) / cfg.session_id
    if (path / STORE_FILENAME).exists():
        raise UsageError(f"traceml {cfg.command}: session folder {path} already holds a run; "
                         "pass another --session-id or remove that folder")
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_collector(cfg: RunConfig, session_dir: Path) -> CollectorProcess:
    bind = cfg.aggregator_bind_host or ("0.0.0.0" if cfg.multi_node else "127.0.0.1")
    if cfg.aggregator_port is not None:
        port = cfg.aggregator_port
    else:
        port = DEFAULT_AGGREGATOR_PORT if cfg.multi_node else 0
    return CollectorProcess(CollectorConfig(
        session_id=cfg.session_id, bind_host=bind, port=port,
        db_path=str(session_dir / STORE_FILENAME), parent_pid=os.getpid(),
    ))


def agent_env_for(cfg: RunConfig, port: int, session_dir: Path) -> AgentEnv:
    host = cfg.aggregator_host or "127.0.0.1"
    arm_dir = None
    if cfg.no_python:
        arm_dir = str(session_dir / ".armed")
        os.makedirs(arm_dir, exist_ok=True)
    return AgentEnv(
        session_id=cfg.session_id, endpoint=f"tcp://{host}:{port}", launcher_pid=os.getpid(),
        mode="run" if cfg.command == "run" else "watch", node_rank=cfg.node_rank,
        sample_interval_s=cfg.sample_interval_s, arm_dir=arm_dir,
        session_dir=str(session_dir.resolve()),
    )


def inject(agent_env: AgentEnv) -> None:
    """Put the agent contract into the environment torch hands to the workers."""
    os.environ.update(agent_env.to_env())
    current = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = SITE_DIR + (os.pathsep + current if current else "")


def run(cfg: RunConfig) -> int:
    """Run the training under traceml; returns the training's exit status."""
    check_script(cfg)
    if cfg.no_trace:
        return run_torch(cfg.torch_args)
    session_dir = session_dir_for(cfg)
    collector = start_collector(cfg, session_dir)
    started_at = time.time()
    collector.set_meta(
        session_id=cfg.session_id, command=["traceml", cfg.command, *cfg.argv],
        started_at=started_at, traceml_version=traceml.__version__,
        torch_version=_torch_version(), python_version=platform.python_version(),
        summary_window_rows=cfg.summary_window_rows, mode=cfg.command,
        expected_world_size=expected_world_size(cfg),
    )
    agent_env = agent_env_for(cfg, collector.port, session_dir)
    inject(agent_env)
    sampler = SystemSampler(agent_env.endpoint, cfg.session_id, cfg.node_rank,
                            cfg.sample_interval_s)
    sampler.start()
    exit_code = 128 + signal.SIGINT
    try:
        exit_code = run_torch(cfg.torch_args)
    except KeyboardInterrupt:
        pass
    finally:
        sampler.stop()
        collector_alive = collector.alive()
        collector.set_meta(ended_at=time.time(), exit_code=exit_code)
        collector.stop()
        finish(session_dir, collector_alive)
    return exit_code


def expected_world_size(cfg: RunConfig) -> int:
    """World size when every node of ``--nnodes`` (its minimum) joins."""
    try:
        nproc = torchrun.determine_local_world_size(cfg.torch_args.nproc_per_node)
    except (ValueError, RuntimeError):
        return 0
    return int(nproc) * cfg.min_nodes


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
