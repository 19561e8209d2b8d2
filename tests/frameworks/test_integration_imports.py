"""The integrations stay optional: traceml never imports them, and a missing
framework fails with the pip command to run.  The callbacks without ``traceml
run`` do nothing and warn once; with a runtime they mark exact boundaries."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import traceml
from traceml.errors import WarnOnce
from traceml.integrations import boundaries
from traceml.integrations.requirement import EXTRAS

FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "wandb", "mlflow",
              "ray")
MISSING = {
    "huggingface": (("transformers",), "hf"),
    "lightning": (("lightning", "lightning.pytorch", "pytorch_lightning"), "lightning"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
    "ray": (("ray", "ray.train"), "ray"),
}


def test_import_traceml_imports_no_framework() -> None:
    code = ("import sys, traceml, traceml.integrations; "
            f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_traceml_source_never_imports_the_integrations() -> None:
    for path in Path(traceml.__file__).parent.rglob("*.py"):
        if "integrations" not in path.parts:
            assert "traceml.integrations" not in path.read_text(), path


@pytest.mark.parametrize("module", sorted(MISSING))
def test_missing_framework_names_the_pip_command(monkeypatch: pytest.MonkeyPatch,
                                                  module: str) -> None:
    blocked, extra = MISSING[module]
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # None makes "import name" fail
    monkeypatch.delitem(sys.modules, f"traceml.integrations.{module}", raising=False)
    with pytest.raises(ImportError) as raised:
        importlib.import_module(f"traceml.integrations.{module}")
    packages = " ".join(f"'{r}'" for r in EXTRAS[extra])
    assert f"pip install {packages} (traceml-run's '{extra}' extra)" in str(raised.value)


def test_extras_named_in_errors_are_pyprojects() -> None:
    """The packages an error tells to install are those the extra installs."""
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert project["name"] == "traceml-run"
    assert {k: tuple(v) for k, v in project["optional-dependencies"].items()
            if k in EXTRAS} == EXTRAS


class FakeRuntime:
    """Records the boundaries a callback marks."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def step_enter(self) -> None:
        self.calls.append("enter")

    def step_exit(self) -> None:
        self.calls.append("exit")


def with_runtime(monkeypatch: pytest.MonkeyPatch, runtime: FakeRuntime | None) -> None:
    fake_module = SimpleNamespace(active=lambda: runtime)
    monkeypatch.setitem(sys.modules, "traceml.agent.runtime", fake_module)
    monkeypatch.setattr(boundaries, "_warnings", WarnOnce())


def hf_callback() -> Any:
    hf = pytest.importorskip("transformers")
    from traceml.integrations.huggingface import TraceMLCallback

    assert isinstance(TraceMLCallback(), hf.TrainerCallback)
    return TraceMLCallback()


def test_hf_callback_marks_each_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    callback, runtime = hf_callback(), FakeRuntime()
    with_runtime(monkeypatch, runtime)
    for _ in range(3):
        callback.on_step_begin(None, None, None)
        callback.on_step_end(None, None, None)
    assert runtime.calls == ["enter", "exit"] * 3


def test_hf_callback_without_traceml_run_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    callback = hf_callback()
    with_runtime(monkeypatch, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            callback.on_step_begin(None, None, None)
            callback.on_step_end(None, None, None)
    expected = ("traceml.integrations.huggingface.TraceMLCallback: not running under "
                "'traceml run'; steps are not traced")
    assert [str(w.message) for w in caught] == [expected]


def lightning_callback() -> Any:
    pytest.importorskip("lightning")
    from traceml.integrations.lightning import TraceMLCallback

    return TraceMLCallback()


def drive_lightning(callback: Any, num_batches: int, accum: int) -> None:
    """The hook sequence of a fit whose optimizer steps every ``accum`` batches."""
    trainer = SimpleNamespace(global_step=0)
    callback.on_train_start(trainer, None)
    for batch_idx in range(num_batches):
        callback.on_train_batch_start(trainer, None, None, batch_idx)
        if (batch_idx + 1) % accum == 0:
            trainer.global_step += 1
        callback.on_train_batch_end(trainer, None, None, None, batch_idx)


@pytest.mark.parametrize("accum", [1, 3])
def test_lightning_callback_marks_each_optimizer_step(monkeypatch: pytest.MonkeyPatch,
                                                      accum: int) -> None:
    callback, runtime = lightning_callback(), FakeRuntime()
    with_runtime(monkeypatch, runtime)
    drive_lightning(callback, num_batches=4 * accum, accum=accum)
    assert runtime.calls == ["enter", "exit"] * 4


def test_lightning_callback_without_traceml_run_warns_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    callback = lightning_callback()
    with_runtime(monkeypatch, None)
    with pytest.warns(RuntimeWarning, match="not running under 'traceml run'") as caught:
        drive_lightning(callback, num_batches=6, accum=2)
    assert len(caught) == 1
