"""Shared fixtures: run the real CLI, read the real store, keep torch unpatched."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "e2e" / "scripts"


def _torch_surface() -> dict[str, Any] | None:
    if "torch" not in sys.modules:
        return None
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim import optimizer as opt_mod
    from torch.utils.data import dataloader

    from traceml.agent.comm import COLLECTIVES

    dist = torch.distributed
    return {
        "collectives": {name: getattr(dist, name, None) for name in COLLECTIVES},
        "c10d": {name: getattr(dist.distributed_c10d, name, None) for name in COLLECTIVES},
        "work_wait": dist.Work.__dict__["wait"],
        "ddp": {name: DDP.__dict__[name] for name in ("_ddp_init_helper", "register_comm_hook")},
        "module_call": torch.nn.Module.__dict__["__call__"],
        "compile": torch.__dict__.get("compile"),
        "backward": torch.Tensor.__dict__["backward"],
        "autograd_backward": torch.autograd.backward,
        "next": dataloader._BaseDataLoaderIter.__dict__["__next__"],
        "copies": [name in torch.Tensor.__dict__ for name in ("to", "cuda", "pin_memory")],
        "pre_hooks": len(opt_mod._global_optimizer_pre_hooks),
        "post_hooks": len(opt_mod._global_optimizer_post_hooks),
    }


@pytest.fixture(autouse=True)
def torch_unpatched() -> Any:
    """Every test leaves torch exactly as it found it."""
    before = _torch_surface()
    yield
    after = _torch_surface()
    if before is not None:
        assert after == before, "a test left torch patched"


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    session_dir: Path
    evidence_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    senders: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    def evidence(self) -> dict[int, dict[str, Any]]:
        out = {}
        for path in self.evidence_dir.glob("rank*.json"):
            data = json.loads(path.read_text())
            out[data["rank"]] = data
        return out

    def workers(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in self.evidence_dir.glob("worker-*.json")]

    def steps_of(self, rank: int) -> list[dict[str, Any]]:
        return [s for s in self.steps if s["rank"] == rank]


def read_store(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if not path.exists():
        return [], []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        steps = [dict(r) for r in db.execute("SELECT * FROM steps ORDER BY rank, step")]
        senders = [dict(r) for r in db.execute("SELECT * FROM senders")]
    except sqlite3.OperationalError:  # polled before the collector made its tables
        return [], []
    finally:
        db.close()
    return steps, senders


def run_traceml(tmp_path: Path, *args: str, session: str = "s1", env: dict[str, str] | None = None,
                timeout: float = 180, traceml_cmd: list[str] | None = None,
                cwd: Path | None = None) -> RunResult:
    evidence = tmp_path / "evidence"
    evidence.mkdir(exist_ok=True)
    full_env = dict(os.environ, EVIDENCE_DIR=str(evidence), OMP_NUM_THREADS="1")
    full_env.update(env or {})
    cmd = (traceml_cmd or [sys.executable, "-m", "traceml"]) + [
        args[0], "--logs-dir", str(tmp_path / "logs"), "--session-id", session, *args[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd or tmp_path)
    session_dir = tmp_path / "logs" / session
    steps, senders = read_store(session_dir / "telemetry.sqlite")
    return RunResult(proc.returncode, proc.stdout, proc.stderr, session_dir, evidence,
                     steps, senders, read_summary(session_dir))


def read_summary(session_dir: Path) -> dict[str, Any] | None:
    """final_summary.json of a session, validated against the documented schema."""
    from traceml.report import validate_summary

    path = session_dir / "final_summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    problems = validate_summary(summary)
    assert problems == [], problems
    text = (session_dir / "final_summary.txt").read_text()
    assert text.startswith("+") and "TraceML Run Summary" in text
    return summary


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], object], timeout_s: float = 20.0,
               every_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return False


def script(name: str) -> str:
    return str(SCRIPTS / name)
