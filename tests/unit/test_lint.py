"""The package type-checks under mypy --strict and passes ruff (STYLE.md).

Both run through this interpreter (``python -m``): they are in
requirements-dev.txt, so a missing one fails here rather than skipping.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_mypy_strict_on_the_package() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def test_ruff_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "traceml", "tests", "scripts",
                           "examples"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
