"""``python -m traceml`` works like ``traceml``."""

from traceml.cli import entry

entry()
