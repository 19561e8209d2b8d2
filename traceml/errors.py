"""Errors and warnings shared by every traceml process.

`UsageError` is bad user input: the CLI prints its message on one line and
exits with status 2, without a traceback.  `WarnOnce` is how code that runs
inside the user's process (the agent, the public API) reports its own
faults: once per cause, never again for the same cause.  Standard library
only, so the agent may import it.
"""

from __future__ import annotations

import sys
import threading
import warnings


class UsageError(Exception):
    """Bad input from the user; the message says what to do."""

    exit_code = 2


class ProtocolError(ValueError):
    """A wire message that cannot be decoded (garbage, foreign, wrong version)."""


class WarnOnce:
    """Warns once per distinct cause: a failure that repeats every step says
    so once, and a second, different failure still gets its own warning."""

    def __init__(self) -> None:
        self._causes: set[str] = set()
        self._lock = threading.Lock()  # the training and sender threads both warn

    def first(self, cause: str) -> bool:
        """True the first time ``cause`` is seen, False ever after."""
        with self._lock:
            if cause in self._causes:
                return False
            self._causes.add(cause)
            return True

    def to_stderr(self, cause: str, message: str) -> None:
        """A ``traceml: warning:`` line on stderr (the agent's threads)."""
        if self.first(cause):
            print(f"traceml: warning: {message}", file=sys.stderr)

    def warn(self, cause: str, message: str, stacklevel: int = 1) -> None:
        """A RuntimeWarning (the public API, called by the user); ``stacklevel``
        counts from the caller of this method, as in `warnings.warn`."""
        if self.first(cause):
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
