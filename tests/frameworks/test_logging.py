"""log_summary into a real W&B run (offline mode) and a real MLflow file store.

The summary comes from a recorded scenario (tests/fixtures/scenarios/healthy),
rendered the way the end of a run writes it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from traceml.integrations.summary_source import load_summary
from traceml.records_json import from_jsonable
from traceml.report import build_report, flatten_summary, render_text, report_to_json

HEALTHY = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios" / "healthy" / "run.json"


@pytest.fixture(scope="module")
def summary() -> dict[str, Any]:
    report = build_report(from_jsonable(json.loads(HEALTHY.read_text())), 10_000)
    document: dict[str, Any] = json.loads(json.dumps(report_to_json(report)))
    document["_text"] = render_text(report)
    return document


@pytest.fixture
def session(tmp_path: Path, summary: dict[str, Any]) -> Path:
    """A session folder as the end of a run leaves it (no HTML: it is optional)."""
    folder = tmp_path / "logs" / "healthy"
    folder.mkdir(parents=True)
    doc = {k: v for k, v in summary.items() if k != "_text"}
    (folder / "final_summary.json").write_text(json.dumps(doc))
    (folder / "final_summary.txt").write_text(summary["_text"])
    return folder


def document(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "_text"}


def test_every_form_of_a_summary_loads_the_same(session: Path, summary: dict[str, Any]) -> None:
    doc = document(summary)
    verdict = doc["primary"]["label"]
    forms = [session, session / "final_summary.json", str(session), doc, flatten_summary(doc)]
    for form in forms:
        loaded = load_summary(form)
        assert loaded.flat == flatten_summary(doc)
        assert loaded.verdict == verdict and loaded.labels["traceml/verdict"] == verdict
    names = [p.name for p in load_summary(session).files]
    assert names == ["final_summary.json", "final_summary.txt"]


def test_what_is_not_a_summary_is_refused(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text('{"a": 1}')
    for bad in (tmp_path, tmp_path / "other.json", {"a": 1}):
        with pytest.raises(ValueError, match="summary"):
            load_summary(bad)


# -- W&B ----------------------------------------------------------------------


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    wandb = pytest.importorskip("wandb")
    for name, sub in (("WANDB_DIR", "wandb"), ("WANDB_CACHE_DIR", "cache"),
                      ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # settings are read once per wandb session: start a fresh one here
    yield wandb
    wandb.teardown()


def offline_record(wandb: Any, tmp_path: Path, run_id: str) -> bytes:
    """The run's transaction log: what W&B would upload on ``wandb sync``."""
    wandb.teardown()  # the service writes the log behind the run: stop it to flush
    [path] = (tmp_path / "wandb").rglob(f"run-{run_id}.wandb")
    return path.read_bytes()


def test_wandb_logs_metrics_verdict_and_files(tmp_path: Path, session: Path,
                                              wandb_offline: Any) -> None:
    from traceml.integrations.wandb import log_summary

    flat = load_summary(session).flat
    run = wandb_offline.init(project="traceml-test")
    try:
        assert log_summary(session, run=run) == run.id
        logged = dict(run.summary)
    finally:
        run.finish()
    assert logged["traceml/verdict"] == "COMPUTE-BOUND"
    assert {k: logged[k] for k in flat} == flat
    record = offline_record(wandb_offline, tmp_path, run.id)
    for needle in (b"traceml/verdict", b'"COMPUTE-BOUND"', b"traceml-healthy",
                   b"final_summary.json", b"final_summary.txt"):
        assert needle in record, needle


def test_wandb_without_a_run_starts_and_finishes_one(tmp_path: Path, summary: dict[str, Any],
                                                     wandb_offline: Any) -> None:
    from traceml.integrations.wandb import log_summary

    assert wandb_offline.run is None
    run_id = log_summary(document(summary))
    assert wandb_offline.run is None
    record = offline_record(wandb_offline, tmp_path, run_id)
    assert b"traceml/step_time/diagnosis" in record and b"final_summary.json" in record


# -- MLflow -------------------------------------------------------------------


@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow >= 3.7 asks to opt in
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"file:{tmp_path / 'mlruns'}")
    yield mlflow
    mlflow.set_tracking_uri(previous)


def test_mlflow_logs_metrics_tags_and_files(session: Path, mlflow_store: Any) -> None:
    from traceml.integrations.mlflow import log_summary

    loaded = load_summary(session)
    run_id = log_summary(session)
    assert mlflow_store.active_run() is None
    client = mlflow_store.tracking.MlflowClient()
    run = client.get_run(run_id)
    assert run.info.run_name == "healthy"
    assert run.data.metrics == loaded.metrics and run.data.metrics
    assert run.data.tags["traceml/verdict"] == "COMPUTE-BOUND"
    assert run.data.tags["traceml/step_time/diagnosis"] == loaded.flat["traceml/step_time/diagnosis"]
    artifacts = [a.path for a in client.list_artifacts(run_id, "traceml")]
    assert artifacts == ["traceml/final_summary.json", "traceml/final_summary.txt"]
    local = Path(client.download_artifacts(run_id, "traceml/final_summary.json"))
    assert json.loads(local.read_text())["primary"]["label"] == "COMPUTE-BOUND"


def test_mlflow_logs_into_the_active_run(summary: dict[str, Any], mlflow_store: Any) -> None:
    from traceml.integrations.mlflow import log_summary

    with mlflow_store.start_run() as active:
        assert log_summary(document(summary)) == active.info.run_id
    client = mlflow_store.tracking.MlflowClient()
    run = client.get_run(active.info.run_id)
    assert run.data.tags["traceml/verdict"] == "COMPUTE-BOUND"
    artifacts = [a.path for a in client.list_artifacts(active.info.run_id, "traceml")]
    assert artifacts == ["traceml/final_summary.json"]
