"""Fixtures the end-to-end tests share with tests/live."""

from tests.live.conftest import browser  # noqa: F401 (headless Chromium: the Perfetto UI)
