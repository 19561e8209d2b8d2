"""The summary's two files, ``final_summary.json`` and ``final_summary.txt``, written as
one pair, all or nothing (offline analysis: the launcher's end, ``traceml report``).

Two files cannot be renamed at once, so the pair is committed through a small journal:
both are written to temporary files in the session folder (fsynced), then a journal
naming them is put in place atomically: that rename is the commit.  Then both are
renamed over the old pair and the journal removed.  A kill before the commit leaves the
old pair and some temporary files; after it, a journal that `settle` completes.  Every
writer and reader of the pair (`save_pair`, ``traceml compare``'s load, the W&B and
MLflow loaders) settles first, so it never sees half a pair: the new text beside the
old JSON, or a stray temporary file.  Writers and settlers take the folder's lock
(``flock`` on the folder itself), so two at once never remove each other's files.  A
journal names only the pair's own files: one naming anything else (a session folder
someone crafted) is ignored.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import orjson

JOURNAL = ".final_summary.commit"
TEMP_PREFIX = ".final_summary."  # the pair's temporary files: .final_summary.json.XXXX, ...
PAIR_NAMES = frozenset({"final_summary.json", "final_summary.txt"})
# what the pair's writers name their temporary files (not the HTML report's: not ours)
_TEMP_PREFIXES = tuple(f".{name}." for name in (*sorted(PAIR_NAMES), JOURNAL.lstrip(".") + ".tmp"))


def save_pair(folder: Path, names: tuple[str, str], contents: tuple[bytes, bytes],
              mode: int | None = None) -> None:
    """Write ``contents`` to ``names`` (of `PAIR_NAMES`) in ``folder`` as one pair
    (OSError when they cannot be written: a full disk; then the old pair stays, with no
    temporary file)."""
    assert set(names) <= PAIR_NAMES, names
    with _locked(folder):
        _settle(folder)
        temps: list[str] = []
        try:
            for name, data in zip(names, contents):
                temps.append(_write_temp(folder, name, data, mode))
            _write_journal(folder, dict(zip(names, temps)))
        except BaseException:
            for temp in temps:
                (folder / temp).unlink(missing_ok=True)
            raise
        _settle(folder)


def settle(folder: Path) -> None:
    """Complete a committed pair (its journal is there) or drop an uncommitted one (its
    temporary files): afterwards the folder holds one whole pair, or the old one."""
    with _locked(folder):
        _settle(folder)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """The folder's lock, held by one writer or settler at a time."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


def _settle(folder: Path) -> None:
    journal = folder / JOURNAL
    named: dict[str, str] = {}
    if journal.exists():
        with contextlib.suppress(OSError, orjson.JSONDecodeError, AttributeError):
            named = {k: v for k, v in orjson.loads(journal.read_bytes()).items()
                     if k in PAIR_NAMES and _own_temp(v)}
        for final, temp in named.items():
            if (folder / temp).exists():
                os.replace(folder / temp, folder / final)
        _sync(folder)
        journal.unlink(missing_ok=True)
    for path in folder.glob(TEMP_PREFIX + "*"):
        if _own_temp(path.name) and path.name not in named.values():
            path.unlink(missing_ok=True)
    _sync(folder)


def _own_temp(name: object) -> bool:
    """Whether a journal's entry names one of the pair's temporary files in the folder."""
    return isinstance(name, str) and name.startswith(_TEMP_PREFIXES) and Path(name).name == name


def write_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """One file written whole or not at all: a temporary file in the same folder,
    fsynced, renamed over ``path``, then the folder fsynced; ``mode``: its permission
    bits."""
    temp = _write_temp(path.parent, path.name, data, mode)
    os.replace(path.parent / temp, path)
    _sync(path.parent)


def _write_temp(folder: Path, name: str, data: bytes, mode: int | None) -> str:
    """A temporary file of ``data`` in ``folder`` (fsynced); none is left when it fails."""
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(temp, mode)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return Path(temp).name


def _write_journal(folder: Path, named: dict[str, str]) -> None:
    """The commit: the journal, in place at once (its own temporary file renamed)."""
    temp = _write_temp(folder, JOURNAL.lstrip(".") + ".tmp", orjson.dumps(named), None)
    os.replace(folder / temp, folder / JOURNAL)
    _sync(folder)


def _sync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
