"""What the W&B and MLflow integrations log, loaded from any form of a summary (user process).

A summary is given as a ``final_summary.json`` path, a session folder
(``logs/<session>``), the ``final_summary.json`` document as a dict, or the
flat dict of ``traceml.summary()``.  The files of a session (JSON, text card,
HTML report) are its artifacts, when present; a document given as a dict is
written to a temporary ``final_summary.json`` while it is logged.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from traceml.report import flatten_summary
from traceml.report.summary_files import settle
from traceml.store import STORE_FILENAME

SUMMARY_FILES = ("final_summary.json", "final_summary.txt", "final_summary.html")
VERDICT_KEY = "traceml/verdict"

SummaryLike = Union[str, "os.PathLike[str]", Mapping[str, Any]]


@dataclass(frozen=True)
class LoadedSummary:
    """The flat metrics, the verdict and the artifacts of one summary."""

    flat: dict[str, float | str]
    files: tuple[Path, ...] = ()
    document: Mapping[str, Any] | None = None  # set when given as a dict: no files yet

    @property
    def verdict(self) -> str | None:
        """The label of the primary finding, e.g. ``INPUT-BOUND``."""
        return _text(self.flat.get("traceml/primary/label"))

    @property
    def session_id(self) -> str | None:
        return _text(self.flat.get("traceml/meta/session_id"))

    @property
    def metrics(self) -> dict[str, float]:
        """The numeric entries (what metric stores accept)."""
        return {k: v for k, v in self.flat.items() if isinstance(v, float)}

    @property
    def labels(self) -> dict[str, str]:
        """The text entries plus ``traceml/verdict`` (what tags and run summaries hold)."""
        out = {k: v for k, v in self.flat.items() if isinstance(v, str)}
        if self.verdict is not None:
            out[VERDICT_KEY] = self.verdict
        return out


def load_summary(summary: SummaryLike) -> LoadedSummary:
    """Reads a path or folder, or takes a dict; ValueError when it is not a summary."""
    if isinstance(summary, Mapping):
        return _from_mapping(summary)
    path = Path(summary)
    folder = path if path.is_dir() else path.parent
    if (folder / STORE_FILENAME).exists():  # a session folder: a kill's half pair settled
        with contextlib.suppress(OSError):  # a read-only folder is read as it is
            settle(folder)
    if path.is_dir():
        path = path / "final_summary.json"
    if not path.is_file():
        raise ValueError(f"no traceml summary at {path}: give final_summary.json or its folder")
    document = json.loads(path.read_text())
    if not isinstance(document, dict) or "schema_version" not in document:
        raise ValueError(f"{path} is not a traceml final_summary.json")
    others = (path.parent / name for name in SUMMARY_FILES[1:])
    return LoadedSummary(flatten_summary(document), (path, *(p for p in others if p.is_file())))


@contextmanager
def artifact_files(loaded: LoadedSummary) -> Iterator[tuple[Path, ...]]:
    """The files to log; a document given as a dict lives in a temporary folder meanwhile."""
    if loaded.document is None:
        yield loaded.files
        return
    with tempfile.TemporaryDirectory(prefix="traceml-summary-") as folder:
        path = Path(folder) / SUMMARY_FILES[0]
        path.write_text(json.dumps(loaded.document, indent=2))
        yield (path,)


def _from_mapping(summary: Mapping[str, Any]) -> LoadedSummary:
    if summary and all(str(key).startswith("traceml/") for key in summary):
        flat = {str(k): _flat_value(v) for k, v in summary.items()}  # traceml.summary()
        return LoadedSummary({k: v for k, v in flat.items() if v is not None})
    if "schema_version" not in summary:
        raise ValueError("not a traceml summary: expected the final_summary.json document "
                         "or the dict of traceml.summary()")
    return LoadedSummary(flatten_summary(summary), document=summary)


def _text(value: float | str | None) -> str | None:
    return value if isinstance(value, str) else None


def _flat_value(value: Any) -> float | str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None
