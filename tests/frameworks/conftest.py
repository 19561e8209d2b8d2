"""Framework tests: the ``frameworks`` marker for the slow end-to-end runs."""

from __future__ import annotations

import pytest

# Lightning wraps ``torch.compile`` when it is first imported (its fabric's wrappers):
# imported here, as the tests are collected, before any test takes its snapshot of torch
# (tests/conftest.py), so that its wrap is not taken for a patch traceml left behind.
try:
    import lightning.pytorch  # noqa: F401
except ImportError:  # the lightning extra is not installed: its tests skip
    pass


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "frameworks: end-to-end runs of a framework's Trainer (needs its extra)")

