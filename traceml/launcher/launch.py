"""``traceml run``: launch through torch's elastic machinery with the agent
injected, the collector alongside, and the end-of-run output (launcher side).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError

from traceml import environment, security
from traceml.collector.config import CollectorConfig, relay_interval_s
from traceml.config import RunConfig
from traceml.environment import AgentEnv
from traceml.errors import UsageError
from traceml.launcher import rank_keys, topology
from traceml.launcher.args import torch_namespace
from traceml.launcher.collector_process import (
    CollectorFailed,
    CollectorProcess,
    StoreUnwritable,
    end_run,
    run_start,
)
from traceml.launcher.ending import finish
from traceml.launcher.health import RankFailure, StackWatch, StallAlert
from traceml.launcher.nodes import JoinCheck, SilenceWatch, Waiting, wait_for_nodes
from traceml.launcher.process_watcher import ProcessWatcher
from traceml.launcher.rank_keys import RankKeyService
from traceml.launcher.session_dir import session_dir_for
from traceml.launcher.system_sampler import SystemSampler
from traceml.launcher.topology import Topology
from traceml.live.views import start_live_view
from traceml.security import TokenBook, client_keys_text, new_secret, session_keys
from traceml.store import STORE_FILENAME
from traceml.wire.identity import MAX_WORLD_SIZE

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


def run_torch(torch_args: Any, failures: list[RankFailure] | None = None) -> int:
    """torchrun's own launch path; returns the training's exit status (and adds the
    ranks torch saw die to ``failures``)."""
    try:
        torchrun.run(torch_args)  # type: ignore[no-untyped-call]
    except (ChildFailedError, SignalException) as exc:
        if isinstance(exc, ChildFailedError):
            print(exc.format_msg(), file=sys.stderr)  # type: ignore[no-untyped-call]
            if failures is not None:
                failures += failures_of(exc)
        return exit_status_of(exc)
    except RendezvousError as exc:
        # torchrun would print a traceback; the reason fits on one line.
        reason = str(exc) or "no other node joined in time"
        print(f"traceml: torch's rendezvous failed ({type(exc).__name__}): {reason}; "
              "check that every node runs the same command and can reach the endpoint",
              file=sys.stderr)
        return 1
    return 0


def failures_of(exc: ChildFailedError) -> list[RankFailure]:
    """The ranks a ChildFailedError lists, as this node's launcher saw them die."""
    out = []
    for rank, failure in exc.failures.items():
        try:
            out.append(RankFailure(int(rank), int(failure.pid), int(failure.exitcode),
                                   float(failure.timestamp)))
        except (TypeError, ValueError):  # torch named no process: nothing to look up
            continue
    return out


def check_script(cfg: RunConfig) -> None:
    if cfg.module or cfg.no_python:
        return
    if not Path(cfg.training_script).is_file():
        raise UsageError(f"traceml {cfg.command}: training script not found: "
                         f"{cfg.training_script!r} (give a path to a .py file, or -m MODULE)")


def start_collector(cfg: RunConfig, topo: Topology, session_dir: Path,
                    secret: str | None) -> CollectorProcess | None:
    """The collector, if it runs here (None: on c10d, it could not start here, and
    this node sends to the collector that holds the port, a peer's on this host)."""
    try:
        return CollectorProcess(CollectorConfig(
            session_id=cfg.session_id, bind_host=topo.bind_host, port=topo.port,
            db_path=str(session_dir / STORE_FILENAME), parent_pid=os.getpid(),
            dashboard_port=cfg.dashboard_port if cfg.mode == "dashboard" else None,  # live views
            metrics_port=cfg.metrics_port, metrics_host=cfg.metrics_bind_host,
            otlp_endpoint=cfg.otlp_endpoint, otlp_interval_s=cfg.otlp_interval_s,
            capture=cfg.capture if cfg.command == "run" else "off",
            capture_steps=cfg.capture_steps, capture_max_bytes=cfg.capture_max_bytes,
            capture_secret=new_secret() if cfg.command == "run" else None,
            secret=secret, join_port=topo.join_port if cfg.multi_node else None,
            tokens=rank_keys.available(),
            expected={"nnodes": cfg.torch.nnodes, "nproc_per_node": cfg.torch.nproc_per_node},
        ))
    except UsageError as exc:
        store = session_dir / STORE_FILENAME
        if store.stat().st_size == 0:
            store.unlink()  # claimed, never written: the folder stays free for a retry
        if topo.may_host and isinstance(exc, CollectorFailed):
            print(f"traceml: no collector here ({exc.reason}): this node sends to the one at "
                  f"{topo.connect_host}:{topo.port}", file=sys.stderr)
            return None
        raise


def announce_metrics(cfg: RunConfig, collector: CollectorProcess | None) -> None:
    """Where ``--metrics-port`` serves, or that node 0 serves it."""
    if cfg.metrics_port is None:
        return
    info = collector.ready.get("metrics") if collector is not None else None
    if info is None:
        print("traceml: --metrics-port: node 0's collector serves the metrics of every node",
              file=sys.stderr)
    else:
        print(f"traceml: Prometheus metrics at {info['url']} (docs/metrics.md)",
              file=sys.stderr)


def agent_env_for(cfg: RunConfig, endpoint: str, session_dir: Path, topo: Topology,
                  secret: str, key_service: RankKeyService | None = None,
                  control_endpoint: str | None = None) -> AgentEnv:
    """What the workers get: the session's client keys (not its secret) and the key
    service that gives each its rank's token."""
    arm_dir = None
    if cfg.no_python:
        arm_dir = str(session_dir / ".armed")
        os.makedirs(arm_dir, exist_ok=True)
    return AgentEnv(
        session_id=cfg.session_id, endpoint=endpoint, launcher_pid=os.getpid(),
        mode="run" if cfg.command == "run" else "watch", node_rank=cfg.node_rank,
        sample_interval_s=cfg.sample_interval_s, arm_dir=arm_dir,
        session_dir=str(session_dir.resolve()),
        client_keys=client_keys_text(session_keys(secret, cfg.session_id)),
        key_socket=key_service.path if key_service is not None else None,
        stall_timeout_s=cfg.stall_timeout_s,
        count_flops=cfg.count_flops,
        control_endpoint=control_endpoint,
    )


def control_endpoint_of(collector: CollectorProcess | None, topo: Topology) -> str | None:
    """Where this node's ranks read node 0's capture asks: its collector's control channel
    (a relay forwards none: the ranks of other nodes are not asked)."""
    if collector is None or "control_port" not in collector.ready:
        return None
    return f"tcp://{topo.connect_host}:{collector.ready['control_port']}"


def inject(agent_env: AgentEnv) -> None:
    """Put the agent contract into the environment torch hands to the workers."""
    os.environ.update(agent_env.to_env())
    current = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = SITE_DIR + (os.pathsep + current if current else "")


def record_start(collector: CollectorProcess, cfg: RunConfig) -> None:
    collector.record(run_start(
        cfg.session_id, ["traceml", cfg.command, *cfg.argv], mode=cfg.command,
        summary_window_rows=cfg.summary_window_rows,
        expected_world_size=expected_world_size(cfg), expected_nodes=cfg.min_nodes,
        count_flops=cfg.count_flops, peak_tflops=cfg.peak_tflops,
        max_world_size=expected_world_size(cfg, cfg.max_nodes)))


def session_secret(cfg: RunConfig) -> str:
    """The secret every sender's key derives from: the user's (environment); on one node a
    new one for this run.  Several nodes must share one, and no key is ever derived from
    the session id alone (anyone who reads the command line knows it): UsageError."""
    secret = environment.user_secret(os.environ)
    if secret is not None:
        return secret
    if not cfg.multi_node:
        return new_secret()
    raise UsageError(
        f"traceml {cfg.command}: several nodes need a session secret: "
        f"{environment.SECRET_HINT} (e.g. {environment.SECRET_EXAMPLE} where the job is "
        "submitted)")


def run(cfg: RunConfig) -> int:
    """Run the training under traceml; returns the training's exit status."""
    check_script(cfg)
    if cfg.filled_options:
        print(f"traceml: inside a SLURM step: {' '.join(cfg.filled_options)} (options given "
              "on the command line win)", file=sys.stderr)
    elif cfg.scheduler_hint:
        print(cfg.scheduler_hint, file=sys.stderr)
    if cfg.no_trace:
        return run_torch(torch_namespace(cfg, redirect_output=False))
    topo = topology.resolve(cfg)
    secret = session_secret(cfg)
    environment.hide_user_secret(os.environ)  # the workers inherit it: a rank gets a token
    security.forbid_inspection()  # its /proc/<pid>/environ still holds it: not to the ranks
    try:
        session_dir, hosting = session_dir_for(cfg, topo)
        collector = start_collector(cfg, topo, session_dir, secret) if hosting else None
    except StoreUnwritable as exc:  # a full disk: the training still runs, untraced
        print(f"{exc}; the training runs without traceml", file=sys.stderr)
        return run_torch(torch_namespace(cfg, redirect_output=False))
    if collector is not None:
        record_start(collector, cfg)
    announce_metrics(cfg, collector)
    port = collector.port if collector is not None else topo.port
    endpoint = f"tcp://{topo.connect_host}:{port}"
    relay = start_relay(cfg, topo, endpoint, secret) if collector is None else None
    if relay is not None:  # this node's senders send to its relay, which forwards to node 0
        endpoint = f"tcp://127.0.0.1:{relay.port}"
    key_service = (RankKeyService(TokenBook(secret, cfg.session_id))
                   if cfg.command == "run" and rank_keys.available() else None)
    try:
        agent_env = agent_env_for(cfg, endpoint, session_dir, topo, secret, key_service,
                                  control_endpoint_of(collector, topo))
        if cfg.command == "run":
            inject(agent_env)  # watch injects nothing: the launcher samples from outside
        exit_code = _supervise(cfg, topo, agent_env, collector, session_dir, secret, relay)
    finally:
        if key_service is not None:
            key_service.stop()
    hint = late_options_hint(cfg, exit_code)
    if hint:
        print(hint, file=sys.stderr)
    return exit_code


USAGE_EXIT = 2  # argparse's exit status for arguments it does not know


def late_options_hint(cfg: RunConfig, exit_code: int) -> str | None:
    """What to say when the script exited as argparse does on unknown arguments and
    some of its arguments are traceml's or torchrun's own options."""
    if exit_code != USAGE_EXIT or not cfg.late_options:
        return None
    names = " ".join(cfg.late_options)
    script = Path(cfg.training_script).name
    one = len(cfg.late_options) == 1
    return (f"traceml {cfg.command}: {script} exited 2 (argparse's status for arguments it "
            f"does not take) and got {names}, {'an option' if one else 'options'} of "
            f"traceml {cfg.command} too; if {'it was' if one else 'they were'} meant for "
            f"traceml or torchrun, put {'it' if one else 'them'} before the script: "
            f"traceml {cfg.command} [options] {script} [script arguments]")


def start_relay(cfg: RunConfig, topo: Topology, upstream: str,
                secret: str | None) -> CollectorProcess | None:
    """This node's relay to node 0's collector (`traceml.collector.relay`); None when
    it cannot start (the node's senders then send to node 0 themselves)."""
    try:
        return CollectorProcess(CollectorConfig(
            session_id=cfg.session_id, bind_host="127.0.0.1", port=0, db_path="",
            parent_pid=os.getpid(), secret=secret, upstream=upstream,
            tokens=rank_keys.available(), relay_interval_s=relay_interval_s(cfg.max_nodes),
            node_rank=cfg.node_rank if topo.static else -1))
    except UsageError as exc:
        print(f"{exc}; this node's telemetry goes to node 0 directly", file=sys.stderr)
        return None


def _supervise(cfg: RunConfig, topo: Topology, agent_env: AgentEnv,
               collector: CollectorProcess | None, session_dir: Path, secret: str,
               relay: CollectorProcess | None = None) -> int:
    """Run torch's launch with the node's helpers around it; end with the summary."""
    keys = session_keys(secret, cfg.session_id)
    tokens = TokenBook(secret, cfg.session_id)
    stack_watch = StackWatch(session_dir)
    sampler = SystemSampler(agent_env.endpoint, cfg.session_id,
                            cfg.node_rank if topo.static else None, cfg.sample_interval_s, keys,
                            extra=[stack_watch.produce] if cfg.command == "run" else [],
                            token_of=lambda who: tokens.of(who.role, who.rank, who.restart))
    sampler.start()
    helpers = node_helpers(cfg, topo, collector or relay, session_dir, keys)
    helpers += _watchers(cfg, topo, agent_env, collector is not None, session_dir, keys, tokens)
    # The live view runs where the collector does; only there does the
    # workers' output leave the terminal (--mode=cli).
    torch_args = torch_namespace(cfg, redirect_output=collector is not None)
    view = start_live_view(cfg, session_dir, collector.ready if collector else {})  # live views
    exit_code = 128 + signal.SIGINT
    failures: list[RankFailure] = []
    try:
        exit_code = run_torch(torch_args, failures)
    except KeyboardInterrupt:
        pass
    finally:
        while True:  # a second Ctrl-C may land before the handler is in place
            try:
                hold_signals()
                break
            except KeyboardInterrupt:
                continue
        stack_watch.failed(failures)  # sent with the sampler's last messages
        for helper in helpers:
            helper.stop()
        sampler.stop()
        if relay is not None and relay.stop() != 0:  # after the sampler's last messages
            print("traceml: this node's relay to node 0 died; node 0 reports this node's "
                  "ranks as lost", file=sys.stderr)
        view.stop()  # live views: the final summary prints after the view closes
        if collector is not None:
            end_session(cfg, collector, session_dir, exit_code)
        else:
            print(f"traceml: this node's telemetry went to {agent_env.endpoint}; "
                  "node 0 writes the summary", file=sys.stderr)
        # Done: a late Ctrl-C is ignored while Python exits (its shutdown puts the
        # default handlers back, and one would replace the exit status with SIGINT's).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    return exit_code


def _watchers(cfg: RunConfig, topo: Topology, agent_env: AgentEnv, node_0: bool,
              session_dir: Path, keys: Any, tokens: TokenBook) -> list[Any]:
    """Started: node 0's stall alert (the cli view shows stalls in its place) and, for
    ``traceml watch``, the process watcher that samples the ranks from outside."""
    started: list[Any] = []
    if node_0 and cfg.command == "run" and cfg.worker_log_dir is None:
        started.append(StallAlert(session_dir / STORE_FILENAME))
    if cfg.command == "watch":
        started.append(ProcessWatcher(agent_env.endpoint, cfg.session_id,
                                      cfg.node_rank if topo.static else None,
                                      cfg.sample_interval_s, keys,
                                      token_of=lambda who: tokens.of(who.role, who.rank, who.restart)))
    for watcher in started:
        watcher.start()
    return started


def hold_signals() -> None:
    """From here on the summary is written: a second Ctrl-C, or the job's SIGTERM
    (``timeout``, ``scancel``), says so once instead of aborting it (the
    collector and the stop are bounded in time)."""
    said: list[int] = []

    def still_writing(signum: int, frame: Any) -> None:
        if not said:
            said.append(signum)
            print("traceml: writing the summary; it takes a few seconds", file=sys.stderr,
                  flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, still_writing)


def node_helpers(cfg: RunConfig, topo: Topology, collector: CollectorProcess | None,
                 session_dir: Path, keys: Any) -> list[Any]:
    """Threads that watch the rendezvous and check this node against node 0;
    ``collector`` is node 0's collector or this node's relay."""
    if not cfg.multi_node:
        return []
    here = collector is not None and collector.config.upstream is None
    db_path = session_dir / STORE_FILENAME if here else None
    skip = {collector.proc.pid} if collector is not None else set()
    rendezvous = topology.rendezvous_address(cfg)
    helpers: list[Any] = [Waiting(cfg, rendezvous, db_path, skip)]
    if not here:
        helpers.append(JoinCheck(cfg, topo.connect_host, topo.join_port, keys))
    else:
        helpers.append(SilenceWatch(session_dir, max(15.0, 10 * cfg.sample_interval_s)))
    for helper in helpers:
        helper.start()
    return helpers


def end_session(cfg: RunConfig, collector: CollectorProcess, session_dir: Path,
                exit_code: int) -> None:
    if cfg.multi_node:
        missing = wait_for_nodes(session_dir / STORE_FILENAME, cfg.min_nodes)
        if missing:
            print(f"traceml: no goodbye from {', '.join(missing)}; writing the summary "
                  "without waiting longer", file=sys.stderr)
    collector_alive = collector.alive()
    end = end_run(collector, exit_code)
    finish(session_dir, collector_alive, html=cfg.html, end=end)


def expected_world_size(cfg: RunConfig, nodes: int | None = None) -> int:
    """World size when ``nodes`` (default: ``--nnodes``' minimum) join; 0: unknown."""
    try:
        nproc = torchrun.determine_local_world_size(cfg.torch.nproc_per_node)
    except (ValueError, RuntimeError):
        return 0
    return min(int(nproc) * (cfg.min_nodes if nodes is None else nodes), MAX_WORLD_SIZE)
