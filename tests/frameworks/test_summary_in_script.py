"""``log_summary(traceml.summary())`` from inside a training script under ``traceml run``
(SPEC R-API-4), into a real MLflow file store and a real offline W&B run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frameworks.expectations import run_script

pytestmark = pytest.mark.frameworks
SCRIPT = "accelerate_loop.py"


def test_summary_logged_to_mlflow_from_the_script(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("accelerate")
    uri = f"file:{tmp_path / 'mlruns'}"
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow >= 3.7 asks to opt in
    res = run_script(tmp_path, SCRIPT, "--steps", "12", "--log-to", "mlflow", env=env)
    run_id = res.evidence()[0]["run_id"]
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    tags = client.get_run(run_id).data.tags
    assert tags["traceml/verdict"]
    assert "NOT MEASURED" not in tags["traceml/step_time/diagnosis"], tags


def test_summary_logged_to_wandb_from_the_script(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("accelerate")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    env.update({name: str(tmp_path / name.lower()) for name in
                ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")})
    res = run_script(tmp_path, SCRIPT, "--steps", "12", "--log-to", "wandb", env=env)
    run_id = res.evidence()[0]["run_id"]
    [record] = (tmp_path / "wandb").rglob(f"run-{run_id}.wandb")
    data = record.read_bytes()
    assert b"traceml/verdict" in data and b"traceml/step_time/diagnosis" in data
    assert b"STEP TIME NOT MEASURED" not in data
