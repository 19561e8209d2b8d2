"""End to end: ``traceml run --otlp-endpoint`` pushes the run's metrics over OTLP/HTTP to a
receiver that decodes the real OTLP protobuf (``opentelemetry-proto``'s
ExportMetricsServiceRequest), as an OpenTelemetry Collector would; and an unreachable
receiver leaves the run alone, with one warning and the failed pushes counted."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from tests.conftest import free_port, run_traceml, script
from traceml.live.otlp import (
    check_endpoint,
    metrics_url,
    resource_attributes,
    shown_url,
    unit_of,
)


class Receiver(ThreadingHTTPServer):
    """OTLP/HTTP metrics receiver: POST /v1/metrics, protobuf body."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[ExportMetricsServiceRequest] = []
        self.paths: list[str] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # the name http.server calls
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        assert self.headers["Content-Type"] == "application/x-protobuf"
        self.server.requests.append(request)
        self.server.paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # the base signature
        """Quiet."""


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.shutdown()
    server.server_close()


def points(request: ExportMetricsServiceRequest) -> dict[str, list[tuple[dict[str, str], Any]]]:
    """Metric name -> [(attributes, data point)] of one push."""
    out: dict[str, list[tuple[dict[str, str], Any]]] = {}
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                data = getattr(metric, metric.WhichOneof("data"))
                for p in data.data_points:
                    attrs = {a.key: a.value.string_value for a in p.attributes}
                    out.setdefault(metric.name, []).append((attrs, p))
    return out


def test_a_run_pushes_its_metrics_and_job_over_otlp(tmp_path: Path, receiver: Receiver) -> None:
    res = run_traceml(tmp_path, "run", "--otlp-endpoint", receiver.url, "--otlp-interval", "1",
                      script("loop.py"), "--steps", "300", "--input-sleep-ms", "10",
                      session="otlp", env={"POD_NAME": "trainer-0", "POD_NAMESPACE": "ml"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(receiver.requests) >= 2 and set(receiver.paths) == {"/v1/metrics"}
    resource = {a.key: a.value.string_value
                for a in receiver.requests[-1].resource_metrics[0].resource.attributes}
    assert resource["service.name"] == "traceml" and resource["traceml.session.id"] == "otlp"
    assert resource["k8s.pod.name"] == "trainer-0" and resource["k8s.namespace.name"] == "ml"
    assert resource["host.name"]
    last = points(receiver.requests[-1])  # the push at the end
    (attrs, steps), = last["traceml_steps_completed"]
    assert attrs == {"rank": "0"} and steps.as_double == 300.0
    metric = next(m for m in receiver.requests[-1].resource_metrics[0].scope_metrics[0].metrics
                  if m.name == "traceml_steps_completed")
    assert metric.sum.is_monotonic and metric.sum.aggregation_temporality == 2  # cumulative
    assert steps.start_time_unix_nano < steps.time_unix_nano
    duration = next(m for m in receiver.requests[-1].resource_metrics[0].scope_metrics[0].metrics
                    if m.name == "traceml_step_duration_seconds")
    assert duration.unit == "s" and duration.gauge.data_points[0].as_double > 0.01
    states = {a["state"]: p.as_double for a, p in last["traceml_run_state"]}
    assert states == {"running": 0.0, "succeeded": 1.0, "failed": 0.0}
    assert "session" not in attrs  # in the resource, not on every point
    # The first push carried a running job's steps already.
    first = points(receiver.requests[0])
    assert {a["state"]: p.as_double for a, p in first["traceml_run_state"]}["running"] == 1.0
    otlp = res.summary["meta"]["exports"]["otlp"] if res.summary else None
    assert otlp == {"endpoint": f"{receiver.url}/v1/metrics", "sent": len(receiver.requests),
                    "failed": 0, "error": None}
    assert "OTLP export" not in res.stderr


def test_an_unreachable_receiver_leaves_the_run_alone_and_is_counted(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/metrics"  # nobody listens
    res = run_traceml(tmp_path, "run", "--otlp-endpoint", url, "--otlp-interval", "1",
                      script("loop.py"), "--steps", "100", "--input-sleep-ms", "10",
                      session="lost")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [s["step"] for s in res.steps] == list(range(100))
    warnings = [line for line in res.stderr.splitlines() if "OTLP export to" in line]
    assert len(warnings) == 1 and "the run goes on" in warnings[0]
    assert res.summary is not None
    otlp = res.summary["meta"]["exports"]["otlp"]
    assert otlp["sent"] == 0 and otlp["failed"] >= 1 and otlp["endpoint"] == url
    card = (res.session_dir / "final_summary.txt").read_text()
    assert f"OTLP export: {otlp['failed']} of {otlp['failed']} pushes to {url} failed" in card


def test_bad_endpoints_are_refused_with_one_line() -> None:
    assert check_endpoint("http://otel:4318") is None
    assert "give an http:// or https:// URL" in (check_endpoint("otel:4318") or "")
    assert metrics_url("http://otel:4318") == "http://otel:4318/v1/metrics"
    assert metrics_url("https://otel:4318/") == "https://otel:4318/v1/metrics"
    assert metrics_url("http://x/api/v1/otlp/v1/metrics") == "http://x/api/v1/otlp/v1/metrics"
    env = {"SLURM_JOB_ID": "4242", "POD_NAME": ""}
    attrs = resource_attributes("s", env)
    assert attrs["slurm.job.id"] == "4242" and "k8s.pod.name" not in attrs
    assert [unit_of(n) for n in ("traceml_step_duration_seconds", "traceml_mfu_ratio",
                                 "traceml_process_resident_memory_bytes",
                                 "traceml_steps_completed_total")] == ["s", "1", "By", ""]
    assert shown_url("https://user:tok@otel:4318/v1/metrics?key=x") == \
        "https://otel:4318/v1/metrics"


def test_an_endpoint_that_is_not_a_url_stops_before_training(tmp_path: Path) -> None:
    res = run_traceml(tmp_path, "run", "--otlp-endpoint", "otel:4318", script("loop.py"),
                      "--steps", "3")
    assert res.returncode == 2 and not res.steps
    assert res.stderr.strip().splitlines()[-1] == (
        "traceml run: --otlp-endpoint 'otel:4318': give an http:// or https:// URL, e.g. "
        "http://otel-collector:4318/v1/metrics")
