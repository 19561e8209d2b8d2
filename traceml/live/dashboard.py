"""The ``--mode=dashboard`` web server: a thread inside the collector process (collector side).

Serves our own page at ``/<token>/`` and the current snapshot at
``/<token>/api/snapshot``, bound to 127.0.0.1 unless configured otherwise; when the
asked port is taken it takes a free one and says so in the address it returns.  The
token is made per run and is in the address traceml prints (as a notebook server's
is): another user of the machine, who can reach the port but not read the terminal,
gets 403.  On a loopback address a request must also name a loopback host (Host:
127.0.0.1, localhost or [::1]), so a web page that rebinds its own name to 127.0.0.1
(DNS rebinding) gets 403 too. Work is done only when a browser asks, at most
once per ``MIN_REBUILD_S`` whatever the number of browsers, and at most about
``BUILD_SHARE`` of a core at any size: the snapshot reads the store's new rows
(a read-only connection, never the collector's writer) so training is not slowed. When the run is over
the collector calls :meth:`Dashboard.finish`: the page gets the final report
(the same one final_summary.json holds) and the server stops, waiting at most
``FINAL_LINGER_S`` for an open page to fetch it.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import secrets
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson

from traceml.errors import UsageError
from traceml.live.tail import StoreTail
from traceml.records import Json
from traceml.report.page.render import SNAPSHOT_PATH, live_page
from traceml.report.page.snapshot import build_snapshot, live_snapshot, snapshot_to_json
from traceml.store import StoreError

MIN_REBUILD_S = 1.0
BUILD_SHARE = 0.1
"""...and a rebuild waits at least its own last build time over this share (the
collector's message loop shares the core: a snapshot of 8192 ranks takes seconds)."""
FINAL_LINGER_S = 3.0
CLIENT_ACTIVE_S = 5.0
"""A browser that asked within this many seconds is waited for at the end."""


class Dashboard:
    """The page, the snapshots, and the HTTP server thread that serves them."""

    def __init__(self, db_path: Path, session_id: str) -> None:
        self.db_path = db_path
        self.page = live_page(session_id).encode("utf-8")
        self._tail = StoreTail(db_path)
        self._lock = threading.Lock()
        self._doc = b""
        self._doc_at = float("-inf")
        self.build_s = 0.0  # the last snapshot's build (a backlog's first read left out)
        self._final: bytes | None = None
        self._final_served = threading.Event()
        self._last_request = float("-inf")
        self._server: ThreadingHTTPServer | None = None
        self.token = secrets.token_urlsafe(24)
        self.loopback_only = True  # set by start(): whether Host must name a loopback host

    def start(self, host: str, port: int) -> dict[str, Json]:
        """Listen (on a free port when ``port`` is taken) and serve in a daemon thread."""
        try:
            server = _Server((host, port), _Handler, self)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            server = _Server((host, 0), _Handler, self)
        self._server = server
        self.loopback_only = _is_loopback(host)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="traceml-dashboard", daemon=True).start()
        bound = int(server.server_address[1])
        return {"url": f"http://{_url_host(host)}:{bound}/{self.token}/", "port": bound,
                "requested_port": port}

    def refusal(self, path: str, host_header: str | None) -> str | None:
        """Why a request is refused (None: it is not): a Host that is not loopback on a
        loopback server, or a path without the run's token."""
        if self.loopback_only and not _loopback_host(host_header):
            return "this dashboard answers only to 127.0.0.1, localhost or [::1]"
        prefix = f"/{self.token}/"
        if not hmac.compare_digest(path[:len(prefix)].encode(), prefix.encode()):
            return "open the address traceml printed: it carries this run's token"
        return None

    def snapshot(self) -> bytes:
        """The current document: rebuilt at most once per MIN_REBUILD_S (and BUILD_SHARE);
        final once ended."""
        self._last_request = time.monotonic()
        with self._lock:
            if self._final is not None:
                self._final_served.set()
                return self._final
            began = time.monotonic()
            if began - self._doc_at >= max(MIN_REBUILD_S, self.build_s / BUILD_SHARE):
                try:
                    run, window_rows = self._tail.poll()
                except StoreError:
                    return self._doc  # the store is busy for a moment: the last one again
                try:
                    doc = snapshot_to_json(live_snapshot(run, window_rows), live=True)
                    self._doc = orjson.dumps(doc)
                finally:  # a build that failed waits its turn too
                    self._doc_at = time.monotonic()
                    self.build_s = self._doc_at - began - self._tail.backlog_s
            return self._doc

    def finish(self) -> None:
        """The run is over and the store closed: serve the final report, then stop."""
        from traceml.report.build import build_report
        from traceml.report.session import load_run

        try:
            run, window_rows = load_run(self.db_path.parent)
            doc = snapshot_to_json(build_snapshot(run, build_report(run, window_rows),
                                                  ended=True), live=False)
            with self._lock:
                self._final = orjson.dumps(doc)
        except UsageError as exc:
            print(f"traceml collector: dashboard has no final report: {exc}", file=sys.stderr)
        if self._final is not None and time.monotonic() - self._last_request < CLIENT_ACTIVE_S:
            self._final_served.wait(FINAL_LINGER_S)
        self.close()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _loopback_host(header: str | None) -> bool:
    """Whether a Host header names this machine's loopback (any port)."""
    if not header:
        return False
    name = header.rsplit(":", 1)[0] if not header.endswith("]") else header
    if name.startswith("[") and "]" in name:
        name = name[1:name.index("]")]
    return _is_loopback(name)


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        super().__init__(address, handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # the name http.server calls
        dashboard = self.server.dashboard
        path = self.path.split("?", 1)[0]
        refused = dashboard.refusal(path, self.headers.get("Host"))
        if refused is not None:
            self._send(403, "text/plain; charset=utf-8", f"forbidden: {refused}\n".encode())
            return
        path = path[len(dashboard.token) + 2:]
        if path in ("", "index.html"):
            self._send(200, "text/html; charset=utf-8", dashboard.page)
        elif path == SNAPSHOT_PATH:
            self._send(200, "application/json", dashboard.snapshot())
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # the base signature
        """Quiet: the collector's stdout and stderr are not for access logs."""
