"""Errors shared by every traceml process.

`UsageError` is bad user input: the CLI prints its message on one line and
exits with status 2, without a traceback.
"""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user; the message says what to do."""

    exit_code = 2


class ProtocolError(ValueError):
    """A wire message that cannot be decoded (garbage, foreign, wrong version)."""
