"""The workers' output while ``--mode=cli`` shows its view (launcher process).

With a live view on the terminal, torch elastic writes each worker's stdout
and stderr to files (``--redirects 3`` under a log folder) instead of the
terminal, so nothing the workers print can garble the view; every byte stays
in those files, whose folder the launcher prints. This module follows them
and keeps the last lines for the view. Files are found where torch puts them:
``<log_dir>/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log``.
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

READ_MAX_BYTES = 1 << 20
"""Bytes read per file and poll at most; the rest waits for the next poll."""

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class OutputLine:
    """One line a worker printed: its local rank, the text, and whether it came on stderr."""

    local_rank: int
    text: str
    is_err: bool


def clean_line(raw: str) -> str:
    """What a terminal would end up showing for one line: the text after the last carriage
    return (progress bars), without escape sequences or control characters."""
    shown = [part for part in raw.split("\r") if part.strip()]
    text = shown[-1] if shown else ""
    return _CONTROL.sub("", _ANSI.sub("", text).expandtabs(4))


class WorkerOutput:
    """Follows every worker's log files under ``log_dir``; keeps the last ``num_lines``.
    ``skip``: entries of ``log_dir`` that belong to earlier runs."""

    def __init__(self, log_dir: Path, num_lines: int = 10,
                 skip: frozenset[str] = frozenset()) -> None:
        self.log_dir = log_dir
        self.skip = skip
        self.lines: deque[OutputLine] = deque(maxlen=num_lines)
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def poll(self) -> tuple[OutputLine, ...]:
        """Read what was written since the last poll; the last lines, oldest first.

        The files carry no timestamps, so the new lines of the files are interleaved
        (one from each in turn): every rank keeps a share of the view, and the order
        is roughly the order in which they were written.
        """
        fresh = [self._read(path) for path in sorted(self.log_dir.glob("*/attempt_*/*/std*.log"))
                 if path.relative_to(self.log_dir).parts[0] not in self.skip]
        for turn in itertools.zip_longest(*fresh):
            self.lines.extend(line for line in turn if line is not None)
        return tuple(self.lines)

    def _read(self, path: Path) -> list[OutputLine]:
        offset = self._offsets.get(path, 0)
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read(READ_MAX_BYTES)
        if not data:
            return []
        self._offsets[path] = offset + len(data)
        *complete, rest = (self._partial.pop(path, b"") + data).split(b"\n")
        if rest:
            self._partial[path] = rest
        local_rank = int(path.parent.name) if path.parent.name.isdigit() else -1
        texts = (clean_line(raw.decode("utf-8", errors="replace")) for raw in complete)
        return [OutputLine(local_rank, text, path.name == "stderr.log")
                for text in texts if text.strip()]
