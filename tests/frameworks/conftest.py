"""Framework tests: the ``frameworks`` marker for the slow end-to-end runs."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "frameworks: end-to-end runs of a framework's Trainer (needs its extra)")
