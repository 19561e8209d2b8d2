"""Log a traceml summary to an MLflow run (user process).

    from traceml.integrations.mlflow import log_summary
    log_summary("logs/my-session")          # into the active run, or a new run

Numeric ``traceml/...`` values become metrics, text values and
``traceml/verdict`` become tags, and the session's
``final_summary.{json,txt,html}`` are logged as artifacts under ``traceml/``.
"""

from __future__ import annotations

import time

from traceml.integrations.requirement import missing_framework
from traceml.integrations.summary_source import (
    LoadedSummary,
    SummaryLike,
    artifact_files,
    load_summary,
)

try:
    import mlflow
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient
except ImportError as exc:
    raise missing_framework("mlflow", "mlflow", "mlflow") from exc

__all__ = ["ARTIFACT_PATH", "log_summary"]

ARTIFACT_PATH = "traceml"


def log_summary(summary_or_path: SummaryLike, run_id: str | None = None,
                artifact_path: str = ARTIFACT_PATH) -> str:
    """Logs to run ``run_id`` (default: the active run; with none, a run of its own).

    ``summary_or_path``: a ``final_summary.json`` path, a session folder, the
    summary document, or the dict of ``traceml.summary()``.  Returns the run id.
    """
    loaded = load_summary(summary_or_path)
    active = mlflow.active_run()
    target = run_id or (active.info.run_id if active is not None else None)
    if target is not None:
        _log(MlflowClient(), target, loaded, artifact_path)
        return target
    with mlflow.start_run(run_name=loaded.session_id) as run:
        _log(MlflowClient(), run.info.run_id, loaded, artifact_path)
        return str(run.info.run_id)


def _log(client: MlflowClient, run_id: str, loaded: LoadedSummary, artifact_path: str) -> None:
    now_ms = int(time.time() * 1000)
    metrics = [Metric(key, value, now_ms, 0) for key, value in loaded.metrics.items()]
    tags = [RunTag(key, value) for key, value in loaded.labels.items()]
    client.log_batch(run_id, metrics=metrics, tags=tags)
    with artifact_files(loaded) as files:
        for path in files:
            client.log_artifact(run_id, str(path), artifact_path)
