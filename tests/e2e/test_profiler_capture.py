"""End to end: profiler captures on real 2-rank gloo DDP launched by `traceml run`, zero
code (tests/e2e/scripts/capture_job.py never imports traceml): a live finding asks the
suspect and the median rank for the same steps; `traceml capture` asks by hand, with the
session's key only."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import zmq

from tests.conftest import RunResult, read_store, read_summary, run_traceml, script
from traceml.security import client_keys_from, client_keys_text

JOB = script("capture_job.py")


def until(tmp: Path, kind: str = "") -> str:
    """capture_job's --until: this rank's trace of a capture (of ``kind``), once written
    whole."""
    return str(tmp / "logs" / "s1" / "captures" / f"*{kind}-r{{rank}}.pt.trace.json.gz")


def assert_steps_unchanged(res: RunResult) -> None:
    """Every step each rank ran is stored: a capture adds or loses none."""
    stored = Counter(s["rank"] for s in res.steps)
    for rank in (0, 1):
        ran = json.loads((res.evidence_dir / f"rank{rank}.json").read_text())["steps"]
        assert stored[rank] == ran, (rank, stored, ran)


def trace_events(path: str) -> list[dict[str, Any]]:
    with gzip.open(path) as f:
        trace = json.load(f)
    assert trace["traceml"]["steps"] >= 1
    return list(trace["traceEvents"])


def test_a_compute_straggler_is_profiled_against_the_median_rank(tmp_path: Path) -> None:
    # Rank 1 gets twice the rows (an uneven shard): twice the matmul work.
    res = run_traceml(tmp_path, "run", "--nproc-per-node", "2", JOB, "--case", "uneven",
                      "--until", until(tmp_path, "compute_straggler"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.summary is not None
    (c,) = [c for c in res.summary["captures"] if c["trigger"] == "COMPUTE_STRAGGLER"]
    # 4 steps by default (--capture-steps): one step's stray milliseconds would set the
    # operators 25 % off the phase below with 2 (README, "Profiler captures")
    assert (c["suspect"], c["reference"], c["num_steps"], c["notes"]) == (1, 0, 4, [])
    # The compute operators, as the summary adds them up (a slow fetch's iterator, part
    # "input", may rank among all of them under load: its time is real, but not what
    # this straggler is about)
    compute = [o for o in c["operators"] if not o["communication"] and o["part"] == "compute"]
    assert compute[0]["name"] in ("aten::mm", "aten::addmm"), c["operators"]
    assert {"aten::mm", "aten::addmm"} <= {o["name"] for o in compute[:4]}
    matmuls = [o for o in compute if o["name"] in ("aten::mm", "aten::addmm")]
    for o in matmuls[:2]:  # r1's rows are 512, r0's 256
        assert o["diff_ms"] > 0
        assert "512" in o["suspect"]["shapes"] and "256" in o["reference"]["shapes"], o
    # The operators account for the phase's excess in the same steps, within 25 %.
    excess = c["phase_ms"]["suspect"] - c["phase_ms"]["reference"]
    assert excess > 0 and abs(c["compute_diff_ms"] - excess) <= 0.25 * excess, c
    for t in c["traces"]:
        names = {e.get("name") for e in trace_events(t["path"])}
        assert "aten::addmm" in names and t["bytes"] == os.path.getsize(t["path"])
    # The captured steps are out of the window; none is lost.
    assert res.summary["step_time"]["scope"]["num_captured_steps"] >= 5  # and the writing
    assert_steps_unchanged(res)
    card = (res.session_dir / "final_summary.txt").read_text()
    flat = "".join(line.strip("|").strip() for line in card.splitlines())  # wrapped lines
    assert "".join("Operators (profiler capture c1-compute_straggler".split()) in "".join(
        flat.split())


def test_a_communication_bound_capture_puts_the_collective_on_top(tmp_path: Path) -> None:
    # 67 MB of gradients and 2 rows a batch: the all-reduce is most of the step.
    res = run_traceml(tmp_path, "run", "--nproc-per-node", "2", JOB, "--case", "heavy",
                      "--until", until(tmp_path, "communication_bound"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.summary is not None
    (c,) = [c for c in res.summary["captures"] if c["trigger"] == "COMMUNICATION_BOUND"]
    top = c["operators"][0]
    assert top["communication"] and top["name"] == "gloo:all_reduce", c["operators"]
    assert c["num_steps"] == 4
    assert_steps_unchanged(res)


class LiveJob:
    """capture_job under ``traceml run --capture off``, in the background."""

    def __init__(self, tmp: Path, *options: str) -> None:
        self.tmp = tmp
        self.session = tmp / "logs" / "s1"
        (tmp / "evidence").mkdir()
        self.log = (tmp / "traceml.out").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "traceml", "run", "--logs-dir", str(tmp / "logs"),
             "--session-id", "s1", "--capture", "off", *options, "--nproc-per-node", "2",
             JOB, "--case", "uneven", "--until", until(tmp), "--max-steps", "4000"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp,
            env=dict(os.environ, OMP_NUM_THREADS="1", EVIDENCE_DIR=str(tmp / "evidence")))

    def wait_for_steps(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            steps, _ = read_store(self.session / "telemetry.sqlite")
            if len({s["rank"] for s in steps if s["step"] >= n}) == 2:
                return
            assert self.proc.poll() is None, (self.tmp / "traceml.out").read_text()[-3000:]
            time.sleep(0.5)
        raise AssertionError("no steps stored in time")

    def capture(self, session: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "traceml", "capture", str(session), *args],
                              capture_output=True, text=True, timeout=180)

    def finish(self) -> RunResult:
        try:
            self.proc.wait(240)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
        steps, senders = read_store(self.session / "telemetry.sqlite")
        out = (self.tmp / "traceml.out").read_text()
        return RunResult(self.proc.returncode, out, out, self.session, self.tmp / "evidence",
                         steps, senders, read_summary(self.session))


def forged_session(tmp: Path, session: Path) -> Path:
    """A folder with the run's store and its key file, the client key replaced by a
    stranger's (the collector's address and public key are no secret)."""
    fake = tmp / "fake"
    fake.mkdir()
    (fake / "telemetry.sqlite").symlink_to(session / "telemetry.sqlite")
    real = orjson.loads((session / "capture.key").read_bytes())
    keys = client_keys_from(real["keys"])
    public, secret = zmq.curve_keypair()
    stranger = client_keys_text(keys.__class__(keys.server_public, b"", public, secret))
    (fake / "capture.key").write_bytes(orjson.dumps({**real, "keys": stranger}))
    return fake


def test_traceml_capture_asks_a_live_run_and_a_stranger_is_refused(tmp_path: Path) -> None:
    job = LiveJob(tmp_path, "--capture-max-mb", "0.1")
    try:
        job.wait_for_steps(30)
        assert os.stat(job.session / "capture.key").st_mode & 0o077 == 0
        refused = job.capture(forged_session(tmp_path, job.session), "--rank", "1")
        assert refused.returncode == 1 and "did not take the request" in refused.stderr
        asked = job.capture(job.session, "--rank", "1", "--steps", "2")
        assert asked.returncode == 0, asked.stderr
        assert "Operators (profiler capture c1-manual" in asked.stdout
    finally:
        res = job.finish()
    assert res.returncode == 0, res.stdout[-3000:]
    assert res.summary is not None
    # --capture off: the straggler asked for nothing; the one capture is the manual one,
    # cut at its 0.1 MB cap after its first step, which it says.
    (c,) = res.summary["captures"]
    assert (c["trigger"], c["suspect"], c["reference"]) == ("manual", 1, 0)
    assert c["num_steps"] == 1 and any("reached its cap of" in n for n in c["notes"]), c
    for t in c["traces"]:
        assert len(orjson.dumps(trace_events(t["path"]))) <= 100_000
    assert res.summary["meta"]["rejected"].get("failed handshake (no or wrong session key)")
    assert_steps_unchanged(res)
