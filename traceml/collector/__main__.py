"""``python -m traceml.collector CONFIG_JSON`` (collector process).

The collector's composition root: the server, plus the live page's server when
the configuration asks for one (``--mode=dashboard``), the metrics endpoint
(``--metrics-port``), the OTLP push (``--otlp-endpoint``) and the profiler captures'
planner (``--capture``); or, with an ``upstream``,
a node's relay (`traceml.collector.relay`).  Composed here so that
``traceml.collector.server`` does not import the live views.
"""

from __future__ import annotations

import sys
from pathlib import Path

from traceml.collector.config import CollectorConfig
from traceml.collector.server import Captures, Exporter, LiveServer, serve
from traceml.security import forbid_inspection


def live_server(config: CollectorConfig) -> LiveServer | None:
    """The dashboard's server for ``--mode=dashboard``; only such runs pay for its import."""
    if config.dashboard_port is None:
        return None
    # The one place the collector process reaches into the live views (ruff TID251).
    from traceml.live.dashboard import Dashboard  # noqa: TID251

    return Dashboard(Path(config.db_path), config.session_id)


def metrics_exports(config: CollectorConfig) -> tuple[LiveServer | None, Exporter | None]:
    """Prometheus's ``/metrics`` for ``--metrics-port`` and the OTLP push for
    ``--otlp-endpoint``, from one source of values; only such runs import them."""
    if config.metrics_port is None and config.otlp_endpoint is None:
        return None, None
    from traceml.live.metrics import LiveFamilies, MetricsServer  # noqa: TID251

    source = LiveFamilies(Path(config.db_path))
    server = MetricsServer(source) if config.metrics_port is not None else None
    exporter = None
    if config.otlp_endpoint is not None:
        from traceml.live.otlp import OtlpExport  # noqa: TID251

        exporter = OtlpExport(source, config.otlp_endpoint, config.session_id,
                              config.otlp_interval_s)
    return server, exporter


def profiler_captures(config: CollectorConfig) -> Captures | None:
    """The captures' planner (``--capture auto``, and ``traceml capture``'s requests)."""
    if config.capture == "off" and config.capture_secret is None:
        return None
    from traceml.live.captures import CaptureTrigger  # noqa: TID251

    return CaptureTrigger(Path(config.db_path), config.capture == "auto", config.capture_steps,
                          config.capture_max_bytes)


def main(argv: list[str] | None = None) -> int:
    """The configuration arrives on stdin (it may hold the session secret)."""
    forbid_inspection()  # the ranks, run by the same user, must not read the secret
    args = sys.argv[1:] if argv is None else argv
    text = args[0] if args else sys.stdin.readline()
    config = CollectorConfig.from_json(text)
    if config.upstream is not None:  # a node's relay to node 0's collector
        from traceml.collector.relay import serve_relay

        return serve_relay(config)
    metrics, exporter = metrics_exports(config)
    return serve(config, live_server(config), metrics=metrics, exporter=exporter,
                 captures=profiler_captures(config))


if __name__ == "__main__":
    sys.exit(main())
