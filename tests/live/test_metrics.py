"""Prometheus metrics of a live run (`traceml.live.metrics`): the families built from
hand-built 1-, 2-, 8- and 300-rank runs, the text a scraper parses, and the
endpoint's server on a real socket (a real Prometheus scrapes it in
tests/e2e/test_prometheus.py)."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.live.conftest import T0, comm_run, fixed_run, wait_for, wide_run
from tests.live.test_dashboard import make_store
from traceml.live.metrics import (
    ALL_RANKS,
    FINAL_LINGER_S,
    LiveFamilies,
    MetricsServer,
    families,
    live_values,
    to_text,
)
from traceml.records import Incident, RunData


def scrape(run: RunData, all_ranks: int = ALL_RANKS) -> dict[str, list[Any]]:
    """The exposition text of ``run``'s live snapshot, parsed as Prometheus would:
    sample name -> [(labels, value)]."""
    text = to_text(families(live_values(run, 100), run, all_ranks=all_ranks))
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def by_rank(samples: list[Any], **match: str) -> dict[int, float]:
    return {int(labels["rank"]): value for labels, value in samples
            if all(labels.get(k) == v for k, v in match.items())}


def one_rank_run() -> RunData:
    run = fixed_run(30)
    meta = dataclasses.replace(run.meta, world_size=1)
    return dataclasses.replace(run, meta=meta, steps=tuple(s for s in run.steps if s.rank == 0),
                               process=tuple(p for p in run.process if p.rank == 0))


def test_one_rank_has_its_steps_and_phases_and_no_untimed_communication() -> None:
    m = scrape(one_rank_run())
    assert by_rank(m["traceml_steps_completed_total"]) == {0: 30.0}
    assert by_rank(m["traceml_step_duration_seconds"]) == {0: pytest.approx(0.101)}
    phases = {labels["phase"]: v for labels, v in m["traceml_phase_duration_seconds"]}
    assert phases["forward"] == pytest.approx(0.030) and phases["backward"] == pytest.approx(0.056)
    # One rank times no collective: communication is absent, never 0.
    assert "communication" not in phases and "hook" not in phases
    assert "traceml_communication_in_flight_seconds" not in m
    # Throughput not measured (no batch sizes, no FLOPs): absent, never 0.
    assert not {"traceml_samples_per_second", "traceml_mfu_ratio",
                "traceml_job_samples_per_second"} & set(m)
    assert {labels["session"] for labels, _ in m["traceml_run_info"]} == {"live-demo"}
    state = {labels["state"]: v for labels, v in m["traceml_run_state"]}
    assert state == {"running": 1.0, "succeeded": 0.0, "failed": 0.0}
    last = by_rank(m["traceml_last_step_timestamp_seconds"])
    assert last[0] == pytest.approx(T0 + 1 + 29 * 0.1)  # the newest step's end


def test_two_ranks_name_the_straggler_with_its_phase_and_excess() -> None:
    m = scrape(fixed_run(30))
    findings = [labels for labels, _ in m["traceml_finding_info"]]
    straggler = [f for f in findings if f["kind"] == "INPUT_STRAGGLER"]
    assert straggler and straggler[0]["rank"] == "1" and straggler[0]["phase"] == "input"
    assert straggler[0]["severity"] in ("warn", "crit") and straggler[0]["section"] == "step_time"
    excess = by_rank(m["traceml_straggler_excess_seconds"], kind="INPUT_STRAGGLER")
    assert excess == {1: pytest.approx(0.036, abs=0.002)}
    inputs = by_rank(m["traceml_phase_duration_seconds"], phase="input")
    assert inputs[1] > inputs[0] + 0.03
    assert by_rank(m["traceml_device_memory_capacity_bytes"]) == {0: 80 * 2**30, 1: 80 * 2**30}
    gpus = m["traceml_gpu_utilization_ratio"]
    assert [(labels["node"], labels["gpu"], v) for labels, v in gpus] == [("0", "0", 0.9)]


def test_timed_collectives_give_exposed_and_in_flight_communication() -> None:
    m = scrape(comm_run(30))
    exposed = by_rank(m["traceml_phase_duration_seconds"], phase="communication")
    assert exposed == {0: pytest.approx(0.0221, abs=0.0002), 1: pytest.approx(0.002)}
    in_flight = by_rank(m["traceml_communication_in_flight_seconds"])
    assert in_flight == {0: pytest.approx(0.0221, abs=0.0002), 1: pytest.approx(0.002)}


def test_cuda_ddp_exports_the_gpus_wait_and_in_flight() -> None:
    # fixed_run's CUDA ranks with DDP's wait and in flight timed on every 3rd step.
    run = fixed_run(30)
    wait, flight = {0: 6.0, 1: 2.0}, {0: 9.0, 1: 4.0}
    steps = tuple(r.replace(gpu_forward_ms=1.0, gpu_backward_ms=2.0, gpu_optimizer_ms=0.5,
                            gpu_communication_ms=wait[r.rank], gpu_collective_ms=flight[r.rank])
                  if r.step % 3 == 0 else r for r in run.steps)
    m = scrape(dataclasses.replace(run, steps=steps))
    assert by_rank(m["traceml_gpu_communication_wait_seconds"]) == {0: 0.006, 1: 0.002}
    assert by_rank(m["traceml_gpu_communication_in_flight_seconds"]) == {0: 0.009, 1: 0.004}
    # Off CUDA DDP: absent, not 0.
    plain = scrape(fixed_run(30))
    assert "traceml_gpu_communication_wait_seconds" not in plain
    assert "traceml_gpu_communication_in_flight_seconds" not in plain


def test_eight_ranks_each_have_series_and_the_slow_loader_is_named() -> None:
    m = scrape(wide_run(8, 30, slow_rank=5))
    assert set(by_rank(m["traceml_steps_completed_total"])) == set(range(8))
    assert set(by_rank(m["traceml_samples_per_second"])) == set(range(8))
    assert m["traceml_ranks_exported"][0][1] == 8.0
    named = {labels["rank"] for labels, _ in m["traceml_finding_info"]
             if labels["kind"].endswith("STRAGGLER")}
    assert named == {"5"}
    assert m["traceml_job_samples_per_second"][0][1] == pytest.approx(
        sum(by_rank(m["traceml_samples_per_second"]).values()), rel=1e-6)


def test_many_ranks_export_the_named_worst_and_median_ranks_only() -> None:
    """Beyond ALL_RANKS, a job must not export every rank's series: the named ranks,
    a stalled one, and each value's worst and median rank."""
    stall = Incident("stall", 211, 26, "node26", 1211, T0 + 2.5, T0 + 5.0, None, 29, "input",
                     ("input",), (), "python")
    run = dataclasses.replace(wide_run(300, 30, slow_rank=137), incidents=(stall,))
    m = scrape(run)
    exported = set(by_rank(m["traceml_steps_completed_total"]))
    assert {137, 211} <= exported and len(exported) <= 40
    assert m["traceml_ranks"][0][1] == 300.0
    assert m["traceml_ranks_exported"][0][1] == len(exported)
    for name, samples in m.items():  # no per-rank series outside the chosen ranks
        ranks = {int(labels["rank"]) for labels, _ in samples if labels.get("rank")}
        assert ranks <= exported, name
    assert by_rank(m["traceml_rank_stalled"])[211] == 1.0
    assert sum(by_rank(m["traceml_rank_stalled"]).values()) == 1.0
    # Every rank hung (a collective that never returns): still a few series, and counts.
    hung = tuple(dataclasses.replace(stall, rank=r, began_at=T0 + 2.5 + r / 1000)
                 for r in range(300))
    m_hung = scrape(dataclasses.replace(run, incidents=hung))
    stalled = by_rank(m_hung["traceml_rank_stalled"])
    assert set(range(8)) <= set(stalled) and len(stalled) <= 50
    assert m_hung["traceml_ranks_stalled"][0][1] == 300.0
    # The same run with a higher bound: every rank.
    assert len(by_rank(scrape(run, all_ranks=300)["traceml_steps_completed_total"])) == 300


def test_an_ended_run_says_how_it_ended() -> None:
    run = fixed_run(30)
    for exit_code, state in ((0, "succeeded"), (1, "failed")):
        ended = dataclasses.replace(run, meta=dataclasses.replace(run.meta, exit_code=exit_code))
        states = {labels["state"]: v for labels, v in scrape(ended)["traceml_run_state"]}
        assert states[state] == 1.0 and sum(states.values()) == 1.0


def test_refused_messages_are_counted_by_reason() -> None:
    run = fixed_run(30)
    refused = dataclasses.replace(run, meta=dataclasses.replace(
        run.meta, rejected={"failed handshake": 3, "bad token": 1}))
    m = scrape(refused)
    assert {labels["reason"]: v for labels, v in m["traceml_collector_rejected_messages_total"]} \
        == {"failed handshake": 3.0, "bad token": 1.0}
    assert "traceml_collector_rejected_messages_total" not in scrape(run)


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read().decode()


def test_the_endpoint_serves_a_store_and_stops_after_one_more_scrape(tmp_path: Path) -> None:
    make_store(tmp_path / "telemetry.sqlite", num_steps=30)
    server = MetricsServer(LiveFamilies(tmp_path / "telemetry.sqlite"))
    port = free_port()
    address = server.start("127.0.0.1", port)
    assert address == {"url": f"http://127.0.0.1:{port}/metrics", "port": port}
    try:
        status, kind, body = get(address["url"])
        assert status == 200 and kind.startswith("text/plain")
        assert 'traceml_steps_completed_total{rank="1",session="dash"} 30.0' in body
        get(address["url"])  # a second scrape: the interval the end waits on
        scraped: list[str] = []

        def scrape_the_end() -> None:  # as Prometheus would, once the run is over
            wait_for(lambda: server.final or None, 10.0, "the end")
            scraped.append(get(address["url"])[2])

        later = threading.Thread(target=scrape_the_end)
        later.start()
        began = time.monotonic()
        server.finish()  # waits for the scrape above, then stops
        later.join()
        assert time.monotonic() - began < FINAL_LINGER_S and scraped
        with pytest.raises(OSError):
            get(address["url"])
    finally:
        server.close()


def test_a_taken_port_cannot_be_served(tmp_path: Path) -> None:
    make_store(tmp_path / "telemetry.sqlite")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            MetricsServer(LiveFamilies(tmp_path / "telemetry.sqlite")).start(
                "127.0.0.1", taken.getsockname()[1])


def test_many_nodes_export_the_exported_ranks_nodes_only() -> None:
    m = scrape(wide_run(300, 30, slow_rank=137))  # 38 nodes of 8 GPUs
    nodes = {labels["node"] for labels, _ in m["traceml_node_cpu_ratio"]}
    assert "17" in nodes and len(nodes) <= 8  # r137's node among a few
    assert {labels["node"] for labels, _ in m["traceml_gpu_utilization_ratio"]} == nodes
    assert len(scrape(wide_run(16, 30, slow_rank=3))["traceml_node_cpu_ratio"]) == 2


def test_a_finding_that_names_every_rank_exports_its_first_ranks_only() -> None:
    """HIGH CPU on 1000 ranks names them all: the series stay bounded."""
    from traceml.diagnosis.finding import Finding
    from traceml.live.metrics import NAMED_PER_FINDING, exported_ranks

    run = wide_run(300, 30, slow_rank=137)
    values = live_values(run, 100)
    busy = Finding("HIGH_CPU", "HIGH CPU", "warn", "every rank is busy.", "",
                   tuple(range(299, -1, -1)))
    process = dataclasses.replace(values.report.process, findings=(busy,))
    crowded = dataclasses.replace(values, report=dataclasses.replace(values.report,
                                                                    process=process))
    chosen = exported_ranks(crowded, set())
    assert set(range(299, 299 - NAMED_PER_FINDING, -1)) <= chosen
    assert len(chosen) <= len(exported_ranks(values, set())) + NAMED_PER_FINDING


def test_values_are_kept_until_a_rebuild_is_due_and_then_follow_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.rows import sent_by, step_record
    from traceml.live import metrics
    from traceml.store import StoreWriter
    from traceml.wire.identity import Sender

    db = tmp_path / "telemetry.sqlite"
    make_store(db, num_steps=30)
    monkeypatch.setattr(metrics, "MIN_REBUILD_S", 3600.0)
    source = LiveFamilies(db)

    def steps() -> dict[int, float]:
        fam = next(f for f in source.current() if f.name == "traceml_steps_completed_total")
        return {int(dict(labels)["rank"]): v for labels, v in fam.samples}

    assert steps() == {0: 30.0, 1: 30.0} and source.build_s is not None
    writer = StoreWriter(str(db))
    sender = Sender(role="agent", host="h", pid=10, node_rank=0, rank=0, local_rank=0,
                    world_size=2)
    writer.add_steps(sent_by(sender, [step_record(s, t_begin=T0 + s, total_ms=10.0)
                                      for s in range(30, 40)]))
    writer.close()
    assert steps() == {0: 30.0, 1: 30.0}  # no rebuild due: the last values
    monkeypatch.setattr(metrics, "MIN_REBUILD_S", 0.0)
    source = LiveFamilies(db)
    assert steps() == {0: 40.0, 1: 30.0}
    assert source.build_s is not None and source.build_s < 60.0


def test_the_values_say_how_old_they_are(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from traceml.live import metrics

    make_store(tmp_path / "telemetry.sqlite", num_steps=30)
    monkeypatch.setattr(metrics, "MIN_REBUILD_S", 3600.0)
    source = LiveFamilies(tmp_path / "telemetry.sqlite")
    first = {f.name: f for f in source.current()}["traceml_metrics_age_seconds"]
    (labels, age0), = first.samples
    assert dict(labels) == {"session": "dash"} and 0.0 <= age0 < 60.0
    wait_for(lambda: {f.name: f for f in source.current()}[
        "traceml_metrics_age_seconds"].samples[0][1] > age0 or None, 5.0, "an older age")


def test_a_watched_run_without_steps_has_its_hosts_and_no_rank_series() -> None:
    """traceml watch: nothing injected, so no steps; the node series still answer."""
    run = fixed_run(30)
    watched = dataclasses.replace(run, steps=(), meta=dataclasses.replace(run.meta, mode="watch"))
    m = scrape(watched)
    assert m["traceml_ranks"][0][1] == 0.0 and "traceml_steps_completed_total" not in m
    assert "traceml_step_duration_seconds" not in m
    assert all(labels["rank"] == "" for labels, _ in m.get("traceml_finding_info", []))
    assert [labels["node"] for labels, _ in m["traceml_node_cpu_ratio"]] == ["0"]
    assert {labels["mode"] for labels, _ in m["traceml_run_info"]} == {"watch"}


def test_a_first_scrape_late_in_a_run_does_not_pace_the_next_by_its_backlog(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first read of a late first scrape takes the backlog; the next rebuild is
    paced by what a build costs, not by that read."""
    from traceml.live import metrics, tail

    class Clock:
        now = 100.0

        def monotonic(self) -> float:
            return self.now

    clock = Clock()
    monkeypatch.setattr(metrics, "time", clock)
    monkeypatch.setattr(tail, "time", clock)  # the tail times its own first read
    make_store(tmp_path / "telemetry.sqlite", num_steps=30)
    source = LiveFamilies(tmp_path / "telemetry.sqlite")
    first_read = source._tail._poll
    polls = []

    def poll() -> object:
        polls.append(1)
        if len(polls) == 1:
            clock.now += 60.0  # an hour of a wide job's backlog
        return first_read()

    monkeypatch.setattr(source._tail, "_poll", poll)
    assert source.current() and len(polls) == 1
    assert source.build_s is not None and source.build_s < 1.0
    clock.now += metrics.MIN_REBUILD_S
    source.current()
    assert len(polls) == 2
