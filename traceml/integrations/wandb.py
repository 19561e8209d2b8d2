"""Log a traceml summary to a Weights & Biases run (user process).

    from traceml.integrations.wandb import log_summary
    log_summary("logs/my-session")          # into wandb.run, or a new run

The flat ``traceml/...`` values and ``traceml/verdict`` go to the run's
summary (one value per run, what the runs table compares); the session's
``final_summary.{json,txt,html}`` go into one artifact of type
``traceml-summary``.
"""

from __future__ import annotations

from typing import Any

from traceml.integrations.requirement import missing_framework
from traceml.integrations.summary_source import (
    LoadedSummary,
    SummaryLike,
    artifact_files,
    load_summary,
)

try:
    import wandb
except ImportError as exc:
    raise missing_framework("wandb", "wandb", "wandb") from exc

__all__ = ["ARTIFACT_TYPE", "log_summary"]

ARTIFACT_TYPE = "traceml-summary"


def log_summary(summary_or_path: SummaryLike, run: Any = None) -> str:
    """Logs to ``run`` (default: ``wandb.run``; with none, a run of its own); returns its id.

    ``summary_or_path``: a ``final_summary.json`` path, a session folder, the
    summary document, or the dict of ``traceml.summary()``.
    """
    loaded = load_summary(summary_or_path)
    target = run if run is not None else wandb.run
    if target is not None:
        _log(target, loaded)
        return str(target.id)
    own = wandb.init(name=loaded.session_id, job_type="traceml")
    try:
        _log(own, loaded)
        return str(own.id)
    finally:
        own.finish()


def _log(run: Any, loaded: LoadedSummary) -> None:
    run.summary.update({**loaded.metrics, **loaded.labels})
    with artifact_files(loaded) as files:
        if not files:
            return
        artifact = wandb.Artifact(_artifact_name(loaded), type=ARTIFACT_TYPE,
                                  metadata={"verdict": loaded.verdict})
        for path in files:
            artifact.add_file(str(path), name=path.name)
        run.log_artifact(artifact)


def _artifact_name(loaded: LoadedSummary) -> str:
    return f"traceml-{loaded.session_id}" if loaded.session_id else "traceml-summary"
