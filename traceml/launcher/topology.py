"""Where the collector runs and how everyone reaches it (launcher side).

Static rendezvous: node 0 (``--node-rank 0``) runs the collector at
``--master-addr``.  c10d and other dynamic backends assign node ranks by join
order, so the collector runs on the rendezvous endpoint's host: of the
launchers there that find ``--aggregator-port`` free, the one that claims the
session folder runs it (`traceml.launcher.session_dir.session_dir_for`), the others
connect.
Other nodes connect to ``--aggregator-host`` (default: that host).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from traceml.config import DEFAULT_AGGREGATOR_PORT, RunConfig


@dataclass(frozen=True)
class Topology:
    collector_here: bool  # False: another launcher runs it (or may, for c10d)
    may_host: bool  # c10d on the endpoint host: try to run it, connect if taken
    connect_host: str
    bind_host: str
    port: int  # 0: any free port (one node)
    static: bool

    @property
    def join_port(self) -> int:
        """Where launchers of other nodes check that their options match node 0's."""
        return self.port + 1


def _endpoint_host(cfg: RunConfig) -> str:
    args = cfg.torch
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return args.master_addr
    endpoint = args.rdzv_endpoint or "127.0.0.1"
    return endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint


def rendezvous_address(cfg: RunConfig) -> str:
    args = cfg.torch
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return f"{args.master_addr}:{args.master_port or 29500}"
    return args.rdzv_endpoint


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (it can be bound here)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


def port_is_free(host: str, port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))
        return True
    except OSError:
        return False


def resolve(cfg: RunConfig) -> Topology:
    static = cfg.torch.rdzv_backend == "static" and not cfg.torch.standalone
    host = cfg.aggregator_host or _endpoint_host(cfg)
    if not cfg.multi_node:
        bind = cfg.aggregator_bind_host or "127.0.0.1"
        return Topology(True, False, "127.0.0.1" if bind == "0.0.0.0" else bind, bind,
                        cfg.aggregator_port or 0, static)
    bind = cfg.aggregator_bind_host or "0.0.0.0"
    port = cfg.aggregator_port or DEFAULT_AGGREGATOR_PORT
    if static:
        here = cfg.node_rank == 0
        return Topology(here, False, host, bind, port, True)
    # c10d: a launcher on the endpoint's host that finds the port free may run it.
    may_host = is_local_address(_endpoint_host(cfg)) and port_is_free(bind, port)
    return Topology(False, may_host, host, bind, port, False)
