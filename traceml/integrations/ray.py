"""Ray Train: trace every worker of a ``TorchTrainer`` with one line in the driver
(driver process; `TracedLoop` runs in the workers).

    from traceml.integrations.ray import fit
    result = fit(trainer, logs_dir="./logs", html=True)   # instead of trainer.fit()

`fit` starts traceml's collector beside the driver, runs ``trainer.fit()`` with
the trainer's training function wrapped in a `TracedLoop` (the function itself
is unchanged, and put back afterwards), and writes the final summary to
``logs_dir/<session id>/`` when the fit ends: returned, raised (a failed
worker, a failed run), or interrupted.  The trainer's result, or its error,
is passed through unchanged.

In every worker the `TracedLoop` arms the agent, as ``traceml run`` does in
each rank, before the training function runs, with the worker's ranks from
``ray.train.get_context()``, and shuts it down when the function returns or
raises (an exception is reported as the rank's crash, then re-raised).  If
traceml cannot start, the training runs untraced and traceml warns once.

Ray Train V2 (``ray.train.torch.TorchTrainer``, and every
``DataParallelTrainer`` with a ``train_loop_per_worker``), as Ray 2.60 runs it
by default; tested with Ray 2.60.0.  The workers must be able to import
traceml (installed on every node, as torch is) and reach the driver's host: on
a cluster of several nodes the collector listens on every address of the
driver's node, with CURVE keys from the session secret the driver's environment
gives, as to ``traceml run`` (`traceml.environment.user_secret`; else a new one
for the run).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from traceml.environment import AgentEnv, TorchRank
from traceml.errors import UsageError, WarnOnce

try:
    import ray
    import ray.train
except ImportError as exc:
    from traceml.integrations.requirement import missing_framework

    raise missing_framework("ray", "Ray Train", "ray") from exc

__all__ = ["Attempts", "TracedLoop", "fit"]

_warnings = WarnOnce()


class Attempts:
    """How many times each rank's training function has started in this fit: a
    worker group Ray restarts is the next attempt of every rank.  One actor of it
    runs for the fit (no CPU of its own), so workers on every node count alike."""

    def __init__(self) -> None:
        self.started: dict[int, int] = {}

    def next(self, rank: int) -> int:
        attempt = self.started.get(rank, 0)
        self.started[rank] = attempt + 1
        return attempt


class TracedLoop:
    """A trainer's training function, with the agent armed around it in each worker.
    Its signature is the function's (Ray reads it to decide whether to pass ``config``).
    ``attempts``: the fit's `Attempts` actor (None: every start is the first)."""

    def __init__(self, fn: Callable[..., Any], env: AgentEnv, attempts: Any = None) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.env = env
        self.attempts = attempts

    def __call__(self, *args: Any) -> Any:
        runtime = _attach(self.env, self.attempts)
        try:
            return self.fn(*args)
        except BaseException as exc:
            if runtime is not None:
                _guard("crash report", runtime.report_exception, exc)
            raise
        finally:
            if runtime is not None:
                _guard("shutdown", runtime.shutdown)


def _guard(part: str, call: Callable[..., Any], *args: Any) -> None:
    """Run one of the agent's calls in a worker; an error of traceml's warns once."""
    try:
        call(*args)
    except Exception as exc:  # the agent never breaks the training
        _warnings.to_stderr(part, f"traceml: {part} failed in this Ray worker: {exc!r}")


def _worker_rank(attempts: Any) -> TorchRank:
    """This worker's ranks, as Ray Train tells them, and its attempt (a worker group
    Ray restarted), as the fit's `Attempts` actor counts it."""
    context = ray.train.get_context()
    rank = context.get_world_rank()
    attempt = 0 if attempts is None else int(ray.get(attempts.next.remote(rank), timeout=30))
    return TorchRank(rank=rank, local_rank=context.get_local_rank(),
                     world_size=context.get_world_size(), group_rank=context.get_node_rank(),
                     restart_count=attempt)


def _attach(env: AgentEnv, attempts: Any) -> Any:
    """The agent, armed in this worker; None (warned once) when it cannot be."""
    try:
        from traceml.inprocess import attach_rank

        if env.session_dir is not None and not os.path.isdir(env.session_dir):
            env = AgentEnv(**{**env.__dict__, "session_dir": None})  # another node's disk
        return attach_rank(env, _worker_rank(attempts))
    except Exception as exc:  # the agent never breaks the training
        _warnings.to_stderr("attach", f"traceml: agent not started in this Ray worker: {exc!r}")
        return None


def _hosts(multi_node: bool | None) -> tuple[str, str]:
    """Where the collector listens and how workers reach it: loopback on one node,
    else every address of the driver's node and its address in the cluster.
    ``multi_node`` None: as many nodes as the cluster has now."""
    if not ray.is_initialized():
        ray.init()  # what the trainer would do first (RAY_ADDRESS, or a local cluster)
    if multi_node is None:
        nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        multi_node = sum(bool(node.get("Alive")) for node in nodes) > 1
    if not multi_node:
        return "127.0.0.1", "127.0.0.1"
    address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return "0.0.0.0", address


def _num_workers(trainer: Any) -> int:
    num = getattr(trainer.scaling_config, "num_workers", 1)
    return num if isinstance(num, int) else max(num)  # elastic: (min, max)


def _session(trainer: Any, logs_dir: str, session_id: str | None,
             sample_interval_s: float, multi_node: bool | None) -> tuple[Any, Any]:
    """The driver's collector session, started, and the fit's `Attempts` actor
    (UsageError on bad input)."""
    from traceml import environment
    from traceml.config import SESSION_ID_RE
    from traceml.inprocess import CollectorSession
    from traceml.launcher.args import new_session_id
    from traceml.store import STORE_FILENAME

    if not callable(getattr(trainer, "train_loop_per_worker", None)):
        raise UsageError(f"traceml.integrations.ray.fit: {type(trainer).__name__} has no "
                         "train_loop_per_worker; give it a Ray Train V2 trainer (TorchTrainer)")
    session_id = session_id or new_session_id()
    if not SESSION_ID_RE.match(session_id):
        raise UsageError(f"traceml.integrations.ray.fit: invalid session_id {session_id!r}: "
                         "use letters, digits, '_', '.' and '-' only")
    if (Path(logs_dir) / session_id / STORE_FILENAME).exists():
        raise UsageError(f"traceml.integrations.ray.fit: {Path(logs_dir) / session_id} already "
                         "holds a run; give another session_id")
    bind, connect = _hosts(multi_node)
    attempts = ray.remote(num_cpus=0)(Attempts).remote()
    session = CollectorSession(logs_dir, session_id, sample_interval_s, bind_host=bind,
                               connect_host=connect, secret=environment.user_secret(os.environ),
                               tokens=False)  # Ray starts the workers: no key service
    try:
        session.start([sys.executable, *sys.argv], _num_workers(trainer))
    except BaseException:
        session.collector.stop()
        raise
    return session, attempts


def fit(trainer: Any, logs_dir: str = "./logs", session_id: str | None = None,
        html: bool = False, sample_interval_s: float = 1.0,
        multi_node: bool | None = None) -> Any:
    """``trainer.fit()`` with every worker traced; the summary is written to
    ``logs_dir/<session id>/`` (and ``final_summary.html`` with ``html``) however the
    fit ends.  Returns the trainer's result; raises what the trainer raised.
    ``multi_node``: whether workers may run on other nodes than the driver's (the
    collector then listens on every address); None: whether the cluster has several
    nodes when the fit starts (give True for a cluster that grows later)."""
    try:
        session, attempts = _session(trainer, logs_dir, session_id, sample_interval_s,
                                     multi_node)
    except UsageError:
        raise
    except Exception as exc:  # traceml could not start: the training runs untraced
        warnings.warn(f"traceml.integrations.ray.fit: not traced: {exc}", RuntimeWarning,
                      stacklevel=2)
        return trainer.fit()
    loop = trainer.train_loop_per_worker
    trainer.train_loop_per_worker = TracedLoop(loop, session.env, attempts)
    exit_code = 1
    try:
        result = trainer.fit()
        exit_code = 0
        return result
    except KeyboardInterrupt:
        exit_code = 130
        raise
    finally:
        trainer.train_loop_per_worker = loop
        session.finish(exit_code, html=html)
        ray.kill(attempts)
