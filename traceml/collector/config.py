"""What the launcher tells a collector or relay process to do (launcher and collector side).

Its own module, so the launcher builds one without importing the collector's sockets
(zmq) or its dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from traceml.config import DEFAULT_CAPTURE_MAX_MB, DEFAULT_CAPTURE_STEPS
from traceml.wire import envelope

RELAY_INTERVAL_S = 1.0
"""How often a node's relay sends node 0 its batch, in a job of up to
`RELAY_BATCHES_PER_S` nodes (`relay_interval_s`)."""
RELAY_BATCHES_PER_S = 512
"""The relay batches node 0 takes a second at most: a wider job's relays send less often
(larger batches), so node 0's work per message does not grow with the nodes."""
MAX_RELAY_INTERVAL_S = 4.0
"""...but at least this often (the launcher calls a relay silent for 10 s lost)."""


def relay_interval_s(num_nodes: int) -> float:
    """A relay's batch interval in a job of ``num_nodes`` nodes."""
    return min(MAX_RELAY_INTERVAL_S, max(RELAY_INTERVAL_S, num_nodes / RELAY_BATCHES_PER_S))


@dataclass(frozen=True)
class CollectorConfig:
    session_id: str
    bind_host: str
    port: int  # 0: any free port
    db_path: str
    parent_pid: int
    max_message_bytes: int = envelope.MAX_MESSAGE_BYTES
    # --mode=dashboard: the live page's server runs in this process (see LiveServer).
    dashboard_port: int | None = None
    dashboard_host: str = "127.0.0.1"
    # --metrics-port: Prometheus's /metrics, served in this process (`traceml.live.metrics`).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # --otlp-endpoint: the same metrics pushed over OTLP/HTTP (`traceml.live.otlp`).
    otlp_endpoint: str | None = None
    otlp_interval_s: float = 10.0
    # CURVE keys: from ``secret`` (None: from the session id); the launcher's own key
    # from ``launcher_secret`` (None: nobody may send control messages).
    secret: str | None = None
    launcher_secret: str | None = None
    # ``traceml capture``'s key, from this secret (None: no one may ask for a capture);
    # --capture: automatic captures ("auto"), their steps and each trace's byte cap.
    capture_secret: str | None = None
    capture: str = "auto"
    capture_steps: int = DEFAULT_CAPTURE_STEPS
    capture_max_bytes: int = int(DEFAULT_CAPTURE_MAX_MB * 10**6)
    # Several nodes: the join check.
    join_port: int | None = None
    expected: dict[str, str] | None = None  # nnodes, nproc_per_node as node 0 has them
    # A node's relay (`traceml.collector.relay`): node 0's collector, where this
    # process forwards what its node's senders send (None: this is the collector).
    upstream: str | None = None
    node_rank: int = -1  # the relay's node (-1: c10d, not known when it starts)
    relay_interval_s: float = RELAY_INTERVAL_S  # the relay's batch interval (`relay_interval_s`)
    # traceml.init(): the parent is the training process itself, not a launcher.
    in_process: bool = False
    # Every sender proves the identity it claims with its token (`security.TokenBook`,
    # from ``secret``); a message without the right one is refused and counted.
    tokens: bool = False

    def to_json(self) -> str:
        return orjson.dumps(self.__dict__).decode()

    @classmethod
    def from_json(cls, text: str) -> CollectorConfig:
        return cls(**orjson.loads(text))
