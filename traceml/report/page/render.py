"""The browser page: one HTML file with our own CSS and JS inlined (collector, offline analysis).

Runs in the collector (the dashboard serves it at ``/``) and in offline
analysis (final_summary.html). The page renders a snapshot document
(:func:`traceml.report.page.snapshot.snapshot_to_json`): embedded in the file, or
fetched from ``/api/snapshot`` about once a second. Nothing is loaded from
the network; the favicon is an empty data URL so the browser asks for none.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from importlib import resources

import orjson

from traceml.records import Json

SNAPSHOT_PATH = "api/snapshot"  # relative: the page is served under the run's token
POLL_INTERVAL_MS = 1000
_PLACEHOLDER = re.compile(r"__(TITLE|STYLE|DATA|SCRIPT)__")


def _asset(name: str) -> str:
    return resources.files("traceml.report.page").joinpath("static", name).read_text(encoding="utf-8")


def embed_json(data: Mapping[str, Json]) -> str:
    """JSON safe inside a ``<script>`` element: every ``<`` escaped as ``\\u003c``."""
    return orjson.dumps(data).decode().replace("<", "\\u003c")


def render_page(data: Mapping[str, Json], title: str) -> str:
    """The page with ``data`` embedded: a snapshot document, or ``{"poll": url}``."""
    values = {"TITLE": html.escape(title), "STYLE": _asset("page.css"),
              "DATA": embed_json(data), "SCRIPT": _asset("page.js")}
    # One pass, so text inside the data can never be taken for a placeholder.
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], _asset("page.html"))


def live_page(session_id: str) -> str:
    """The dashboard page: it polls the snapshot URL until the run has ended."""
    return render_page({"poll": SNAPSHOT_PATH, "interval_ms": POLL_INTERVAL_MS},
                       f"traceml live · {session_id}")
