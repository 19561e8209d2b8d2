"""The copy-paste examples of docs/frameworks.md run as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_traceml

pytestmark = pytest.mark.frameworks
EXAMPLES = ROOT / "examples" / "frameworks"
NEEDS = {"train_hf.py": "transformers", "train_lightning.py": "lightning",
         "train_accelerate.py": "accelerate"}
OPTIONS = {"train_hf.py": ["--callback"], "train_lightning.py": ["--callback", "--accum", "2"],
           "train_accelerate.py": ["--accum", "2"]}


@pytest.mark.parametrize("example", sorted(NEEDS))
def test_training_example_runs_under_traceml(tmp_path: Path, example: str) -> None:
    pytest.importorskip(NEEDS[example])
    res = run_traceml(tmp_path, "run", str(EXAMPLES / example), "--steps", "6",
                      *OPTIONS[example], timeout=150)
    assert res.returncode == 0, res.stderr[-4000:]
    assert len(res.steps) == 6 and all(s["num_optimizer"] == 1 for s in res.steps)
    assert (res.session_dir / "final_summary.json").is_file()


@pytest.mark.parametrize("target", ["wandb", "mlflow"])
def test_log_summary_example_logs_a_real_session(tmp_path: Path, target: str) -> None:
    pytest.importorskip(target)
    pytest.importorskip("accelerate")
    res = run_traceml(tmp_path, "run", str(EXAMPLES / "train_accelerate.py"), "--steps", "6")
    assert res.returncode == 0, res.stderr[-4000:]
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true",
               WANDB_DIR=str(tmp_path), WANDB_CACHE_DIR=str(tmp_path / "cache"),
               WANDB_CONFIG_DIR=str(tmp_path / "config"), WANDB_DATA_DIR=str(tmp_path / "data"),
               MLFLOW_TRACKING_URI=f"file:{tmp_path / 'mlruns'}", MLFLOW_ALLOW_FILE_STORE="true")
    out = subprocess.run([sys.executable, str(EXAMPLES / "log_summary.py"), str(res.session_dir),
                          "--to", target], check=False, capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.startswith(f"logged to {target} run ")
    store = tmp_path / ("wandb" if target == "wandb" else "mlruns")
    assert any(p.name == "final_summary.json" or p.suffix == ".wandb" for p in store.rglob("*"))
