"""End to end: a real Prometheus server (Debian's ``prometheus``, started here on a
loopback port with a configuration written here) scrapes ``traceml run
--metrics-port`` of a live 2-rank gloo DDP job every second; checked through
Prometheus's own HTTP query API: the step counter rises, each rank has its
series, the uneven shard's straggler finding names r1, the documented dashboard's
every query returns data, and the documented no-progress alert fires for the hung
rank within its threshold plus two scrape intervals."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import free_port, script
from tests.live.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = "/usr/bin/prometheus"
SCRAPE_S = 1.0  # scrape and rule evaluation interval
NO_PROGRESS_S = 5.0  # the documented rule's threshold, shortened for the test
SESSION = "prom"


def prometheus_config(metrics_port: int, rules: Path) -> str:
    return yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_S:g}s", "evaluation_interval": f"{SCRAPE_S:g}s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "traceml",
                            "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
    })


def shortened_rules(path: Path) -> dict[str, Any]:
    """docs/metrics/traceml-alerts.yml with the no-progress threshold at NO_PROGRESS_S
    and the straggler's hold time at 0 (the same expressions otherwise)."""
    doc = yaml.safe_load(path.read_text())
    for rule in doc["groups"][0]["rules"]:
        if rule["alert"] == "TracemlRankNoProgress":
            assert "> 600" in rule["expr"]
            rule["expr"] = rule["expr"].replace("> 600", f"> {NO_PROGRESS_S:g}")
        rule["for"] = "0s"
    return doc


class Prometheus:
    def __init__(self, tmp: Path, metrics_port: int) -> None:
        assert os.access(PROMETHEUS, os.X_OK), (
            "Debian's prometheus is missing: scripts/setup.sh --dev installs it "
            "(apt-get install prometheus)")
        rules = tmp / "rules.yml"
        rules.write_text(yaml.safe_dump(shortened_rules(ROOT / "docs/metrics/traceml-alerts.yml")))
        config = tmp / "prometheus.yml"
        config.write_text(prometheus_config(metrics_port, rules))
        checked = subprocess.run(["/usr/bin/promtool", "check", "config", str(config)],
                                 capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self._ready, 30, "Prometheus ready")

    def _ready(self) -> bool | None:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200 or None
        except OSError:
            assert self.proc.poll() is None, "Prometheus exited"
            return None

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as resp:
            doc = json.loads(resp.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result: [{"metric": labels, "value": [t, "v"]}]."""
        return list(self.api("query", query=expr)["result"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Job:
    """``traceml run --metrics-port`` of tests/e2e/scripts/metrics_job.py, in the background."""

    def __init__(self, tmp: Path, metrics_port: int) -> None:
        self.control = tmp / "control"
        self.control.mkdir()
        self.out = (tmp / "traceml.out").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "traceml", "run", "--logs-dir", str(tmp / "logs"),
             "--session-id", SESSION, "--metrics-port", str(metrics_port),
             "--peak-tflops", "0.5", "--nproc-per-node", "2",
             script("metrics_job.py"), "--control", str(self.control)],
            stdout=self.out, stderr=subprocess.STDOUT, cwd=tmp,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.log = tmp / "traceml.out"

    def output(self) -> str:
        self.out.flush()
        return self.log.read_text()[-4000:]

    def stop(self) -> None:
        (self.control / "release").touch()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.close()


@pytest.fixture()
def scraped_job(tmp_path: Path) -> Iterator[tuple[Prometheus, Job]]:
    port = free_port()
    prometheus = Prometheus(tmp_path, port)
    job = Job(tmp_path, port)
    try:
        yield prometheus, job
    finally:
        job.stop()
        prometheus.stop()
        shutil.rmtree(tmp_path / "tsdb", ignore_errors=True)


def by_rank(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"].get("rank", ""): float(r["value"][1]) for r in result}


def test_prometheus_scrapes_a_live_run_and_alerts_on_a_hung_rank(
        scraped_job: tuple[Prometheus, Job]) -> None:
    prom, job = scraped_job
    sel = f'{{session="{SESSION}"}}'

    def steps() -> dict[str, float] | None:
        assert job.proc.poll() is None, job.output()
        found = by_rank(prom.query(f"traceml_steps_completed_total{sel}"))
        return found if set(found) == {"0", "1"} else None

    first = wait_for(steps, 90, "both ranks' step counters in Prometheus", interval_s=0.5)
    wait_for(lambda: (s := steps()) is not None and s["1"] > first["1"] or None, 30,
             "the step counter to rise", interval_s=0.5)
    for metric in ("traceml_step_duration_seconds", "traceml_last_step_timestamp_seconds"):
        assert set(by_rank(prom.query(f"{metric}{sel}"))) == {"0", "1"}, metric
    forward = by_rank(prom.query(f'traceml_phase_duration_seconds{{session="{SESSION}",'
                                 'phase="forward"}'))
    assert set(forward) == {"0", "1"} and forward["1"] > forward["0"]  # twice the rows

    def straggler() -> list[dict[str, Any]] | None:
        assert job.proc.poll() is None, job.output()
        return prom.query(f'traceml_finding_info{{session="{SESSION}",'
                          'kind=~".*STRAGGLER"}') or None

    named = wait_for(straggler, 60, "a straggler finding", interval_s=0.5)
    assert {r["metric"]["rank"] for r in named} == {"1"}, named

    # Every query of the documented dashboard returns data for this session.
    dashboard = json.loads((ROOT / "docs/metrics/grafana-dashboard.json").read_text())
    empty = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$session", SESSION)
            if not prom.query(expr):
                empty.append(f"{panel['title']}: {expr}")
    assert not empty, empty

    # Rank 1 stops; the no-progress rule must fire for it within its threshold
    # plus two scrape intervals of its last step.
    (job.control / "hang").touch()
    hung = job.control / "hung"
    wait_for(lambda: hung.exists() and hung.read_text() or None, 30, "rank 1 to hang")
    hung_at = float(hung.read_text())

    def firing() -> float | None:
        for alert in prom.api("alerts")["alerts"]:
            labels = alert["labels"]
            if (labels.get("alertname") == "TracemlRankNoProgress" and alert["state"] == "firing"
                    and labels.get("rank") == "1"):
                return time.time()
        return None

    fired_at = wait_for(firing, NO_PROGRESS_S + 30, "the no-progress alert", interval_s=0.1)
    assert fired_at - hung_at <= NO_PROGRESS_S + 2 * SCRAPE_S + 0.5, fired_at - hung_at
    assert prom.query(f'traceml_run_state{{session="{SESSION}",state="running"}} == 1')

    # Released: the job ends, and its last scrape says so.
    (job.control / "release").touch()
    assert job.proc.wait(90) == 0, job.output()
    ended = prom.query(f'last_over_time(traceml_run_state{{session="{SESSION}",'
                       'state="succeeded"}[1m])')
    assert [float(r["value"][1]) for r in ended] == [1.0], job.output()


def test_a_metrics_port_out_of_range_or_in_use_stops_before_training(tmp_path: Path) -> None:
    from tests.conftest import run_traceml

    loop = script("loop.py")
    res = run_traceml(tmp_path, "run", "--metrics-port", "70000", loop, "--steps", "3")
    assert res.returncode == 2 and not res.steps
    assert res.stderr.strip().splitlines()[-1] == (
        "traceml run: argument --metrics-port/--metrics_port: not a TCP port: 70000 "
        "(see 'traceml run --help')")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_traceml(tmp_path, "run", "--metrics-port", str(port), loop, "--steps", "3",
                          session="taken")
    assert res.returncode == 2 and not res.steps
    last = res.stderr.strip().splitlines()[-1]
    assert last == (f"traceml: --metrics-port {port}: cannot listen on 127.0.0.1:{port} "
                    "(Address already in use); choose a free port"), res.stderr
    assert not (res.session_dir / "telemetry.sqlite").exists()
    assert res.evidence() == {}  # the script never ran
