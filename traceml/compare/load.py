"""Find and read the two summaries ``traceml compare`` is given (offline analysis).

Runs in the offline-analysis process. A side is a ``final_summary.json`` file
or a session folder that holds one. Anything else - a missing path, a folder
without a summary, a file that is not JSON, JSON that is not a traceml summary,
a summary of a schema major version this traceml cannot read - is a
:class:`~traceml.errors.UsageError` whose one-line message says what to do.

Summaries of the same major version but another minor version are read
leniently (see :mod:`traceml.compare.summary`); the report states the
difference. A summary of exactly this version that does not match the schema
is also read leniently, and its problems are kept for the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path

from traceml.compare.summary import RunSummary, decode_summary
from traceml.errors import UsageError
from traceml.report.model import SCHEMA_VERSION
from traceml.report.schema import validate_summary
from traceml.report.summary_files import settle

SUMMARY_FILENAME = "final_summary.json"
MAX_SUMMARY_BYTES = 256 << 20  # far above any summary: a cap for /dev/zero and the like

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def load_side(which: str, given: str) -> RunSummary:
    """Read side ``which`` ("A" or "B") from a final_summary.json or a session folder."""
    path = resolve_summary_path(which, given)
    doc = read_json_object(which, path)
    version = doc.get("schema_version")
    if not isinstance(version, str) or not isinstance(doc.get("meta"), dict):
        raise UsageError(
            f"traceml compare: {which} ({path}) is not a traceml final_summary.json "
            "(no schema_version or meta); pass the final_summary.json that 'traceml run' "
            "wrote, or its session folder")
    if major(version) != major(SCHEMA_VERSION):
        raise UsageError(
            f"traceml compare: {which} ({path}) has summary schema {version}, but this "
            f"traceml reads schema {major(SCHEMA_VERSION)}.x; compare it with the traceml "
            "version that wrote it, or rerun with this one")
    problems = tuple(validate_summary(doc)) if version == SCHEMA_VERSION else ()
    return decode_summary(doc, side_label(given), str(path), problems)


def resolve_summary_path(which: str, given: str) -> Path:
    """The summary file of a side: the path itself, or ``<folder>/final_summary.json``."""
    path = Path(given)
    folder = path if path.is_dir() else path.parent
    if (folder / "telemetry.sqlite").exists():  # a session folder: a kill's half pair settled
        with contextlib.suppress(OSError):  # a read-only folder is read as it is
            settle(folder)
    if path.is_dir():
        inside = path / SUMMARY_FILENAME
        if not inside.is_file():
            raise UsageError(
                f"traceml compare: {which}: folder {given} has no {SUMMARY_FILENAME}; pass a "
                "session folder (logs/<session>) of a finished 'traceml run', or the file itself")
        return inside
    if not path.exists():
        raise UsageError(f"traceml compare: {which}: {given} does not exist; pass a "
                         f"{SUMMARY_FILENAME} or a session folder")
    return path


def read_json_object(which: str, path: Path) -> dict[str, object]:
    """The JSON object in ``path``; a UsageError for unreadable files and non-objects."""
    try:
        text = _read_capped(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"traceml compare: {which}: cannot read {path} ({reason}); pass a "
                         f"readable {SUMMARY_FILENAME}") from None
    try:
        doc = _printable(json.loads(text))
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"traceml compare: {which}: {path} is not valid JSON (line {exc.lineno}: {exc.msg}); "
            f"pass the {SUMMARY_FILENAME} that 'traceml run' wrote") from None
    except RecursionError:
        raise UsageError(
            f"traceml compare: {which}: {path} is nested too deeply to be a summary; pass the "
            f"{SUMMARY_FILENAME} that 'traceml run' wrote") from None
    if not isinstance(doc, dict):
        raise UsageError(
            f"traceml compare: {which} ({path}) is not a traceml final_summary.json (not a JSON "
            "object); pass the final_summary.json that 'traceml run' wrote")
    return doc


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def _printable(value: object) -> object:
    """``value`` with every terminal control character in its strings (escape sequences,
    carriage returns) and every invisible or reordering one (bidi overrides, zero-width)
    written out as ``\\x1b`` or ``\\u202e``: a crafted summary cannot move the cursor,
    recolour, rewrite or reorder what the comparison prints (its JSON and text)."""
    if isinstance(value, str):
        return _CONTROL.sub(_escape, value)
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable(v) for v in value]
    return value


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _read_capped(path: Path) -> str:
    """A regular file's text, at most :data:`MAX_SUMMARY_BYTES` (not a FIFO or a
    device, which could block or never end); ValueError otherwise."""
    with open(path, "rb", opener=_nonblocking) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        data = f.read(MAX_SUMMARY_BYTES + 1)
    if len(data) > MAX_SUMMARY_BYTES:
        raise ValueError(f"larger than {MAX_SUMMARY_BYTES >> 20} MiB")
    return data.decode("utf-8")


def _nonblocking(path: str, flags: int) -> int:
    """Open without waiting for a FIFO's writer."""
    return os.open(path, flags | os.O_NONBLOCK)


def major(version: str) -> str:
    """``"1"`` for ``"1.0"``: the part that changes on incompatible schema changes."""
    return version.split(".", 1)[0]


def side_label(given: str) -> str:
    """A short name for a side: the session folder's name, else the file's stem.

    ``logs/run1``, ``logs/run1/`` and ``logs/run1/final_summary.json`` all give
    ``run1``; ``/tmp/baseline.json`` gives ``baseline``. Only ``[A-Za-z0-9_.-]``.
    """
    path = Path(given).resolve()
    name = path.parent.name if path.name == SUMMARY_FILENAME else path.name
    if path.is_file() and path.name != SUMMARY_FILENAME:
        name = path.stem
    return _UNSAFE.sub("_", name).strip("_") or "run"
