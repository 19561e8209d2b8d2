"""Prometheus metrics of a live run, with the diagnosis in them (collector process).

``traceml run --metrics-port PORT`` serves ``/metrics`` from node 0's collector
process (never a training thread), bound to 127.0.0.1 unless
``--metrics-bind-host`` says otherwise.  A scrape reads what the live views read
(`traceml.live.tail.StoreTail`: the store's new rows, read-only, bounded) and
the live report built over it, at most once per ``MIN_REBUILD_S`` however many
scrapers ask, and less often when a build takes long (``BUILD_SHARE``).  When
the run is over the endpoint serves the last values with the run's state until
it has been scraped once more (``FINAL_LINGER_S`` at most), then stops.

The metric families are plain data (:class:`Family`), built by
:func:`families` from a snapshot; the schema, with every metric's type, unit,
labels and meaning, is ``docs/metrics.md``.  Bounded at scale: up to
``ALL_RANKS`` ranks, every rank has its series; beyond, only the ranks a reader
needs (:func:`exported_ranks`): those the findings name first, stalled or
crashed ranks, and per measured value the worst and the median rank; and only their
nodes' host and GPU series, with the busiest and the median node's.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from traceml import phases
from traceml.diagnosis.communication import GPU_WAIT
from traceml.diagnosis.finding import NOT_MEASURED
from traceml.diagnosis.step_time import RankStepTimes, comm_measured
from traceml.diagnosis.throughput import RankThroughput
from traceml.live.tail import StoreTail
from traceml.records import Incident, RunData, StepRow
from traceml.report.model import SECTION_NAMES, Report
from traceml.report.page.snapshot import TABLE_PARTS, RankPhases, live_report, phase_rows
from traceml.store import StoreError

MIN_REBUILD_S = 1.0
FINAL_LINGER_S = 3.0
"""After the run, the final values wait this long at most for one more scrape (the
launcher stops the collector within 15 s, the dashboard's and OTLP's ends among
it); with a longer scrape interval the target's going away (``up == 0``) marks
the end."""
MIN_LINGER_S = 1.0
ALL_RANKS = 64
"""Up to this many ranks every rank has its per-rank series (see `exported_ranks`)..."""
NAMED_PER_FINDING = 8
"""...beyond, a finding's first ranks (most affected first) have theirs."""
BUILD_SHARE = 0.1
"""A rebuild waits at least this many times its own last build time over again, so
building the values takes about this share of a core at most, at any size."""
PREFIX = "traceml_"

PHASE_PARTS = tuple(p for p in TABLE_PARTS if p is not phases.TOTAL)
"""The phases of ``traceml_phase_duration_seconds``: every stacked phase and wait."""
FINDING_PHASES: Mapping[str, str] = {
    "INPUT_STRAGGLER": "input", "INPUT_BOUND": "input",
    "HOST_STRAGGLER": "wait", "WAIT_HEAVY": "wait",
    "COMPUTE_STRAGGLER": "compute", "COMPUTE_BOUND": "compute",
    "STRAGGLER": "total", "COMMUNICATION_BOUND": "communication",
}
"""The phase a finding is about, for its ``phase`` label ("" when none)."""
RUN_STATES = ("running", "succeeded", "failed")

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Values:
    """What the metrics are read from: a report and its per-rank phase table (the
    live views' snapshot without what only a page draws)."""

    report: Report
    phases: tuple[RankPhases, ...]


def live_values(run: RunData, window_rows: int) -> Values:
    """The values of a running job over the live window of its recent rows."""
    report = live_report(run, window_rows)
    return Values(report, phase_rows(run, report))


@dataclass(frozen=True)
class Family:
    """One metric: its exposition name, type ("gauge", "counter", "info"), help
    text, and samples (labels, value).  An info family's samples are all 1."""

    name: str
    kind: str
    help: str
    samples: tuple[tuple[Labels, float], ...]


class _Families:
    """Collects families in order; a family without samples is left out
    (not measured is absent, never 0)."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.out: list[Family] = []

    def add(self, name: str, kind: str, help: str,
            samples: Iterable[tuple[Mapping[str, str], float | None]]) -> None:
        kept = tuple((tuple({"session": self.session, **labels}.items()), float(value))
                     for labels, value in samples if value is not None)
        if kept:
            self.out.append(Family(PREFIX + name, kind, help, kept))


def run_state(run: RunData) -> str:
    """running, succeeded (exit status 0) or failed (any other ending, a lost launcher)."""
    if run.meta.exit_code is None and run.meta.lost is None:
        return "running"
    return "succeeded" if run.meta.exit_code == 0 else "failed"


def families(snap: Values, run: RunData, state: str | None = None,
             all_ranks: int = ALL_RANKS) -> list[Family]:
    """The metric families of ``run``'s values (see ``docs/metrics.md``)."""
    meta = run.meta
    out = _Families(meta.session_id)
    state = state or run_state(run)
    out.add("run_info", "info", "The run: world size, device, mode, traceml version.",
            [({"world_size": str(meta.world_size), "device": meta.device, "mode": meta.mode,
               "version": meta.versions.get("traceml", "")}, 1)])
    out.add("run_state", "gauge", "1 for the run's state (running, succeeded, failed), else 0.",
            [({"state": s}, float(s == state)) for s in RUN_STATES])
    stalled = _first_ranks(i for i in run.incidents if i.what == "stall" and i.cleared_at is None)
    crashed = _first_ranks(i for i in run.incidents if i.what != "stall")
    # A hang of every rank stalls them all: the first ones keep their series (earliest first).
    ranks = exported_ranks(snap, set(list(stalled)[:NAMED_PER_FINDING])
                           | set(list(crashed)[:NAMED_PER_FINDING]), all_ranks)
    out.add("ranks", "gauge", "Ranks that reported steps.", [({}, len(snap.phases))])
    out.add("ranks_stalled", "gauge", "Ranks reported stalled now.", [({}, len(stalled))])
    out.add("ranks_crashed", "gauge", "Ranks that ended with an exception or a failed exit.",
            [({}, len(crashed))])
    out.add("ranks_exported", "gauge", "Ranks with per-rank series in this endpoint "
            f"(every rank up to {all_ranks}; beyond, the named, worst and median ones).",
            [({}, len(ranks))])
    _step_families(out, snap, run, ranks)
    out.add("rank_stalled", "gauge", "1 while the rank is reported stalled (no progress).",
            [({"rank": str(r)}, float(r in stalled)) for r in sorted(ranks)])
    out.add("rank_crashed", "gauge", "1 once the rank ended with an exception or a failed exit.",
            [({"rank": str(r)}, float(r in crashed)) for r in sorted(ranks)])
    _throughput_families(out, snap, ranks)
    _finding_families(out, snap)
    _memory_families(out, run, ranks, bounded=len(snap.phases) > all_ranks)
    transport = meta.transport
    out.add("telemetry_dropped_messages_total", "counter",
            "Messages the ranks' senders dropped (collector unreachable or behind).",
            [({}, transport.get("dropped", 0))])
    out.add("telemetry_sequence_gaps_total", "counter",
            "Messages that never arrived, from gaps in the senders' sequence numbers.",
            [({}, transport.get("gaps", 0))])
    out.add("collector_rejected_messages_total", "counter",
            "Messages the collector refused, by reason (they are not in any figure).",
            [({"reason": reason}, n) for reason, n in sorted(meta.rejected.items())])
    return out.out


def _first_ranks(incidents: Iterable[Incident]) -> dict[int, None]:
    """The ranks of ``incidents``, earliest first (an ordered set)."""
    return dict.fromkeys(i.rank for i in sorted(incidents, key=lambda i: (i.began_at, i.rank)))


def exported_ranks(snap: Values, named: set[int], all_ranks: int = ALL_RANKS) -> set[int]:
    """The ranks with per-rank series: every rank up to ``all_ranks``; beyond, ``named``
    ranks, those the findings name, and for each phase, the last step and each rate,
    the worst and the median rank."""
    rows = snap.phases
    if len(rows) <= all_ranks:
        return {r.rank for r in rows}
    chosen = set(named)
    for section in SECTION_NAMES:
        for finding in snap.report.section(section).findings:
            chosen.update(finding.ranks[:NAMED_PER_FINDING])
    for part in TABLE_PARTS:
        chosen.update(_worst_and_median([(r.median_ms[part.column], r.rank) for r in rows
                                         if part.column in r.median_ms], highest=True))
    chosen.update(_worst_and_median([(r.last_step, r.rank) for r in rows
                                     if r.last_step is not None], highest=False))
    rates = [r for r in snap.report.throughput.ranks if isinstance(r, RankThroughput)]
    for key in ("samples_per_s", "tokens_per_s", "mfu_pct"):
        chosen.update(_worst_and_median([(v, r.rank) for r in rates
                                         if (v := getattr(r, key)) is not None], highest=False))
    return chosen


def _worst_and_median(values: list[tuple[float, int]], highest: bool) -> set[int]:
    if not values:
        return set()
    ordered = sorted(values)
    worst = ordered[-1] if highest else ordered[0]
    return {worst[1], ordered[(len(ordered) - 1) // 2][1]}


def _step_families(out: _Families, snap: Values, run: RunData, ranks: set[int]) -> None:
    rows = [r for r in snap.phases if r.rank in ranks]
    times = {r.rank: r for r in snap.report.step_time.ranks if isinstance(r, RankStepTimes)}
    # Collectives untimed (one rank, NCCL): their phases are absent, not 0.
    parts = PHASE_PARTS if comm_measured(times) else tuple(
        p for p in PHASE_PARTS if not p.collective)
    out.add("steps_completed_total", "counter",
            "Steps the rank completed (its newest step index + 1; a restart counts again from 0).",
            [({"rank": str(r.rank)}, r.last_step + 1 if r.last_step is not None else None)
             for r in rows])
    out.add("step_duration_seconds", "gauge",
            "The rank's typical step over the live window (median, boundary to boundary).",
            [({"rank": str(r.rank)}, _s(r.median_ms.get(phases.TOTAL.column))) for r in rows])
    out.add("phase_duration_seconds", "gauge",
            "The rank's typical time per step in each phase over the live window (median); "
            "communication is the exposed wait on collectives, wait the time outside every "
            "phase.",
            [({"rank": str(r.rank), "phase": p.name}, _s(r.median_ms.get(p.column)))
             for r in rows for p in parts])
    out.add("communication_in_flight_seconds", "gauge",
            "The rank's collectives in flight per step, overlapping its other work (median).",
            _medians(times, ranks, "collective_ms"))
    out.add("gpu_communication_wait_seconds", "gauge",
            "CUDA: the time the rank's GPU waited on DDP's all-reduces per step, on the steps "
            "timed with CUDA events (median).",
            _medians(times, ranks, GPU_WAIT))
    out.add("gpu_communication_in_flight_seconds", "gauge",
            "CUDA: DDP's all-reduces in flight on the rank's GPU per step, from its first "
            "bucket's gradients to the end of its wait, on the steps timed with CUDA events "
            "(median).",
            _medians(times, ranks, "gpu_collective_ms"))
    last = _last_steps(run.steps, ranks)
    out.add("last_step_timestamp_seconds", "gauge",
            "Unix time the rank's newest step ended (for no-progress alerts).",
            [({"rank": str(rank)}, t) for rank, t in sorted(last.items())])


def _medians(times: Mapping[int, RankStepTimes], ranks: set[int], name: str
             ) -> list[tuple[dict[str, str], float | None]]:
    """Each of ``ranks``' median of a reported step column, in seconds (None: not
    measured)."""
    return [({"rank": str(rank)}, _s(d.p50 if (d := t.reported.get(name)) else None))
            for rank, t in sorted(times.items()) if rank in ranks]


def _last_steps(steps: Iterable[StepRow], ranks: set[int]) -> dict[int, float]:
    out: dict[int, float] = {}
    for row in steps:
        if row.rank in ranks and row.t_begin is not None:
            end = row.t_begin + row.total_ms / 1e3
            if end > out.get(row.rank, float("-inf")):
                out[row.rank] = end
    return out


def _throughput_families(out: _Families, snap: Values, ranks: set[int]) -> None:
    section = snap.report.throughput
    rows = [r for r in section.ranks if isinstance(r, RankThroughput) and r.rank in ranks]
    for name, key, scale, help in (
            ("samples_per_second", "samples_per_s", 1.0, "Samples per second"),
            ("tokens_per_second", "tokens_per_s", 1.0, "Tokens per second"),
            ("flops_per_second", "achieved_tflops", 1e12, "Achieved FLOP/s"),
            ("mfu_ratio", "mfu_pct", 0.01, "Model FLOPs utilisation, 0 to 1,")):
        out.add(name, "gauge", f"{help} of the rank over the live window (absent: not measured).",
                [({"rank": str(r.rank)}, _scaled(getattr(r, key), scale)) for r in rows])
        job = section.job
        out.add(f"job_{name}", "gauge", f"{help} of the whole job (the ranks' sum; MFU: "
                "the job's) over the live window.",
                [({}, _scaled(getattr(job, key) if job is not None else None, scale))])


def _finding_families(out: _Families, snap: Values) -> None:
    report = snap.report
    found, excess = [], []
    for name in SECTION_NAMES:
        for finding in report.section(name).findings:
            if finding.kind == NOT_MEASURED:
                continue
            rank = str(finding.ranks[0]) if finding.ranks else ""
            found.append(({"section": name, "kind": finding.kind, "severity": finding.severity,
                           "label": finding.label, "rank": rank,
                           "phase": FINDING_PHASES.get(finding.kind, "")}, 1.0))
            value = finding.evidence.get("excess_ms")
            if value is not None and finding.ranks:
                excess.append(({"kind": finding.kind, "rank": rank,
                                "severity": finding.severity}, value / 1e3))
    out.add("finding_info", "info", "The live diagnosis: one series per current finding "
            "(section, kind, severity, label, the rank it names first, the phase).", found)
    out.add("straggler_excess_seconds", "gauge",
            "How much longer the named straggler's step part takes than the other ranks'.",
            excess)


def _memory_families(out: _Families, run: RunData, ranks: set[int], bounded: bool) -> None:
    latest = {}
    for sample in run.process:  # in time order: the newest of each rank wins
        if sample.rank in ranks:
            latest[sample.rank] = sample
    procs = [latest[r] for r in sorted(latest)]
    for name, key, scale, help in (
            ("process_resident_memory_bytes", "rss_bytes", 1, "The rank's host RSS"),
            ("process_cpu_cores", "cpu_pct", 0.01, "The rank's process CPU, in cores,"),
            ("device_memory_allocated_bytes", "device_allocated_bytes", 1,
             "Device memory the rank's tensors hold"),
            ("device_memory_reserved_bytes", "device_reserved_bytes", 1,
             "Device memory the rank's allocator reserved"),
            ("device_memory_capacity_bytes", "device_total_bytes", 1,
             "The rank's device's memory")):
        out.add(name, "gauge", f"{help} at the last sample.",
                [({"rank": str(p.rank)}, _scaled(getattr(p, key), scale)) for p in procs])
    nodes = {}
    for system in run.system:
        nodes[system.node_rank] = system
    if bounded:  # the exported ranks' nodes, and the busiest and median node
        kept = {n.node_rank for n in run.meta.nodes if ranks & set(n.ranks)}
        kept |= _worst_and_median([(s.cpu_pct, n) for n, s in nodes.items()], highest=True)
        nodes = {n: s for n, s in nodes.items() if n in kept}
    hosts = [nodes[n] for n in sorted(nodes)]
    for name, key, scale, help in (
            ("node_cpu_ratio", "cpu_pct", 0.01, "The node's CPU busy, 0 to 1,"),
            ("node_memory_ratio", "ram_pct", 0.01, "The node's RAM in use, 0 to 1,"),
            ("node_memory_capacity_bytes", "ram_total_bytes", 1, "The node's RAM")):
        out.add(name, "gauge", f"{help} at the last sample.",
                [({"node": str(s.node_rank), "host": s.host}, _scaled(getattr(s, key), scale))
                 for s in hosts])
    out.add("gpu_utilization_ratio", "gauge", "The GPU's utilisation, 0 to 1, at the last sample.",
            [({"node": str(s.node_rank), "gpu": str(g.index)}, _scaled(g.util_pct, 0.01))
             for s in hosts for g in s.gpus])
    out.add("gpu_memory_used_bytes", "gauge", "The GPU's memory in use at the last sample.",
            [({"node": str(s.node_rank), "gpu": str(g.index)}, _scaled(g.mem_used_bytes, 1))
             for s in hosts for g in s.gpus])


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def to_text(fams: Iterable[Family]) -> str:
    """The families in Prometheus's text exposition format (as the endpoint serves them)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Adapter(lambda: list(fams)))
    return generate_latest(registry).decode("utf-8")


class _Adapter:
    """prometheus_client's collector interface over :class:`Family` lists."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            InfoMetricFamily,
        )

        for fam in self.source():
            names = [k for k, _ in fam.samples[0][0]]
            metric: Any
            if fam.kind == "counter":
                metric = CounterMetricFamily(fam.name.removesuffix("_total"), fam.help,
                                             labels=names)
            elif fam.kind == "info":
                metric = InfoMetricFamily(fam.name.removesuffix("_info"), fam.help,
                                          labels=names)
            else:
                metric = GaugeMetricFamily(fam.name, fam.help, labels=names)
            for labels, value in fam.samples:
                values = [v for _, v in labels]
                if fam.kind == "info":
                    metric.add_metric(values, {})
                else:
                    metric.add_metric(values, value)
            yield metric


class LiveFamilies:
    """The families of a live run, from its store (`StoreTail`): rebuilt when asked,
    at most once per MIN_REBUILD_S and never sooner than 1 / BUILD_SHARE times the
    last build's own time (any thread; the endpoint and the OTLP export share one)."""

    def __init__(self, db_path: Path) -> None:
        self._tail = StoreTail(db_path)
        self._lock = threading.Lock()
        self._families: list[Family] = []
        self._next_at = float("-inf")
        self.final = False
        self._failed = False  # a build failed (said once)
        self._built_at: float | None = None  # when the families were built
        self.build_s: float | None = None  # the last build's time

    def current(self) -> list[Family]:
        """The families now (the last ones until a rebuild is due), with their age."""
        with self._lock:
            if not self.final and time.monotonic() >= self._next_at:
                self._rebuild()
            return self._with_age()

    def _with_age(self) -> list[Family]:
        if not self._families or self._built_at is None:
            return self._families
        labels = self._families[0].samples[0][0][:1]  # the session label
        age = Family(PREFIX + "metrics_age_seconds", "gauge",
                     "How old these values are: the time since traceml built them from "
                     "the store (at most a second up to a few hundred ranks).",
                     ((labels, time.monotonic() - self._built_at),))
        return [*self._families, age]

    def finish(self) -> list[Family]:
        """The run is over and the store closed: one last read, its ending among it;
        these families from now on."""
        with self._lock:
            if not self.final:
                self._rebuild()
                self.final = True
            return self._with_age()

    def _rebuild(self) -> None:
        began = time.monotonic()
        try:
            run, window_rows = self._tail.poll()
            began += self._tail.backlog_s  # a late first scrape's backlog paces nothing
            if run.steps or run.process or run.system:
                self._families = families(live_values(run, window_rows), run)
                self._built_at = time.monotonic()
        except StoreError:
            pass  # busy for a moment: the last values again
        except Exception as exc:  # never the collector's end: the last values, said once
            if not self._failed:
                self._failed = True
                print(f"traceml collector: warning: metrics not updated: {exc!r}",
                      file=sys.stderr, flush=True)
        finally:
            now = time.monotonic()
            self.build_s = now - began
            self._next_at = now + max(MIN_REBUILD_S, self.build_s / BUILD_SHARE)


class MetricsServer:
    """``/metrics`` of a live run: a daemon HTTP thread in the collector process."""

    def __init__(self, source: LiveFamilies) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._final = False
        self._scraped = threading.Event()  # a scrape of the final values was answered
        self._last_scrape = 0.0
        self._interval: float | None = None  # between the last two scrapes
        self._server: _Server | None = None

    def start(self, host: str, port: int) -> dict[str, Any]:
        """Listen on ``host:port`` (OSError when it cannot: the launcher stops there)."""
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Adapter(self.current))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server = _Server((host, port), _Handler, registry, self, family)
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="traceml-metrics", daemon=True).start()
        bound = int(server.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        return {"url": f"http://{shown}:{bound}/metrics", "port": bound}

    def current(self) -> list[Family]:
        """The families a scrape gets (scrape thread)."""
        with self._lock:
            now = time.monotonic()
            self._interval = now - self._last_scrape if self._last_scrape > 0 else None
            self._last_scrape = now
        return self.source.current()

    def answered(self, final: bool) -> None:
        """A scrape's answer was written (``final``: of the values after the run)."""
        if final:
            self._scraped.set()

    @property
    def final(self) -> bool:
        return self._final

    def finish(self) -> None:
        """The run is over and the store closed: the last values, the run's ending
        among them, served until scraped once more (1.5 scrape intervals, between
        MIN_LINGER_S and FINAL_LINGER_S); never scraped: stop at once.  Cheap: the
        launcher builds the summary, not this."""
        with self._lock:
            interval = self._interval if self._last_scrape > 0 else None
        if self._server is None or self._last_scrape == 0:
            self.close()
            return
        self.source.finish()
        with self._lock:
            self._final = True
        linger = 1.5 * interval + 0.5 if interval is not None else FINAL_LINGER_S
        self._scraped.wait(min(FINAL_LINGER_S, max(MIN_LINGER_S, linger)))
        self.close()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 registry: Any, owner: MetricsServer, family: int) -> None:
        self.address_family = family
        self.registry = registry
        self.owner = owner
        super().__init__(address, handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # the name http.server calls
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self._send(404, "text/plain; charset=utf-8", b"not found: /metrics\n")
            return
        owner = self.server.owner
        final = owner.final
        self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.server.registry))
        owner.answered(final)

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:  # the base signature
        """Quiet: the collector's stderr is not for access logs."""
