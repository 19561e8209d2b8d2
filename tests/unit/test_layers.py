"""Imports point one way (STYLE.md): the import contracts in pyproject.toml hold, and a
deliberate upward import, direct or through a module in between, breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(no_cache=True, no_logo=True))")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the ``traceml`` package under ``root``, with its pyproject.toml."""
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(root), "PATH": ""})


def test_the_import_contracts_hold() -> None:
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def _copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "traceml", tmp_path / "traceml",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_an_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _append(root / "traceml" / "store" / "writer.py", "import traceml.report  # upward")
    done = lint(root)
    assert done.returncode == 1, done.stdout
    assert "Layers: a module imports only the layers below its own BROKEN" in done.stdout
    assert "traceml.store.writer -> traceml.report" in done.stdout


def test_an_indirect_import_into_the_agent_is_caught(tmp_path: Path) -> None:
    """The agent imports traceml.sender (allowed); sender importing the store would load
    the store in every rank: the agent's contract names the chain."""
    root = _copy(tmp_path)
    _append(root / "traceml" / "sender.py", "import traceml.store  # loads the store in the ranks")
    done = lint(root)
    assert done.returncode == 1, done.stdout
    broken = done.stdout.split("Broken contracts")[1]
    assert "traceml.agent" in broken and "traceml.sender -> traceml.store" in broken
    assert "the user's ranks, loads none of" in broken


def test_torch_in_analysis_code_is_caught(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _append(root / "traceml" / "diagnosis" / "stats.py", "import torch  # analysis needs no torch")
    done = lint(root)
    assert done.returncode == 1 and "need no torch BROKEN" in done.stdout, done.stdout


def test_a_new_top_level_module_must_be_placed_in_a_layer(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "traceml" / "newcomer.py").write_text("X = 1\n")
    done = lint(root)
    assert done.returncode != 0 and "traceml.newcomer" in done.stdout + done.stderr
