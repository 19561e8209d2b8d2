"""A session folder -> RunData -> the final summary files (offline analysis).

Reads ``telemetry.sqlite`` (never torch) and writes ``final_summary.json`` and
``final_summary.txt`` atomically.  Used at the end of ``traceml run``, by
``traceml report`` and by ``traceml.summary()``.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from traceml import phases
from traceml.diagnosis.samples import (
    GpuSample,
    NodeInfo,
    ProcessSample,
    RunData,
    RunMeta,
    StepRow,
    SystemSample,
)
from traceml.errors import UsageError
from traceml.report.build import build_report
from traceml.report.json_codec import report_to_json
from traceml.report.model import Report
from traceml.report.text import render_text
from traceml.store import STORE_FILENAME, StoreReader

JSON_NAME = "final_summary.json"
TEXT_NAME = "final_summary.txt"
DEFAULT_WINDOW_ROWS = 10000


@dataclass(frozen=True)
class SummaryFiles:
    report: Report
    summary: dict[str, Any]
    text: str
    json_path: Path
    text_path: Path
    run: RunData


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder and rename over the target."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_store(session_dir: Path) -> StoreReader:
    path = session_dir / STORE_FILENAME
    if not path.is_file():
        raise UsageError(f"traceml: no {STORE_FILENAME} in {session_dir} "
                         "(give the session folder that 'traceml run' printed)")
    try:
        reader = StoreReader(str(path))
        reader.meta()
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"traceml: cannot read {path}: {exc}") from None
    return reader


def load_run(session_dir: Path) -> tuple[RunData, int]:
    """The stored run and the summary window it asked for."""
    reader = open_store(session_dir)
    try:
        meta = reader.meta()
        senders = [dict(r) for r in reader.senders()]
        steps = tuple(step_row(dict(r)) for r in reader.steps())
        process = tuple(process_sample(dict(r)) for r in reader.process())
        system = tuple(system_sample(dict(r)) for r in reader.system() if r["node_rank"] >= 0)
        rejected = reader.rejected()
    finally:
        reader.close()
    described = run_meta(meta, senders, steps, process, rejected)
    window = int(meta.get("summary_window_rows") or DEFAULT_WINDOW_ROWS)
    return RunData(described, steps, process, system), window


def step_row(r: dict[str, Any]) -> StepRow:
    return StepRow(
        rank=r["rank"], step=r["step"], phase_ms={p.name: r[p.column] for p in phases.PHASES},
        total_ms=r["total_ms"], wait_ms=r["wait_ms"],
        peak_allocated_bytes=r["peak_allocated_bytes"],
        peak_reserved_bytes=r["peak_reserved_bytes"], rss_bytes=r["rss_bytes"],
        t=(r["t_begin"] + r["total_ms"] / 1e3) if r["t_begin"] is not None else None,
        gpu_ms=_gpu_ms(r),
    )


def _gpu_ms(r: dict[str, Any]) -> float | None:
    """GPU time of the step's GPU-timed phases (None off CUDA)."""
    parts = [r.get(p.gpu_column) for p in phases.gpu_timed()]
    return None if any(p is None for p in parts) else float(sum(parts))  # type: ignore[arg-type]


def process_sample(r: dict[str, Any]) -> ProcessSample:
    return ProcessSample(
        rank=r["rank"], node_rank=r["node_rank"], t=r["t"], cpu_pct=r["cpu_pct"] or 0.0,
        rss_bytes=r["rss_bytes"] or 0, host_ram_total_bytes=r["host_ram_total_bytes"] or 0,
        num_cpus=r["num_cpus"] or 1, device_allocated_bytes=r["device_allocated_bytes"],
        device_reserved_bytes=r["device_reserved_bytes"],
        device_total_bytes=r["device_total_bytes"],
    )


def system_sample(r: dict[str, Any]) -> SystemSample:
    gpus = tuple(GpuSample(*g) for g in orjson.loads(r["gpus"] or "[]"))
    return SystemSample(node_rank=r["node_rank"], host=r["host"], t=r["t"],
                        cpu_pct=r["cpu_pct"] or 0.0, ram_pct=r["ram_pct"] or 0.0,
                        ram_total_bytes=r["ram_total_bytes"] or 0, gpus=gpus)


def _nodes(senders: list[dict[str, Any]]) -> tuple[NodeInfo, ...]:
    hosts: dict[int, str] = {}
    ranks: dict[int, set[int]] = {}
    for s in senders:
        if s["node_rank"] < 0:
            continue  # a c10d launcher before it learnt its node rank
        hosts.setdefault(s["node_rank"], s["host"])
        ranks.setdefault(s["node_rank"], set())
        if s["rank"] is not None:
            ranks[s["node_rank"]].add(s["rank"])
    return tuple(NodeInfo(n, hosts[n], tuple(sorted(ranks[n]))) for n in sorted(hosts))


def run_meta(meta: dict[str, Any], senders: list[dict[str, Any]], steps: tuple[StepRow, ...],
              process: tuple[ProcessSample, ...], rejected: dict[str, int]) -> RunMeta:
    seen = {s["rank"] for s in senders if s["rank"] is not None}
    reported = [s["world_size"] for s in senders if s["world_size"]]
    world_size = max(reported + [int(meta.get("expected_world_size") or 0), len(seen)])
    if meta.get("mode", "run") == "run":
        # A rank that never said goodbye was lost (killed, or its node died):
        # its data stops early.  Watch mode has no agent to say goodbye.
        seen = {s["rank"] for s in senders if s["rank"] is not None and s["said_bye"]}
    missing = tuple(r for r in range(world_size) if r not in seen)
    exit_code = meta.get("exit_code")
    cuda = any(s.peak_allocated_bytes is not None for s in steps) or any(
        p.device_total_bytes is not None for p in process)
    started = float(meta.get("started_at") or 0.0)
    return RunMeta(
        session_id=str(meta.get("session_id", "")), command=list(meta.get("command", [])),
        started_at=started, ended_at=float(meta.get("ended_at") or started),
        exit_code=exit_code, partial=bool(missing) or exit_code != 0,
        world_size=world_size, missing_ranks=missing, nodes=_nodes(senders),
        device="cuda" if cuda else "cpu",
        versions={"traceml": str(meta.get("traceml_version", "")),
                  "torch": str(meta.get("torch_version", "")),
                  "python": str(meta.get("python_version", ""))},
        transport={"sent": sum(s["num_sent"] for s in senders),
                   "dropped": sum(s["num_dropped"] for s in senders),
                   "gaps": sum(s["num_gaps"] for s in senders),
                   "rejected": sum(rejected.values())},
        mode=str(meta.get("mode", "run")),
    )


def write_summary(session_dir: Path, window_rows: int | None = None) -> SummaryFiles:
    """Build the report from the store and write both summary files atomically."""
    run, stored_window = load_run(session_dir)
    report = build_report(run, window_rows or stored_window)
    summary = report_to_json(report)
    text = render_text(report)
    json_path, text_path = session_dir / JSON_NAME, session_dir / TEXT_NAME
    write_atomic(json_path, orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    write_atomic(text_path, text.encode())
    return SummaryFiles(report, summary, text, json_path, text_path, run)
