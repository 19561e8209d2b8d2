"""OpenTelemetry metrics push of a live run: OTLP over HTTP (collector process).

``traceml run --otlp-endpoint URL`` sends the same metric families as
``--metrics-port`` (`traceml.live.metrics`) every ``--otlp-interval`` seconds
from node 0's collector process, and once more when the run is over, to an
OTLP/HTTP receiver (an OpenTelemetry Collector, Grafana Alloy, a vendor's
endpoint): ``URL`` is the full metrics URL (``http://host:4318/v1/metrics``),
or a base URL, to which ``/v1/metrics`` is added.  The encoding, retries,
TLS and headers (``OTEL_EXPORTER_OTLP_HEADERS``: a vendor's token) are
OpenTelemetry's own exporter's, from the optional extra ``traceml-run[otel]``.

Names are the Prometheus names, counters without ``_total`` (a Prometheus
receiver adds it back), each with its unit; gauges go as gauges, counters as
cumulative monotonic sums from the run's start.  The resource says which job
it is: ``service.name`` traceml, ``traceml.session.id``, node 0's
``host.name``, and the scheduler's job when the launcher's environment names
it (``slurm.job.id``; ``k8s.pod.name`` and ``k8s.namespace.name`` from the
downward-API variables ``POD_NAME`` and ``POD_NAMESPACE``).

A receiver that cannot be reached never stops the run: one warning on stderr,
and the summary counts the exports that failed.  The endpoint is printed and
stored without what may be a credential (``user:password@``, the query).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from traceml.live.metrics import Family, LiveFamilies

DEFAULT_INTERVAL_S = 10.0
EXPORT_TIMEOUT_S = 3.0
"""One export's time, retries included, before it counts as failed (the collector's
end waits for the last one: the launcher stops the collector within 15 s)."""
METRICS_PATH = "/v1/metrics"
SCOPE = "traceml"

_UNITS = (("_seconds", "s"), ("_bytes", "By"), ("_ratio", "1"), ("_per_second", "1/s"),
          ("_cores", "{core}"))
"""Units by name suffix; any other metric has none ("": a Prometheus receiver would
name a gauge of unit "1" ``..._ratio``)."""


def metrics_url(url: str) -> str:
    """The OTLP/HTTP metrics URL of ``url``: a base URL gets ``/v1/metrics``."""
    parts = urllib.parse.urlsplit(url)
    if parts.path in ("", "/"):
        return urllib.parse.urlunsplit(parts._replace(path=METRICS_PATH))
    return url


def check_endpoint(url: str) -> str | None:
    """Why ``--otlp-endpoint URL`` cannot be used (None: it can)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return (f"--otlp-endpoint {url!r}: give an http:// or https:// URL, e.g. "
                "http://otel-collector:4318/v1/metrics")
    try:
        import opentelemetry.exporter.otlp.proto.http.metric_exporter  # noqa: F401
        import opentelemetry.sdk.metrics.export  # noqa: F401
    except ImportError:
        return ("--otlp-endpoint needs OpenTelemetry's OTLP exporter: "
                "pip install 'traceml-run[otel]'")
    return None


def resource_attributes(session_id: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What the pushed metrics are about: the job, where its collector runs, its scheduler."""
    attrs = {"service.name": "traceml", "traceml.session.id": session_id,
             "host.name": socket.gethostname()}
    for key, name in (("slurm.job.id", "SLURM_JOB_ID"), ("k8s.pod.name", "POD_NAME"),
                      ("k8s.namespace.name", "POD_NAMESPACE")):
        if environ.get(name):
            attrs[key] = environ[name]
    return attrs


def unit_of(name: str) -> str:
    base = name.removesuffix("_total")
    return next((unit for suffix, unit in _UNITS if base.endswith(suffix)), "")


def shown_url(url: str) -> str:
    """``url`` without what may be a credential (user:password@, the query)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def metrics_data(fams: list[Family], resource: Mapping[str, str], started_ns: int,
                 now_ns: int) -> Any:
    """The families as OpenTelemetry's MetricsData; ``session`` goes in the resource."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Metric,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from traceml.version import __version__

    metrics = []
    for fam in fams:
        points = [NumberDataPoint(attributes={k: v for k, v in labels if k != "session"},
                                  start_time_unix_nano=started_ns, time_unix_nano=now_ns,
                                  value=value)
                  for labels, value in fam.samples]
        data: Any
        if fam.kind == "counter":
            data = Sum(data_points=points, is_monotonic=True,
                       aggregation_temporality=AggregationTemporality.CUMULATIVE)
        else:
            data = Gauge(data_points=points)
        metrics.append(Metric(name=fam.name.removesuffix("_total"), description=fam.help,
                              unit=unit_of(fam.name), data=data))
    scope = ScopeMetrics(scope=InstrumentationScope(SCOPE, __version__), metrics=metrics,
                         schema_url="")
    return MetricsData(resource_metrics=[ResourceMetrics(
        resource=Resource.create(dict(resource)), scope_metrics=[scope], schema_url="")])


class OtlpExport:
    """Pushes the live families every ``interval_s`` from a daemon thread, and the
    last ones at the end; counts what was sent and what failed."""

    def __init__(self, source: LiveFamilies, endpoint: str, session_id: str,
                 interval_s: float = DEFAULT_INTERVAL_S,
                 environ: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.endpoint = metrics_url(endpoint)
        self.shown = shown_url(self.endpoint)  # what is printed and stored
        self.interval_s = interval_s
        self.resource = resource_attributes(session_id, os.environ if environ is None
                                            else environ)
        self.num_sent = 0
        self.num_failed = 0
        self.first_error: str | None = None
        self._started_ns = time.time_ns()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._exporter: Any = None

    def start(self) -> dict[str, Any]:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        # Its own log lines on every failed try would flood the run's stderr: one
        # warning of ours says it instead.
        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
        self._exporter = OTLPMetricExporter(endpoint=self.endpoint, timeout=EXPORT_TIMEOUT_S)
        self._thread = threading.Thread(target=self._run, name="traceml-otlp", daemon=True)
        self._thread.start()
        return {"endpoint": self.endpoint, "interval_s": self.interval_s}

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.export(self.source.current)

    def export(self, values: Callable[[], list[Family]]) -> bool:
        """One push of what ``values`` gives; False (counted, and said once) when it failed."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        try:
            fams = values()
            if not fams:
                return True
            data = metrics_data(fams, self.resource, self._started_ns, time.time_ns())
            ok = self._exporter.export(data, timeout_millis=EXPORT_TIMEOUT_S * 1e3) \
                == MetricExportResult.SUCCESS
            error = "" if ok else f"no answer or an error status from {self.shown}"
        except Exception as exc:  # the export is the exporter's to get right, never the run's
            ok, error = False, repr(exc)
        if ok:
            self.num_sent += 1
            return True
        self.num_failed += 1
        if self.first_error is None:
            self.first_error = error
            print(f"traceml collector: warning: OTLP export to {self.shown} failed ({error}); "
                  "the run goes on, and the summary counts the failed exports",
                  file=sys.stderr, flush=True)
        return False

    def finish(self) -> dict[str, Any]:
        """The run is over (the store committed): the last push, unless a periodic
        one is still under way (the collector's end is bounded); what was sent and failed."""
        self._done.set()
        busy = False
        if self._thread is not None:
            self._thread.join(1.0)
            busy = self._thread.is_alive()
        if self._exporter is not None and not busy:
            self.export(self.source.finish)
            self._exporter.shutdown()
        return {"endpoint": self.shown, "sent": self.num_sent, "failed": self.num_failed,
                "error": self.first_error}
